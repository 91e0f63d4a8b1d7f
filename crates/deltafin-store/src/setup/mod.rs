//! `deltafin setup`: install a checkpoint into a store, resume one, or repair one.
//!
//! The spine goes into one aligned `spine.bin` (fast to load in one read), or stays in the
//! checkpoint's shards (`--in-place`). Experts are either used in place (each is one contiguous
//! span of a shard) or copied into aligned pack files, one per MoE layer per home, spread over the
//! homes (one home per drive) with `copies` replicas.
//!
//! **Same checkpoint, same arguments.** Setup first checks the checkpoint the way `run` would
//! ([`Checkpoint::validate`]) and fingerprints it (`identity.rs`). It records what it is doing in a
//! sealed `setup.json` before it writes anything else; a later setup into the same store with
//! another checkpoint or other arguments is refused (or, with `reinstall`, replaces the old store).
//! Pack folders are named after the checkpoint and the plan, so two checkpoints never share a
//! pack, even in one home.
//!
//! **Crash safety.** Setup holds a lock on the store and on each pack folder. Every file is
//! written under a `.partial` name, synced, renamed, and its directory synced; each finished pack
//! and the spine get a sealed sidecar listing offsets and checksums. The manifest is removed when
//! setup starts and written last.
//!
//! **Repair.** A re-run skips nothing blindly: every finished file is read back and checked
//! against its sidecar, and what is wrong is rewritten from the checkpoint. Bytes read from the
//! checkpoint are compared with the checksums an earlier run recorded for them, so a checkpoint
//! that changed in the meantime is an error, never a silent mix.
//!
//! **Sources.** Bytes come through [`SpanSource`]; a local checkpoint folder is one, and the hub
//! (stream mode) is meant to be another, fetching spans by HTTP range.

mod experts;
mod implicit;
mod placement;
mod plan;
mod readback;
mod rebalance;
mod space;
mod spine;
mod stream;

pub use implicit::{checkpoint_store, deltafin_home};
pub use placement::{DriveFacts, Placement};
pub use plan::{plan_layout, LayoutPlan, PlannedHome};
pub use stream::{setup_stream, StreamOptions};

use std::collections::{BTreeMap, HashMap};

pub(crate) use placement::Layout;
use std::fs::File;
use std::path::{Path, PathBuf};

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::lock::DirLock;
use crate::manifest::{
    checksum, read_sealed, sync_dir, write_atomic, write_sealed, FileSum, Manifest, SealError, SetupRecord, FORMAT, LAYOUT_IN_PLACE,
    LAYOUT_PACKS, STORE_FILES,
};

/// Reports progress of long work (the CLI draws bars from it).
pub trait Progress: Send + Sync {
    /// A new phase of `total` bytes begins.
    fn begin(&self, phase: &str, total: u64);
    /// `bytes` more are done.
    fn advance(&self, bytes: u64);
    /// The phase is over.
    fn end(&self) {}
}

/// Progress that goes nowhere.
pub struct NoProgress;
impl Progress for NoProgress {
    fn begin(&self, _: &str, _: u64) {}
    fn advance(&self, _: u64) {}
}

/// Where expert bytes come from during setup.
pub trait SpanSource {
    /// Reads `buf.len()` bytes of `file` (relative to the source) at `offset`.
    fn read_span(&self, file: &Path, offset: u64, buf: &mut [u8]) -> Result<()>;
    /// The checksum of `len` bytes of `file` at `offset` (`buf` is scratch space).
    fn span_checksum(&self, file: &Path, offset: u64, len: u64, buf: &mut Vec<u8>) -> Result<String> {
        buf.resize(len as usize, 0);
        self.read_span(file, offset, buf)?;
        Ok(checksum(buf))
    }
}

/// A local checkpoint folder as a span source.
pub struct LocalFiles {
    open: std::sync::Mutex<HashMap<PathBuf, std::sync::Arc<File>>>,
    /// Checksums of all-zero spans by length (see [`SpanSource::span_checksum`]).
    zeros: std::sync::Mutex<HashMap<u64, String>>,
}

