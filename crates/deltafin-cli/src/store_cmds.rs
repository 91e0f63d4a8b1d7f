//! `deltafin setup` and `deltafin doctor`, with progress bars.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::Args;
use deltafin::{doctor, setup, ExpertLayoutKind, Progress, SetupOptions, StoreInfo};
use indicatif::{ProgressBar, ProgressStyle};

/// Progress bars with bytes/s and ETA.
pub struct Bars {
    bar: std::sync::Mutex<Option<ProgressBar>>,
}

impl Bars {
    pub fn new() -> Bars {
        Bars { bar: std::sync::Mutex::new(None) }
    }
}

impl Progress for Bars {
    fn begin(&self, phase: &str, total: u64) {
        if crate::say::quiet() {
            return;
        }
        let b = ProgressBar::new(total).with_style(
            ProgressStyle::with_template("{msg:>8} [{bar:32}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}")
                .expect("template")
                .progress_chars("=> "),
        );
        b.set_message(phase.to_string());
        *self.bar.lock().expect("poisoned") = Some(b);
    }
    fn advance(&self, bytes: u64) {
        if let Some(b) = &*self.bar.lock().expect("poisoned") {
            b.inc(bytes);
        }
    }
    fn end(&self) {
        if let Some(b) = self.bar.lock().expect("poisoned").take() {
            b.finish();
        }
    }
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("mode").args(["full", "stream", "rebalance"]).required(true)))]
pub struct SetupArgs {
    /// The checkpoint folder to install (release layout), or a hub repository
    /// hf://OWNER/REPO[@REVISION]: with --stream fetched from the hub (HF_ENDPOINT, HF_TOKEN and
    /// HF_HUB_OFFLINE are honoured), with --full read from the local Hugging Face cache
    /// (HF_HUB_CACHE, HF_HOME), in place with --in-place.
    #[arg(long)]
    #[arg(long, required_unless_present = "rebalance")]
    pub from: Option<String>,
    /// Install the whole model now ("full" mode).
    #[arg(long, conflicts_with = "stream")]
    pub full: bool,
    /// Start small ("stream" mode): config, tokenizer and spine now, each expert fetched from the
    /// hub the first time it is needed and cached.
    #[arg(long)]
    pub stream: bool,
    /// With --stream: disk space the expert cache may take (e.g. 200G); the coldest experts are
    /// evicted beyond it.
    #[arg(long, value_parser = parse_size)]
    pub disk_budget: Option<u64>,
    /// With --stream: fetch every expert now, so the store runs offline.
    #[arg(long)]
    pub fill: bool,
    /// With --stream: shards up to this size are downloaded whole at setup and checked against
    /// their SHA-256 (tests and benchmarks set 0 to stream every expert).
    #[arg(long, value_parser = parse_size, hide = true)]
    pub whole_shard_max: Option<u64>,
    /// The store folder to create (spine, manifest).
    #[arg(long)]
    pub out: PathBuf,
    /// A folder on a drive to hold experts (with --stream: the expert cache, spread over the
    /// folders given); repeat for several drives (default: the store). PATH:SIZE states how much
    /// it may hold (default: its free space), PATH:SIZE:RATE or PATH::RATE its read rate (e.g.
    /// 7GB/s; default: measured with a short probe).
    #[arg(long = "home", value_parser = parse_home)]
    pub homes: Vec<HomeArg>,
    /// How experts are spread over several homes: striped (each expert split over every drive
    /// by its rate; the default with one copy), weighted (whole experts, each drive its share), or
    /// round-robin (whole experts in turn; the only one with --copies above 1).
    #[arg(long, value_parser = parse_placement)]
    pub placement: Option<deltafin::Placement>,
    /// Print the layout this setup would make (bytes per drive, share of reads, expected read
    /// rate, and every placement's) and install nothing.
    #[arg(long)]
    pub plan: bool,
    /// Move an installed store's experts onto the --home folders given (a drive added or
    /// removed) or another --placement, reading them from the store itself; resumable.
    #[arg(long)]
    pub rebalance: bool,
    /// Read experts from the checkpoint's shards where they are instead of copying them.
    #[arg(long)]
    pub in_place: bool,
    /// How many homes hold each expert (a second copy lets reads fail over to another drive).
    #[arg(long, default_value_t = 1)]
    pub copies: usize,
    /// Replace what the store holds (another checkpoint, or the same one set up with other
    /// arguments) instead of refusing.
    #[arg(long)]
    pub reinstall: bool,
}