impl LocalFiles {
    pub fn new() -> LocalFiles {
        LocalFiles { open: Default::default(), zeros: Default::default() }
    }

    fn file(&self, file: &Path) -> Result<std::sync::Arc<File>> {
        let mut open = self.open.lock().expect("poisoned");
        if let Some(f) = open.get(file) {
            return Ok(f.clone());
        }
        let f = std::sync::Arc::new(File::open(file).map_err(Error::io(file))?);
        open.insert(file.to_path_buf(), f.clone());
        Ok(f)
    }

    /// Whether `[offset, offset + len)` of `f` is a hole (reads as zeros, holds no data).
    fn is_hole(f: &File, offset: u64, len: u64) -> bool {
        #[cfg(any(target_os = "linux", target_os = "macos"))]
        {
            use std::os::fd::AsRawFd;
            // SAFETY: lseek on a valid descriptor; the position is not used by positioned reads.
            let data = unsafe { libc::lseek(f.as_raw_fd(), offset as libc::off_t, libc::SEEK_DATA) };
            if data < 0 {
                // ENXIO: no data at or after `offset`; anything else: assume data.
                return std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO);
            }
            data as u64 >= offset + len
        }
        #[cfg(not(any(target_os = "linux", target_os = "macos")))]
        {
            let _ = (f, offset, len);
            false
        }
    }
}

impl Default for LocalFiles {
    fn default() -> Self {
        Self::new()
    }
}

impl SpanSource for LocalFiles {
    fn read_span(&self, file: &Path, offset: u64, buf: &mut [u8]) -> Result<()> {
        use std::os::unix::fs::FileExt;
        self.file(file)?.read_exact_at(buf, offset).map_err(Error::io(file))
    }

    /// A span that is a hole of a sparse file is zeros without reading it: its checksum is that
    /// of `len` zero bytes (taken once per length). Sparse checkpoints (the full-size K3 layout
    /// the tests generate) then set up in place in seconds, and any data is still read.
    fn span_checksum(&self, file: &Path, offset: u64, len: u64, buf: &mut Vec<u8>) -> Result<String> {
        let f = self.file(file)?;
        let end = f.metadata().map_err(Error::io(file))?.len();
        if offset + len <= end && LocalFiles::is_hole(&f, offset, len) {
            let mut zeros = self.zeros.lock().expect("poisoned");
            return Ok(zeros.entry(len).or_insert_with(|| checksum(&vec![0u8; len as usize])).clone());
        }
        buf.resize(len as usize, 0);
        self.read_span(file, offset, buf)?;
        Ok(checksum(buf))
    }
}

/// How experts are laid out in the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertLayoutKind {
    /// Read experts (and the spine) from the checkpoint's shards where they are.
    InPlace,
    /// Copy experts into aligned pack files spread over the homes, the spine into `spine.bin`.
    Packs,
}

/// What to install and where.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SetupOptions {
    pub source: PathBuf,
    pub out: PathBuf,
    /// One folder per drive; empty = the store folder itself.
    pub homes: Vec<PathBuf>,
    pub layout: ExpertLayoutKind,
    /// How many homes hold each expert (packs only, round-robin), at most the number of homes.
    pub copies: usize,
    /// How experts are spread over the homes; `None`: striped over several homes with one copy,
    /// else round-robin.
    pub placement: Option<Placement>,
    /// Capacity and read rate of each home's drive where stated (by position; missing or `None`:
    /// free space, probed rate).
    pub drives: Vec<DriveFacts>,
    /// Replace whatever the store (or a half-finished setup there) holds, even another
    /// checkpoint or other arguments.
    pub reinstall: bool,
    /// Move an installed store's experts onto these homes and this placement, reading them from
    /// the store itself (`setup --rebalance`).
    pub rebalance: bool,
}

impl SetupOptions {
    /// Packs in the store folder itself, one copy.
    pub fn new(source: impl Into<PathBuf>, out: impl Into<PathBuf>) -> SetupOptions {
        SetupOptions {
            source: source.into(),
            out: out.into(),
            homes: Vec::new(),
            layout: ExpertLayoutKind::Packs,
            copies: 1,
            placement: None,
            drives: Vec::new(),
            reinstall: false,
            rebalance: false,
        }
    }
    /// Folders on the drives to hold experts, one per drive (default: the store folder).
    pub fn homes(mut self, homes: Vec<PathBuf>) -> SetupOptions {
        self.homes = homes;
        self
    }
    /// Copied packs or in place.
    pub fn layout(mut self, layout: ExpertLayoutKind) -> SetupOptions {
        self.layout = layout;
        self
    }
    /// How many homes hold each expert.
    pub fn copies(mut self, copies: usize) -> SetupOptions {
        self.copies = copies;
        self
    }
    /// Replace whatever the store holds instead of refusing.
    pub fn reinstall(mut self, on: bool) -> SetupOptions {
        self.reinstall = on;
        self
    }
    /// How experts are spread over the homes.
    pub fn placement(mut self, placement: Placement) -> SetupOptions {
        self.placement = Some(placement);
        self
    }
    /// Stated capacity and read rate of each home's drive, by position.
    pub fn drives(mut self, drives: Vec<DriveFacts>) -> SetupOptions {
        self.drives = drives;
        self
    }
    /// Move an installed store onto these homes and placement.
    pub fn rebalance(mut self, on: bool) -> SetupOptions {
        self.rebalance = on;
        self
    }
    /// The placement these options ask for.
    pub(crate) fn placement_kind(&self) -> Placement {
        self.placement.unwrap_or(if self.homes.len() > 1 && self.copies == 1 { Placement::Striped } else { Placement::RoundRobin })
    }
}

fn crash_point(layers_done: usize) {
    // Fault injection for the resume test: simulate a crash after N finished layers.
    if let Ok(n) = std::env::var("DELTAFIN_SETUP_CRASH_AFTER_LAYERS") {
        if n.parse::<usize>().ok() == Some(layers_done) {
            eprintln!("DELTAFIN_SETUP_CRASH_AFTER_LAYERS={n}: aborting to simulate a crash");
            std::process::abort();
        }
    }
}

/// The plan record of a store in progress or finished.
pub(crate) const SETUP_RECORD: &str = "setup.json";

/// Everything a run of setup works from: what to install where, and what earlier runs recorded.
pub(crate) struct Install<'a> {
    pub ckpt: &'a Checkpoint,
    pub out: &'a Path,
    pub record: SetupRecord,
    /// Absolute home folders (the store folder when none was given).
    pub homes: Vec<PathBuf>,
    /// Pack folder name inside `HOME/deltafin-experts/`, per home.
    pub pack_dirs: Vec<String>,
    /// Checksums an earlier run of this plan recorded in its manifest (spine tensors by name,
    /// experts by layer and id), to catch a checkpoint that changed between runs.
    pub earlier_spine: HashMap<String, String>,
    pub earlier_experts: HashMap<(usize, usize), String>,
    pub src: LocalFiles,
    /// Where an in-place spine's shards are read at run time (absolute).
    pub spine_dir: PathBuf,
    /// Which home holds which bytes of every expert.
    pub layout: placement::Layout,
}

impl Install<'_> {
    /// A checksum recorded earlier for spine tensor `name`.
    pub fn earlier_spine(&self, name: &str) -> Option<&str> {
        self.earlier_spine.get(name).map(String::as_str)
    }
    /// A checksum recorded earlier for expert `l`/`e`.
    pub fn earlier_expert(&self, l: usize, e: usize) -> Option<&str> {
        self.earlier_experts.get(&(l, e)).map(String::as_str)
    }
    /// Checks bytes just read from the checkpoint against what was recorded for them.
    pub fn check_source(&self, what: &str, file: &Path, sum: &str, recorded: Option<&str>) -> Result<()> {
        match recorded {
            Some(r) if r != sum => Err(Error::SourceChanged {
                path: file.to_path_buf(),
                why: format!("{what} reads differently from when setup began this store (checksum {sum}, recorded {r})"),
            }),
            _ => Ok(()),
        }
    }
}