/// Refuses targets that would put a store where it was not meant to go: an `--out` that is a file,
/// a `--home` whose parent does not exist (a typo or an unmounted drive would otherwise become a
/// folder on the system disk); warns when two homes share a file system (no gain in speed).
fn check_targets(a: &SetupArgs) -> Result<()> {
    if a.out.is_file() {
        bail!("--out {}: that is a file; --out names the store's folder (a new one, or a store to resume or repair)", a.out.display());
    }
    let mut devices: Vec<(u64, &Path)> = Vec::new();
    for h in &a.homes {
        let p = h.path.as_path();
        let parent = p.parent().filter(|q| !q.as_os_str().is_empty()).unwrap_or(Path::new("."));
        if !p.exists() && !parent.is_dir() {
            bail!(
                "--home {}: {} does not exist (a typo, or a drive that is not mounted?); setup creates a home folder, not the folders above it",
                p.display(),
                parent.display()
            );
        }
        if p.is_file() {
            bail!("--home {}: that is a file; a home is a folder on a drive", p.display());
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            let probe = if p.exists() { p } else { parent };
            if let Ok(md) = std::fs::metadata(probe) {
                if let Some((_, other)) = devices.iter().find(|(d, _)| *d == md.dev()) {
                    eprintln!(
                        "warning: --home {} and --home {} are on the same file system: they share one drive's reads (no faster than one home)",
                        other.display(),
                        p.display()
                    );
                }
                devices.push((md.dev(), p));
            }
        }
    }
    Ok(())
}

/// A `--home` argument: a folder and what is stated of its drive.
#[derive(Clone, Debug)]
pub struct HomeArg {
    pub path: PathBuf,
    pub facts: deltafin::DriveFacts,
}

/// Parses `PATH`, `PATH:SIZE`, `PATH:SIZE:RATE` or `PATH::RATE` (a rate ends in `/s`). A path
/// that itself holds a colon is taken whole when what follows it is not a size or rate.
fn parse_home(s: &str) -> Result<HomeArg, String> {
    let mut facts = deltafin::DriveFacts::default();
    let mut path = s;
    for _ in 0..2 {
        let Some((head, tail)) = path.rsplit_once(':') else { break };
        if let Some(rate) = tail.strip_suffix("/s") {
            if facts.rate.is_some() || facts.capacity.is_some() {
                break;
            }
            facts.rate = Some(parse_size(rate)? as f64);
        } else if tail.is_empty() && facts.rate.is_some() && facts.capacity.is_none() {
            // PATH::RATE
        } else if let Ok(size) = parse_size(tail) {
            if facts.capacity.is_some() {
                break;
            }
            facts.capacity = Some(size);
        } else {
            break;
        }
        path = head;
    }
    if path.is_empty() {
        return Err(format!("{s:?}: no folder before the size or rate"));
    }
    Ok(HomeArg { path: PathBuf::from(path), facts })
}

fn parse_placement(s: &str) -> Result<deltafin::Placement, String> {
    deltafin::Placement::from_tag(s).ok_or_else(|| format!("{s:?}: choose striped, weighted or round-robin"))
}

fn gb(b: f64) -> String {
    format!("{:.2} GB", b / 1e9)
}