/// Installs `opts.source` into `opts.out`. Returns the manifest. Safe to re-run after a crash;
/// a re-run also repairs (re-verifies every finished file and rewrites what is wrong).
pub fn setup(opts: &SetupOptions, progress: &dyn Progress) -> Result<Manifest> {
    // `hf://OWNER/REPO` names a model in the local Hugging Face cache, used where it is.
    let source = crate::hf_snapshot::resolve_model_dir(&opts.source)?;
    let opts = &SetupOptions { source, ..opts.clone() };
    if opts.rebalance {
        return rebalance::rebalance(opts, progress);
    }
    let ckpt = Checkpoint::open(&opts.source)?;
    ckpt.validate()?;
    let out = &opts.out;
    let layout_tag = match opts.layout {
        ExpertLayoutKind::InPlace => LAYOUT_IN_PLACE,
        ExpertLayoutKind::Packs => LAYOUT_PACKS,
    };
    if opts.layout == ExpertLayoutKind::InPlace && !opts.homes.is_empty() {
        return Err(Error::format(out, "--in-place reads experts from the checkpoint folder; --home only applies to copied packs"));
    }
    check_copies(opts, out)?;
    std::fs::create_dir_all(out).map_err(Error::io(out))?;
    let _store_lock = DirLock::acquire(out)?;
    let source_id = crate::identity::source_id(&ckpt, progress)?;
    let mut homes_given = Vec::new();
    for h in &opts.homes {
        std::fs::create_dir_all(h).map_err(Error::io(h))?;
        homes_given.push(std::fs::canonicalize(h).map_err(Error::io(h))?);
    }
    let placement = if opts.layout == ExpertLayoutKind::InPlace { Placement::RoundRobin } else { opts.placement_kind() };
    let mut record = SetupRecord {
        source: std::fs::canonicalize(&opts.source).map_err(Error::io(&opts.source))?,
        source_id,
        layout: layout_tag.into(),
        homes: homes_given.clone(),
        copies: if opts.layout == ExpertLayoutKind::InPlace { 1 } else { opts.copies },
        placement: placement.tag().into(),
        shares: Vec::new(),
        drives: stated(&opts.drives),
    };
    let homes: Vec<PathBuf> = match opts.layout {
        ExpertLayoutKind::InPlace => vec![record.source.clone()],
        ExpertLayoutKind::Packs if homes_given.is_empty() => vec![std::fs::canonicalize(out).map_err(Error::io(out))?],
        ExpertLayoutKind::Packs => homes_given,
    };
    let cfg = ckpt.config();
    let layout = if placement == Placement::RoundRobin {
        placement::Layout::new(placement, record.copies, vec![1.0 / homes.len() as f64; homes.len()], &cfg.moe_layers(), cfg.num_experts)
    } else {
        // A resumed or repaired setup places every byte where the first run did: the shares it
        // recorded are used again unless other capacities or rates were stated.
        let recorded = recorded_shares(out, &record);
        let facts = match &recorded {
            Some(_) => homes.iter().map(|_| (u64::MAX, "recorded", 1.0, "recorded")).collect(),
            None => {
                let dev = |p: &Path| std::fs::metadata(p).map(|m| std::os::unix::fs::MetadataExt::dev(&m)).map_err(Error::io(p));
                let reserved = BTreeMap::from([(dev(out)?, spine::spine_file_bytes(&ckpt))]);
                plan::drive_facts(&homes, &opts.drives, &reserved, &BTreeMap::new())?
            }
        };
        let (planned, layout) = plan::layout_plan(cfg, placement, record.copies, &homes, &facts, recorded)?;
        record.shares = planned.shares;
        layout
    };
    let earlier = previous(out, &record, opts.reinstall)?;
    write_sealed(&out.join(SETUP_RECORD), &record)?;
    // From here until the manifest is written again the store is unfinished: a reader must never
    // see an old manifest over files this run is rewriting.
    remove_if_present(&out.join("manifest.json"))?;
    sync_dir(out)?;
    write_atomic(&out.join(crate::store::STORE_MARKER), FORMAT.as_bytes())?;

    let pack_dirs = (0..homes.len()).map(|h| pack_dir_name(&record, h, homes.len())).collect();
    let earlier_spine = earlier.iter().flat_map(|m| m.spine.iter().map(|(n, t)| (n.clone(), t.xxh3.clone()))).collect();
    let earlier_experts = earlier.iter().flat_map(|m| m.experts.iter().map(|e| ((e.layer, e.expert), e.xxh3.clone()))).collect();
    let spine_dir = record.source.clone();
    let plan =
        Install { ckpt: &ckpt, out, record, homes, pack_dirs, earlier_spine, earlier_experts, src: LocalFiles::new(), spine_dir, layout };
    let mut home_locks = Vec::new();
    if opts.layout == ExpertLayoutKind::Packs {
        for (h, dir) in plan.homes.iter().zip(&plan.pack_dirs) {
            let d = h.join(PACKS_DIR).join(dir);
            std::fs::create_dir_all(&d).map_err(Error::io(&d))?;
            home_locks.push(DirLock::acquire(&d)?);
        }
        space::check(&plan)?;
    }

    let files = copy_small_files(&plan)?;
    let (spine_files, spine) = match opts.layout {
        ExpertLayoutKind::Packs => spine::write_spine_file(&plan, progress)?,
        ExpertLayoutKind::InPlace => spine::in_place_spine(&plan, progress)?,
    };
    let (layouts, experts) = experts::install(&plan, opts.layout, progress)?;
    let mut manifest = Manifest {
        format: FORMAT.into(),
        source_id: plan.record.source_id.clone(),
        content_id: String::new(),
        layout: layout_tag.into(),
        setup: plan.record.clone(),
        homes: plan.homes.clone(),
        files,
        spine_files,
        spine_bytes: 0,
        spine,
        layouts,
        experts,
    };
    seal(&mut manifest, ckpt.config(), out)?;
    Ok(manifest)
}

/// Checks `--copies` against the homes and the placement.
fn check_copies(opts: &SetupOptions, out: &Path) -> Result<()> {
    let home_count = opts.homes.len().max(1);
    if opts.copies == 0 || opts.copies > home_count {
        return Err(Error::format(
            out,
            format!("{} copies asked but {home_count} home(s) given: copies must be 1..={home_count}", opts.copies),
        ));
    }
    if opts.copies > 1 && opts.placement.is_some_and(|p| p != Placement::RoundRobin) {
        return Err(Error::format(
            out,
            format!(
                "--copies {} applies to --placement round-robin; {} keeps one copy of every byte",
                opts.copies,
                opts.placement_kind().tag()
            ),
        ));
    }
    Ok(())
}

/// The stated drive facts, trimmed of trailing homes with nothing stated (so "nothing stated"
/// always records as empty).
fn stated(drives: &[DriveFacts]) -> Vec<DriveFacts> {
    let keep = drives.iter().rposition(|d| *d != DriveFacts::default()).map_or(0, |i| i + 1);
    drives[..keep].to_vec()
}

/// The shares an earlier setup of this same plan recorded (in progress or finished), if the same
/// capacities and rates were stated.
fn recorded_shares(out: &Path, record: &SetupRecord) -> Option<Vec<f64>> {
    let in_progress = read_sealed::<SetupRecord>(&out.join(SETUP_RECORD)).ok();
    let finished = Manifest::read(out).ok().map(|m| m.setup);
    in_progress.into_iter().chain(finished).find_map(|p| {
        let same = p.source_id == record.source_id
            && p.layout == record.layout
            && p.homes == record.homes
            && p.copies == record.copies
            && p.placement == record.placement
            && p.drives == record.drives
            && p.shares.len() == record.homes.len().max(1);
        same.then_some(p.shares)
    })
}

/// Fills in the manifest's derived fields (spine bytes, content id), checks it against the
/// checkpoint's config and writes it: the last step of every install, after which the store opens.
pub(crate) fn seal(manifest: &mut Manifest, cfg: &deltafin_core::K3Config, out: &Path) -> Result<()> {
    manifest.spine_bytes = Manifest::spine_placement(&manifest.spine).1;
    manifest.content_id = manifest.compute_content_id();
    manifest.validate(cfg, out)?;
    manifest.write(out)
}