/// Prints what `setup --plan` found.
fn print_plan(p: &deltafin::LayoutPlan) {
    println!("placement: {} ({} cop{} of every byte)", p.placement.tag(), p.copies, if p.copies == 1 { "y" } else { "ies" });
    println!("experts: {} for one copy", gb(p.expert_bytes as f64));
    println!("{:<40} {:>12} {:>14} {:>12} {:>12} {:>8}", "home", "capacity", "read rate", "experts", "use", "reads");
    for h in &p.homes {
        println!(
            "{:<40} {:>12} {:>9.2} GB/s {:>12} {:>11.1}% {:>7.1}%   capacity: {}, rate: {}",
            h.path.display().to_string(),
            gb(h.capacity as f64),
            h.rate / 1e9,
            gb(h.bytes as f64),
            100.0 * h.bytes as f64 / h.capacity.max(1) as f64,
            100.0 * h.read_share,
            h.capacity_from,
            h.rate_from
        );
    }
    println!(
        "expected read rate in decode ({} experts per layer): {:.2} GB/s, {:.0}% of the drives' {:.2} GB/s together",
        p.experts_per_token,
        p.expected_rate / 1e9,
        100.0 * p.expected_rate / p.rate_sum,
        p.rate_sum / 1e9
    );
    println!("every placement over these drives:");
    for (name, r) in &p.alternatives {
        match r {
            Some(r) => println!("  {name:<36} {:.2} GB/s ({:.0}%)", r / 1e9, 100.0 * r / p.rate_sum),
            None => println!("  {name:<36} does not fit"),
        }
    }
}

pub fn run_setup(a: SetupArgs) -> Result<()> {
    check_targets(&a)?;
    let homes: Vec<PathBuf> = a.homes.iter().map(|h| h.path.clone()).collect();
    let drives: Vec<deltafin::DriveFacts> = a.homes.iter().map(|h| h.facts).collect();
    let layout_args = a.rebalance || a.plan || a.placement.is_some() || drives.iter().any(|d| *d != deltafin::DriveFacts::default());
    if layout_args && (a.stream || a.in_place) {
        bail!("--rebalance, --plan, --placement and drive sizes or rates apply to copied installs (--full without --in-place)");
    }
    let mut opts = SetupOptions::new(a.from.clone().unwrap_or_default(), &a.out)
        .homes(homes.clone())
        .layout(if a.in_place { ExpertLayoutKind::InPlace } else { ExpertLayoutKind::Packs })
        .copies(a.copies)
        .drives(drives)
        .reinstall(a.reinstall)
        .rebalance(a.rebalance);
    if let Some(p) = a.placement {
        opts = opts.placement(p);
    }
    if a.plan {
        print_plan(&deltafin::plan_layout(&opts)?);
        eprintln!("nothing was written; run the same command without --plan to {}", if a.rebalance { "move the store" } else { "install" });
        return Ok(());
    }
    if a.rebalance {
        let info = setup(&opts, &Bars::new())?;
        ready(&a.out, &info);
        return Ok(());
    }
    let Some(from) = a.from.clone() else { bail!("--from names the checkpoint to install") };
    if a.stream {
        if a.in_place || a.copies != 1 {
            bail!("--stream keeps one copy of each expert in its cache (spread over --home folders if given); --in-place and --copies apply to --full installs");
        }
        let cached = deltafin::resolve_model_dir(std::path::Path::new(&from));
        if let (true, Ok(dir)) = (from.starts_with("hf://"), cached) {
            eprintln!(
                "note: {} is already in the Hugging Face cache ({}): `deltafin setup --full --in-place --from {} --out STORE` uses those files with no download",
                from,
                dir.display(),
                from
            );
        }
        let mut opts = deltafin::StreamOptions::new(from.clone(), &a.out);
        opts.disk_budget = a.disk_budget;
        opts.homes = homes.clone();
        opts.fill = a.fill;
        opts.reinstall = a.reinstall;
        if let Some(w) = a.whole_shard_max {
            opts.whole_shard_max = w;
        }
        let info = deltafin::setup_stream(&opts, &Bars::new())?;
        ready(&a.out, &info);
        if !a.fill {
            eprintln!("experts are fetched from the hub as runs need them; `deltafin setup` again with --fill fetches them all now");
        }
        return Ok(());
    }
    if a.disk_budget.is_some() || a.fill {
        bail!("--disk-budget and --fill apply to --stream installs");
    }
    if a.in_place && !a.homes.is_empty() {
        bail!("--in-place reads experts from the checkpoint folder; --home only applies to copied packs");
    }
    let info = setup(&opts, &Bars::new())?;
    ready(&a.out, &info);
    Ok(())
}