/// Folder under each home that holds pack folders.
pub const PACKS_DIR: &str = "deltafin-experts";

/// The pack folder of home `h` of `n`: named after the checkpoint and everything that decides
/// which experts a home holds ([`assign_homes`]), so packs of another checkpoint, or of the same
/// one spread another way, never share a file, while two stores of the same plan may.
pub(crate) fn pack_dir_name(record: &SetupRecord, h: usize, n: usize) -> String {
    match record.placement.as_str() {
        "round-robin" => format!("{}-c{}-h{}of{n}", &record.source_id[..16], record.copies, h + 1),
        p => {
            let shares: Vec<String> = record.shares.iter().map(|s| format!("{s:.6}")).collect();
            let id = crate::checksum::xxh3_64(shares.join(",").as_bytes());
            format!("{}-{}{:08x}-h{}of{n}", &record.source_id[..16], &p[..1], id as u32, h + 1)
        }
    }
}

/// Checks what the store holds (a finished manifest, or the record of a setup in progress)
/// against this run. Returns the earlier manifest of the same plan (its checksums are the
/// reference for bytes re-read from the checkpoint).
pub(crate) fn previous(out: &Path, record: &SetupRecord, reinstall: bool) -> Result<Option<Manifest>> {
    let manifest = Manifest::read(out).ok();
    let in_progress = match read_sealed::<SetupRecord>(&out.join(SETUP_RECORD)) {
        Ok(r) => Some(r),
        Err(SealError::Missing) => None,
        // A damaged record says nothing; the sidecars of each file still name their checkpoint.
        Err(SealError::Bad(_)) => None,
    };
    // A finished store's record and manifest agree; when they do not (one was damaged or put
    // there by hand), either one naming this plan is enough to continue it.
    let same_plan = |p: &SetupRecord| {
        // The same checkpoint moved to another folder is still the same checkpoint.
        p.source_id == record.source_id
            && p.layout == record.layout
            && p.homes == record.homes
            && p.copies == record.copies
            && p.placement == record.placement
            && p.shares == record.shares
    };
    let candidates: Vec<SetupRecord> = in_progress.into_iter().chain(manifest.as_ref().map(|m| m.setup.clone())).collect();
    if candidates.iter().any(same_plan) {
        return Ok(manifest.filter(|m| same_plan(&m.setup)));
    }
    // The record is written first and the manifest last: the record is the latest intent.
    let Some(prev) = candidates.into_iter().next() else {
        return Ok(None);
    };
    let what = if manifest.is_some() { "holds" } else { "is being set up with" };
    if !reinstall && prev.source == record.source && prev.source_id != record.source_id {
        return Err(Error::SourceChanged {
            path: record.source.clone(),
            why: format!(
                "its files differ from when this store was set up (fingerprint {}, now {})",
                &prev.source_id[..16],
                &record.source_id[..16]
            ),
        });
    }
    if !reinstall {
        let mut diffs = Vec::new();
        if prev.source_id != record.source_id {
            diffs.push(format!(
                "checkpoint {} (fingerprint {}), not this one ({})",
                prev.source.display(),
                &prev.source_id[..16],
                &record.source_id[..16]
            ));
        }
        if prev.layout != record.layout {
            diffs.push(format!("layout {}, not {}", prev.layout, record.layout));
        }
        if prev.homes != record.homes || prev.copies != record.copies {
            let list = |h: &[PathBuf]| match h.len() {
                0 => "no separate home (experts beside the store)".to_string(),
                _ => h.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
            };
            let copies = |n: usize| if n == 1 { "1 copy".to_string() } else { format!("{n} copies") };
            diffs.push(format!(
                "homes {} with {}, not {} with {}",
                list(&prev.homes),
                copies(prev.copies),
                list(&record.homes),
                copies(record.copies)
            ));
        }
        if prev.placement != record.placement || prev.shares != record.shares {
            let shares = |v: &[f64]| v.iter().map(|x| format!("{:.0}%", 100.0 * x)).collect::<Vec<_>>().join("/");
            diffs.push(format!(
                "placement {} ({}), not {} ({})",
                prev.placement,
                shares(&prev.shares),
                record.placement,
                shares(&record.shares)
            ));
        }
        let moved = prev.source_id == record.source_id && prev.layout == record.layout && manifest.is_some();
        let rebalance = if moved && record.layout == LAYOUT_PACKS {
            "; to move its experts onto these homes and this placement without reinstalling, add --rebalance"
        } else {
            ""
        };
        return Err(Error::OtherCheckpoint {
            path: out.to_path_buf(),
            why: format!(
                "this store {what} {}; to keep it, run `{}`{rebalance}; to replace it with this checkpoint and these arguments, add --reinstall",
                diffs.join("; "),
                prev.command(out)
            ),
        });
    }
    remove_previous(out, &prev)?;
    Ok(None)
}

/// Removes what an earlier setup of another plan wrote (`--reinstall`).
fn remove_previous(out: &Path, prev: &SetupRecord) -> Result<()> {
    for f in ["manifest.json", SETUP_RECORD, "spine.bin", "spine.bin.partial", "spine.bin.json"] {
        remove_if_present(&out.join(f))?;
    }
    for e in std::fs::read_dir(out).map_err(Error::io(out))?.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if n.starts_with("inplace-") && n.ends_with(".json") {
            remove_if_present(&e.path())?;
        }
    }
    if prev.layout == LAYOUT_PACKS {
        let homes = if prev.homes.is_empty() { vec![out.to_path_buf()] } else { prev.homes.clone() };
        let homes_abs: Vec<PathBuf> = homes.iter().map(|h| std::fs::canonicalize(h).unwrap_or_else(|_| h.clone())).collect();
        for (i, h) in homes_abs.iter().enumerate() {
            let d = h.join(PACKS_DIR).join(pack_dir_name(prev, i, homes_abs.len()));
            if d.exists() {
                let _lock = DirLock::acquire(&d)?;
                std::fs::remove_dir_all(&d).map_err(Error::io(&d))?;
            }
        }
    }
    sync_dir(out)
}

pub(crate) fn remove_if_present(p: &Path) -> Result<()> {
    match std::fs::remove_file(p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::Io { path: p.to_path_buf(), err: e }),
        _ => Ok(()),
    }
}

/// Copies config and tokenizer files into the store, returning their checksums.
pub(crate) fn copy_small_files(plan: &Install) -> Result<BTreeMap<String, FileSum>> {
    let mut files = BTreeMap::new();
    for f in STORE_FILES {
        let p = plan.ckpt.dir().join(f);
        let dst = plan.out.join(f);
        match std::fs::read(&p) {
            Ok(bytes) => {
                if std::fs::read(&dst).ok().as_deref() != Some(bytes.as_slice()) {
                    write_atomic(&dst, &bytes)?;
                }
                files.insert(f.to_string(), FileSum { bytes: bytes.len() as u64, xxh3: checksum(&bytes) });
            }
            // A file the checkpoint lacks must not linger from an earlier install.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => remove_if_present(&dst)?,
            Err(e) => return Err(Error::Io { path: p, err: e }),
        }
    }
    Ok(files)
}

/// Writes a file under its `.partial` name with `write`, syncs it and renames it into place.
/// On any error the partial file is removed (a full disk gets its space back).
pub(crate) fn write_file_atomically(path: &Path, len: u64, write: impl FnOnce(&File) -> Result<()>) -> Result<()> {
    let tmp = crate::manifest::tmp_path(path);
    let done = (|| {
        let f = File::create(&tmp).map_err(Error::io(&tmp))?;
        f.set_len(len).map_err(Error::io(&tmp))?;
        write(&f)?;
        f.sync_all().map_err(Error::io(&tmp))?;
        drop_cache(&f);
        Ok(())
    })();
    if let Err(e) = done {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    crate::manifest::rename_synced(&tmp, path)
}

/// Evicts a file from the page cache so later reads (and benchmarks) hit the drive.
pub fn drop_cache(f: &File) {
    use std::os::fd::AsRawFd;
    #[cfg(target_os = "linux")]
    // SAFETY: advisory call on a valid descriptor.
    unsafe {
        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = f.as_raw_fd();
}