fn ready(out: &std::path::Path, s: &StoreInfo) {
    eprintln!(
        "store ready at {}: spine {:.1} MB, {} experts ({:.1} MB) over {} home(s), layout {}, content {}",
        out.display(),
        s.spine_bytes as f64 / 1e6,
        s.experts,
        s.expert_bytes as f64 / 1e6,
        s.homes,
        s.layout,
        &s.content_id[..16]
    );
}

#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// The store to check.
    #[arg(long)]
    pub model: PathBuf,
    /// Also read every expert and compare its checksum (reads the whole store).
    #[arg(long)]
    pub verify: bool,
    /// Repair the store: re-run setup with the arguments it was made with (re-verifies every
    /// byte and rewrites what is wrong from the checkpoint), then verify it.
    #[arg(long)]
    pub repair: bool,
}

pub fn run_doctor(a: DoctorArgs) -> Result<()> {
    crate::run::check_model_path(&a.model)?;
    if !deltafin::is_store(&a.model) {
        bail!(
            "{m} is a checkpoint folder, not a store: `doctor` checks stores made by `deltafin setup` (a checkpoint is checked \
             each time it is opened); to make a store of it: `deltafin setup --full --from {m} --out STORE`",
            m = a.model.display()
        );
    }
    if a.repair {
        let info = deltafin::repair(&a.model, &Bars::new())?;
        ready(&a.model, &info);
    }
    let verify = a.verify || a.repair;
    let r = doctor(&a.model, verify, &Bars::new())?;
    if r.ok() {
        if verify {
            eprintln!(
                "{}: OK: every byte verified against its checksum ({} spine tensors, {} experts in {} copies)",
                a.model.display(),
                r.spine_tensors_checked,
                r.experts_checked,
                r.copies_checked
            );
        } else {
            eprintln!(
                "{}: OK: config, tokenizer and {} spine tensors verified against their checksums; {} experts in {} copies present at \
                 full size, not read (--verify reads every one)",
                a.model.display(),
                r.spine_tensors_checked,
                r.experts_checked,
                r.copies_checked
            );
        }
        if let Some((cached, streamed, bytes)) = r.stream_cache {
            eprintln!(
                "stream store: {cached} of {streamed} streamed experts cached ({:.1} MB); the rest are fetched from the hub on first use",
                bytes as f64 / 1e6
            );
        }
        if !r.unverified_shards.is_empty() {
            eprintln!(
                "stream store: {} shard(s) not yet checked against the hub's SHA-256 ({}): their bytes are trusted on transport \
                 checks alone; `deltafin doctor --repair --model {}` (or a run with --verified-only) fetches what is missing to check them",
                r.unverified_shards.len(),
                r.unverified_shards.join(", "),
                a.model.display()
            );
        }
        return Ok(());
    }
    for p in &r.problems {
        eprintln!("problem: {p}");
    }
    bail!("{} problem(s) found in {}; {}", r.problems.len(), a.model.display(), r.advice)
}

/// Parses sizes like `512M`, `2G`, `1.5GiB`, `4096`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("{s:?} is not a size (try 512M, 2G, 1.5GiB)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024.0 * 1024.0,
        "g" | "gb" => 1e9,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tb" => 1e12,
        "tib" => 1024f64.powi(4),
        other => return Err(format!("unknown size unit {other:?} in {s:?} (use K, M, G, T, or KiB, MiB, GiB)")),
    };
    Ok((n * mult) as u64)
}
