//! `cargo xtask bench`: measured speed on generated `slice` models (real K3 expert size, several
//! GB, larger than the RAM budget used), written as JSON, a markdown table and SVG plots into
//! `docs/BENCHMARKS.md`, each result beside the exact command that produced it.
//!
//! Ratios are measured within one run (the disk changes speed minute to minute); repeated
//! configurations report min / median / max.

mod ab;
mod batch;
mod batch_drafts;
mod batch_mixed;
mod batch_prefix;
mod capped;
mod device;
mod engine_runs;
mod flops;
mod gpu;
mod k3;
mod ladder;
mod spec;
mod stream;
mod svg;
mod trained;

pub use ladder::Limiter;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::json;

/// Which benchmark to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Which {
    Device,
    Decode,
    Prefill,
    Ladder,
    /// Speculative decoding: every drafter against plain decoding.
    Spec,
    /// Many sequences per expert read: lockstep decoding at several N, prompt scoring.
    Batch,
    /// Drafts inside a lockstep batch, on the tiny trained K3: with and without.
    BatchDrafts,
    /// A batch sharing a system prompt, on the tiny trained K3: run once or per job.
    BatchPrefix,
    /// A long prompt arriving among decoding jobs, on the tiny trained K3: whole or chunked.
    BatchMixed,
    /// A stream store against a loopback hub over a rate-limited link.
    Stream,
    /// The real K3's full layout (sparse): startup phases and the plan's projection.
    K3,
    /// The tiny trained K3 beside a random model of its shape: routing skew, cache and
    /// prefetch, prefill, speculation with the trained draft.
    Trained,
    /// This tree against `--base REV` (not part of `all`).
    Ab,
    /// The engine on the CPU and on a CUDA GPU over `--model` (a folder, or a preset generated
    /// under models/), `--prompt` tokens; not part of `all` (needs a GPU).
    Gpu,
    All,
}

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn ensure_model(preset: &str) -> Result<(PathBuf, PathBuf)> {
    let models = root().join("models");
    let ckpt = models.join(preset);
    if !ckpt.join("config.json").exists() {
        crate::gen_k3::generate(preset, 0, &ckpt)?;
    }
    let store = models.join(format!("{preset}-store"));
    if deltafin_store::Manifest::read(&store).is_err() {
        deltafin_store::setup(&deltafin_store::SetupOptions::new(&ckpt, &store), &deltafin_store::NoProgress)?;
    }
    Ok((ckpt, store))
}

/// A `cargo` command as a user would type it: without the variables `cargo run` set for xtask
/// itself. Build scripts watch some of them (ring's watches `CARGO_MANIFEST_DIR`), so an inner
/// build that inherited xtask's values rebuilt a third of the tree on every run.
pub fn cargo() -> std::process::Command {
    let mut c = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        let set_by_cargo_run = k.starts_with("CARGO_PKG_")
            || k.starts_with("CARGO_BIN_")
            || k.starts_with("CARGO_CRATE_")
            || matches!(&*k, "CARGO_MANIFEST_DIR" | "CARGO_MANIFEST_PATH" | "CARGO_PRIMARY_PACKAGE" | "CARGO_MANIFEST_LINKS");
        if set_by_cargo_run {
            c.env_remove(&*k);
        }
    }
    c
}

/// Builds the `deltafin` binary (release), showing cargo's progress, and returns its path.
pub fn build_cli() -> Result<PathBuf> {
    let st = cargo().current_dir(root()).args(["build", "--release", "-p", "deltafin-cli"]).status()?;
    anyhow::ensure!(st.success(), "building deltafin failed");
    Ok(target_dir().join("release/deltafin"))
}

/// Cargo's target folder (`CARGO_TARGET_DIR` when set, as cargo itself does).
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").filter(|d| !d.is_empty()).map(PathBuf::from).unwrap_or_else(|| root().join("target"))
}

fn mb(x: f64) -> f64 {
    x / 1e6
}

/// Appends one row per configuration to `decode-runs.md`: every decode run ever made with the
/// harness, so the spread across the disk's regimes is on record, not just the latest run.
fn append_decode_run(bench_dir: &Path, q: &str, note: &str, d: &[engine_runs::DecodeResult]) -> Result<()> {
    let path = bench_dir.join("decode-runs.md");
    let mut md = std::fs::read_to_string(&path).unwrap_or_else(|_| {
        "## Decode runs\n\nEvery `cargo xtask bench decode` run, appended by the harness (medians over its repeats), so results from both of the disk's regimes stay on record.\n\n| when (UTC) | commit | command | config | device limit MB/s | tok/s | vs bound | vs busy | of device limit | while busy |\n|---|---|---|---|---|---|---|---|---|---|\n".into()
    });
    let out = |args: &[&str]| {
        std::process::Command::new(args[0])
            .args(&args[1..])
            .current_dir(root())
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    let (when, commit) = (out(&["date", "-u", "+%Y-%m-%d %H:%M"]), out(&["git", "rev-parse", "--short", "HEAD"]));
    let med = |v: &[f64]| engine_runs::spread(v).1;
    for r in d {
        writeln!(
            md,
            "| {when} | {commit} | `bench decode{q}` | {}{note} | {:.0} | {:.2} | {:.2}x | {:.2}x | {:.0}% | {:.0}% |",
            r.label,
            mb(med(&r.limit)),
            med(&r.tok_s),
            med(&r.vs_bound),
            med(&r.overlap),
            100.0 * med(&r.device_fraction()),
            100.0 * med(&r.busy_fraction())
        )?;
    }
    std::fs::write(path, md)?;
    Ok(())
}

const TABLE_HEAD: &str = "| config | tok/s min / median / max | device limit MB/s (median) | vs bound min / median / max | vs busy min / median / max | read MB/s (median) | of device limit min / median / max | while busy: MB/s (median), of device limit | MB/token | hit rate | read wait s | compute s | prefetch used/issued | prefetch recall | prefetch wasted MB | ids equal |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";

/// The decode table under `intro`, shared by the uncapped and capped runs.
fn decode_section(intro: &str, d: &[engine_runs::DecodeResult], compute_step: f64) -> String {
    let mut md = format!(
        "{intro} Compute alone (everything in RAM, same run): {compute_step:.3} s/token. *vs bound* = step time / max(MB per token at that repeat's device limit, compute-only step). *vs busy* = step time / max(time the drive had reads in flight, compute-only step): the part of a step that is neither reading nor compute, independent of the disk's speed at that moment. *Read MB/s* = decode expert bytes / decode time; *while busy* = the same bytes / the time the drive had reads in flight.\n"
    );
    let fmt3 = |v: &[f64], scale: f64, unit: &str, digits: usize| {
        let (a, b, c) = engine_runs::spread(v);
        format!("{:.digits$}{unit} / {:.digits$}{unit} / {:.digits$}{unit}", a * scale, b * scale, c * scale)
    };
    let gain = engine_runs::paired_gain(d);
    let _ = writeln!(
        md,
        "\nPrefetch gain (tok/s of the default over `next-use, no prefetch`, paired within each round, the configurations run round-robin): {} (min / median / max).\n",
        fmt3(&gain, 1.0, "x", 3)
    );
    md += TABLE_HEAD;
    for r in d {
        let _ = writeln!(
            md,
            "| {} | {} | {:.0} | {} | {} | {:.0} | {} | {:.0}, {:.0}% | {:.0} | {:.1}% | {:.2} | {:.2} | {}/{} | {:.0}% | {:.0} | {} |",
            r.label,
            fmt3(&r.tok_s, 1.0, "", 2),
            mb(engine_runs::spread(&r.limit).1),
            fmt3(&r.vs_bound, 1.0, "x", 2),
            fmt3(&r.overlap, 1.0, "x", 2),
            mb(engine_runs::spread(&r.read_bytes_per_s).1),
            fmt3(&r.device_fraction(), 100.0, "%", 0),
            mb(engine_runs::spread(&r.busy_bytes_per_s).1),
            100.0 * engine_runs::spread(&r.busy_fraction()).1,
            mb(r.bytes_per_token),
            100.0 * r.hit_rate,
            r.read_wait_s,
            r.compute_s,
            r.prefetch_used,
            r.prefetch_issued,
            100.0 * r.prefetch_recall,
            mb(r.prefetch_wasted_bytes as f64),
            r.ids_equal
        );
    }
    md
}

fn decode_svg(path: &Path, title: &str, d: &[engine_runs::DecodeResult]) -> Result<()> {
    let labels: Vec<String> = d.iter().map(|r| r.label.clone()).collect();
    std::fs::write(path, svg::bars(title, "tok/s", &labels, &[("tok/s", d.iter().map(|r| engine_runs::spread(&r.tok_s).1).collect())]))?;
    Ok(())
}

fn decode_json(d: &[engine_runs::DecodeResult], compute_step: f64) -> serde_json::Value {
    json!(d.iter().map(|r| json!({"config": r.label, "tok_s": r.tok_s, "bytes_per_token": r.bytes_per_token, "hit_rate": r.hit_rate, "read_wait_s": r.read_wait_s, "compute_s": r.compute_s, "read_bytes_per_s": r.read_bytes_per_s, "device_limit": r.limit, "device_fraction": r.device_fraction(), "busy_bytes_per_s": r.busy_bytes_per_s, "busy_fraction": r.busy_fraction(), "vs_bound": r.vs_bound, "vs_busy": r.overlap, "prefetch_recall": r.prefetch_recall, "prefetch_wasted_bytes": r.prefetch_wasted_bytes, "compute_only_step_s": compute_step, "ids_equal": r.ids_equal, "prefetch_gain_paired": engine_runs::paired_gain(d)})).collect::<Vec<_>>())
}

/// Runs `which` and updates the report.
#[allow(clippy::too_many_arguments)]
pub fn run(
    which: Which,
    quick: bool,
    json_out: Option<&Path>,
    limiter: ladder::Limiter,
    base: Option<&str>,
    model: &str,
    prompt: usize,
) -> Result<()> {
    let docs = root().join("docs");
    let bench_dir = docs.join("bench");
    std::fs::create_dir_all(&bench_dir)?;
    let q = if quick { " --quick" } else { "" };
    let mut json = serde_json::Map::new();
    if which == Which::Gpu {
        let path = if Path::new(model).join("config.json").exists() { PathBuf::from(model) } else { ensure_model(model)?.0 };
        let md = gpu::run(&path, prompt, 3)?;
        println!("{md}");
        std::fs::write(bench_dir.join("gpu-engine.md"), &md)?;
        return Ok(());
    }
    if which == Which::Ab {
        let base = base.context("`bench ab` needs --base REV (a commit to compare against)")?;
        // One section per model: `ab` for `small`, `ab-slice` for `slice`, ...
        let file = if model == "small" { "ab.md".to_string() } else { format!("ab-{model}.md") };
        std::fs::write(bench_dir.join(file), ab::run(base, quick, model)?)?;
    }
    let budget: u64 = 1_500_000_000;
    let need_slice = matches!(which, Which::Device | Which::Decode | Which::Prefill | Which::Spec | Which::Batch | Which::All);
    let (ckpt, store) = if need_slice { ensure_model("slice")? } else { (PathBuf::new(), PathBuf::new()) };
    let vocab = 16384;
    if matches!(which, Which::Device | Which::All) {
        let d = device::run(&store, quick)?;
        let mut md = format!("## Device limit\n\n`cargo xtask bench device{q}` — expert-sized (17.5 MB) `O_DIRECT` reads from the store's pack file, no model, each queue depth measured {} times (interleaved).\n\n| queue depth | MB/s min / median / max |\n|---|---|\n", d[0].bytes_per_s.len());
        for r in &d {
            let (a, b, c) = engine_runs::spread(&r.bytes_per_s);
            writeln!(md, "| {} | {:.0} / {:.0} / {:.0} |", r.queue_depth, mb(a), mb(b), mb(c))?;
        }
        let labels: Vec<String> = d.iter().map(|r| format!("QD {}", r.queue_depth)).collect();
        std::fs::write(
            bench_dir.join("device.svg"),
            svg::bars(
                "Direct expert reads (median)",
                "MB/s",
                &labels,
                &[("MB/s", d.iter().map(|r| mb(engine_runs::spread(&r.bytes_per_s).1)).collect())],
            ),
        )?;
        md += "\n![device](bench/device.svg)\n";
        std::fs::write(bench_dir.join("device.md"), md)?;
        json.insert(
            "device".into(),
            json!(d.iter().map(|r| json!({"queue_depth": r.queue_depth, "bytes_per_s": r.bytes_per_s})).collect::<Vec<_>>()),
        );
    }
    if matches!(which, Which::Decode | Which::All) {
        let (d, compute_step) = engine_runs::decode(&store, &ckpt, vocab, budget, quick)?;
        let intro = format!(
            "## Decode\n\n`cargo xtask bench decode{q}` — `slice` store (4.2 GB of experts), RAM budget {:.1} GB, 8-token prompt, the disk uncapped. Each repeat is bracketed by its own device-limit measurement (expert-sized `O_DIRECT` reads at QD 4, the engine's queue depth, right before and after it) and judged against their mean, since the disk changes speed from minute to minute.",
            budget as f64 / 1e9,
        );
        let md = decode_section(&intro, &d, compute_step);
        std::fs::write(bench_dir.join("decode.md"), md + "\n![decode](bench/decode.svg)\n")?;
        decode_svg(&bench_dir.join("decode.svg"), "Decode, disk uncapped (median)", &d)?;
        append_decode_run(&bench_dir, q, "", &d)?;
        json.insert("decode".into(), decode_json(&d, compute_step));

        let (d, used) = capped::decode(&store, vocab, budget, quick, compute_step, limiter)?;
        let (flag, how) = match used {
            ladder::Limiter::Cgroup => (
                " --limiter cgroup",
                "the kernel's cgroup v1 blkio throttle on the disk holding the store. This throttle is a byte budget per 100 ms slice: a few milliseconds with nothing in flight are made up by a burst at the disk's speed right after, so it forgives the gaps between layers (and a prefetch can only add bytes); the default enforcer, the reader's, does not",
            ),
            _ => (
                "",
                "the engine's reader (`--read-caps`): a byte clock per drive that restarts when the drive idles, so time with nothing in flight is lost, as on a real drive (the kernel's blkio throttle, `--limiter cgroup`, banks a few milliseconds of idle and bursts after them, which would forgive exactly the gaps prefetch is for). Each repeat's limit is the lower of the cap and the disk measured right around it",
            ),
        };
        let intro = format!(
            "## Decode on a capped drive\n\n`cargo xtask bench decode{q}{flag}` (second part) — the same runs with every read held to {} MB/s by {how}. The cap is below the disk's dependable floor (~1.0 GB/s), so the device limit holds still through the run and the decode targets can be judged against it.",
            capped::CAP / 1_000_000,
        );
        let file = if used == ladder::Limiter::Cgroup { "decode-capped-kernel" } else { "decode-capped" };
        let md = decode_section(&intro, &d, compute_step);
        std::fs::write(bench_dir.join(format!("{file}.md")), md + &format!("\n![decode capped](bench/{file}.svg)\n"))?;
        decode_svg(&bench_dir.join(format!("{file}.svg")), "Decode, one drive capped (median)", &d)?;
        let note = format!(
            ", capped at {} MB/s by the {}",
            capped::CAP / 1_000_000,
            if used == ladder::Limiter::Cgroup { "kernel" } else { "reader" }
        );
        append_decode_run(&bench_dir, &format!("{q}{flag}"), &note, &d)?;
        json.insert(file.replace('-', "_"), decode_json(&d, compute_step));
    }
    if matches!(which, Which::Prefill | Which::All) {
        let (p, rates) = engine_runs::prefill(&store, &ckpt, vocab, budget, quick)?;
        let gf = |t: [f64; 4]| t.map(|r| format!("{:.0}", r / 1e9)).join(" / ");
        let mut md = format!(
            "## Prefill\n\n`cargo xtask bench prefill{q}` — `slice` store, RAM budget {:.1} GB (far below the 4.2 GB of experts). Each repeat is bracketed by its own device-limit measurement (QD 4, right before and after). Amplification = expert bytes read during prefill / bytes of the distinct experts the whole prompt routes per layer. *vs bound* = TTFT / (distinct bytes at that repeat's device limit + compute-only TTFT, everything in RAM). *FLOP bound* = the prompt's matrix products (experts and BF16 spine; attention scores and KDA steps not counted, so the bound is strict) each timed at the rate the kernels reach for that many rows on K3's expert shape, with the engine's split and input layout, measured right before and after each compute-only run (the mean of the two prices that run: this VM's speed moves by up to 1.4x from minute to minute): the median of repeats lasting half a second (the typical time, as criterion reports it); for the longest prompt's compute-only run MXFP4 {} GFLOP/s and BF16 {} GFLOP/s at 1 / 8 / 64 / 512 rows. Each repeat from the store is priced the same way, at rates measured right before and after it (so a repeat that met a slow minute is judged by that minute's kernels), its bound and ratio listed min / median / max over the repeats. *At best rates* = the same products at the fastest repeat's rates (for the compute-only run above MXFP4 {}, BF16 {} GFLOP/s), stricter still: one repeat can run well above the typical one, which a run of seconds never sustains. *vs max bound* = TTFT / max(distinct bytes at the device limit, FLOP bound), repeat by repeat. Compute-only = of 3 runs in RAM, the one with the median ratio to its bound. *vs in RAM beside it* (expert-major, {} repeats) = each repeat's TTFT / that of the same prompt run in RAM right after it by the compute-only model (kept open, so warm): what streaming costs, measured within one minute of this VM instead of against runs minutes apart (its token counts in *same first token*). *CPU stolen* = CPU seconds this VM's host took from its cores during the streamed run / during the run in RAM beside it (median over the repeats; Linux's `steal`): the host emulates the disk partly on time taken from the VM, so on this machine reading itself costs compute that a real drive's DMA would not.\n\n| prompt tokens | schedule | TTFT s (min / median / max) | device limit MB/s (median) | read GB | amplification | compute-only s | vs bound min / median / max | product GFLOP | FLOP bound s (min / median / max) | vs max bound (min / median / max) | vs max bound at best rates (median) | vs in RAM beside it (min / median / max) | CPU stolen s, streamed / in RAM | same first token |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
            budget as f64 / 1e9,
            gf(rates.mxfp4),
            gf(rates.bf16),
            gf(rates.mxfp4_best),
            gf(rates.bf16_best),
            engine_runs::major_repeats(quick),
        );
        for r in &p {
            let (a, b, c) = engine_runs::spread(&r.ttft_s);
            let (va, vb, vc) = engine_runs::spread(&r.vs_bound);
            let (fa, fb, fc) = engine_runs::spread(&r.flop_bound_s);
            let (ma, mb_, mc) = engine_runs::spread(&r.vs_max_bound);
            writeln!(
                md,
                "| {} | {} | {a:.1} / {b:.1} / {c:.1} | {:.0} | {:.2} | {:.2} | {:.1} | {va:.2}x / {vb:.2}x / {vc:.2}x | {:.0} | {fa:.1} / {fb:.1} / {fc:.1} | {ma:.2}x / {mb_:.2}x / {mc:.2}x | {:.2}x | {} | {} | {} |",
                r.tokens,
                r.schedule,
                mb(engine_runs::spread(&r.limit).1),
                r.bytes_read as f64 / 1e9,
                r.amplification,
                r.compute_s,
                r.flops as f64 / 1e9,
                engine_runs::spread(&r.vs_max_bound_best).1,
                if r.vs_beside.is_empty() {
                    "-".to_string()
                } else {
                    let (a, b, c) = engine_runs::spread(&r.vs_beside);
                    format!("{a:.2}x / {b:.2}x / {c:.2}x")
                },
                if r.stolen_s.is_empty() {
                    "-".to_string()
                } else {
                    let streamed: Vec<f64> = r.stolen_s.iter().map(|s| s.0).collect();
                    let in_ram: Vec<f64> = r.stolen_s.iter().map(|s| s.1).collect();
                    format!("{:.2} / {:.2}", engine_runs::spread(&streamed).1, engine_runs::spread(&in_ram).1)
                },
                r.ids_equal
            )?;
        }
        md += "\nWhere the compute-only time goes (the median run; wall time inside each kind of product, all cores working on it, against the same products at the median kernel rates; *the rest* = attention, KDA, norms, routing and the combine):\n\n| prompt tokens | compute-only s | its FLOP bound s (at best rates) | vs it | MXFP4 experts s (at kernel rates) | BF16 spine s (at kernel rates) | the rest s |\n|---|---|---|---|---|---|---|\n";
        for r in p.iter().filter(|r| r.schedule == "expert-major") {
            let [(m, mi), (bf, bi)] = r.compute.products_s;
            writeln!(
                md,
                "| {} | {:.2} | {:.2} ({:.2}) | {:.2}x | {m:.2} ({mi:.2}) | {bf:.2} ({bi:.2}) | {:.2} |",
                r.tokens,
                r.compute_s,
                r.compute.bound_s,
                r.compute.bound_best_s,
                r.compute_s / r.compute.bound_s,
                r.compute_s - m - bf
            )?;
        }
        let labels: Vec<String> = p.iter().map(|r| format!("{} {}", r.tokens, r.schedule)).collect();
        std::fs::write(
            bench_dir.join("prefill.svg"),
            svg::bars(
                "Prefill time to first token (median)",
                "s",
                &labels,
                &[("TTFT s", p.iter().map(|r| engine_runs::spread(&r.ttft_s).1).collect())],
            ),
        )?;
        md += "\n![prefill](bench/prefill.svg)\n";
        std::fs::write(bench_dir.join("prefill.md"), md)?;
        json.insert("prefill".into(), json!(p.iter().map(|r| json!({"tokens": r.tokens, "schedule": r.schedule, "ttft_s": r.ttft_s, "bytes_read": r.bytes_read, "distinct_bytes": r.distinct_bytes, "amplification": r.amplification, "compute_only_s": r.compute_s, "device_limit": r.limit, "vs_bound": r.vs_bound, "flops": r.flops, "flop_bound_s": r.flop_bound_s, "flop_bound_best_s": r.flop_bound_best_s, "compute_only_flop_bound_s": r.compute.bound_s, "compute_only_flop_bound_best_s": r.compute.bound_best_s, "products_s": r.compute.products_s, "vs_max_bound": r.vs_max_bound, "vs_max_bound_best": r.vs_max_bound_best, "vs_in_ram_beside": r.vs_beside, "cpu_stolen_s_streamed_in_ram": r.stolen_s, "ids_equal": r.ids_equal})).collect::<Vec<_>>()));
    }
    if matches!(which, Which::Batch | Which::All) {
        std::fs::write(bench_dir.join("batch.md"), batch::run(&store, budget, vocab, quick)?)?;
    }
    if matches!(which, Which::BatchMixed | Which::All) {
        std::fs::write(bench_dir.join("batch-mixed.md"), batch_mixed::run(quick)?)?;
    }
    if matches!(which, Which::BatchPrefix | Which::All) {
        std::fs::write(bench_dir.join("batch-prefix.md"), batch_prefix::run(quick)?)?;
    }
    if matches!(which, Which::BatchDrafts | Which::All) {
        std::fs::write(bench_dir.join("batch-drafts.md"), batch_drafts::run(quick)?)?;
    }
    if matches!(which, Which::Stream | Which::All) {
        let (ckpt, full) = ensure_model("slice-mini")?;
        std::fs::write(bench_dir.join("stream.md"), stream::run(&ckpt, &full, &root().join("models"), 8192, quick)?)?;
    }
    if matches!(which, Which::K3 | Which::All) {
        let (_, mini) = ensure_model("slice-mini")?;
        std::fs::write(bench_dir.join("k3.md"), k3::run(&root().join("models"), &mini, 8192, quick)?)?;
    }
    if matches!(which, Which::Spec | Which::All) {
        let mut md = String::from("## Speculative decoding\n\nEvery drafter against plain decoding on two stores of real expert size: `slice`, whose random router sends each token to nearly independent experts (so a verify of k + 1 rows reads about k + 1 times the experts, and drafting cannot pay: the live gate should keep it off), and `slice-hot`, whose router prefers some experts as a trained one does (rows share experts, so verifying is cheaper per row). Neither model is trained, so only the oracle's drafts are ever right; the prompt lookup and the draft model are measured for what they cost when wrong.\n\n");
        md += &spec::run("slice", &store, &ckpt, budget, quick)?;
        let (hot_ckpt, hot_store) = ensure_model("slice-hot")?;
        md += "\n";
        md += &spec::run("slice-hot", &hot_store, &hot_ckpt, budget, quick)?;
        std::fs::write(bench_dir.join("spec.md"), md)?;
    }
    if matches!(which, Which::Trained | Which::All) {
        std::fs::write(bench_dir.join("trained.md"), trained::run(quick)?)?;
    }
    if matches!(which, Which::Ladder | Which::All) {
        let (ckpt, _) = ensure_model("slice-mini")?;
        let bin = build_cli()?;
        let flag =
            if limiter == ladder::Limiter::Auto { String::new() } else { format!(" --limiter {}", format!("{limiter:?}").to_lowercase()) };
        match ladder::run(&bin, &ckpt, &root().join("models/ladder"), quick, "700M", limiter) {
            Ok((rungs, used)) => {
                let (title, how, file) = match used {
                    ladder::Limiter::Reader => (
                        "Drive ladder (reader-enforced caps)",
                        "every drive a plain folder on the one disk, its cap enforced by the engine's reader (`--read-caps`; the fallback where the kernel lacks loop devices or the blkio throttle)",
                        "ladder-reader",
                    ),
                    _ => ("Drive ladder", "every drive a loop device capped by the cgroup v1 blkio throttle (a byte budget per 100 ms slice, which forgives idle shorter than a slice by bursting after it; `--limiter reader` gives the stricter reading, where idle time is lost as on a real drive)", "ladder"),
                };
                let mut md = format!("## {title}\n\n`cargo xtask bench ladder{q}{flag}` — `slice-mini` (real expert size), {how}, RAM budget 700 MB. *Mirror*: every expert on every drive (the reader sends each part of a read to the drive expected to finish it first). *Striped*, *weighted*, *round-robin*: one copy of every byte over the drives (1x capacity), set up with `deltafin setup --placement P --home DRIVE::RATE/s` with the caps stated as rates (striped: each expert split over every drive by rate; weighted: whole experts, each drive its share; round-robin: whole experts in turn). Ideal = sum of the drives' caps / measured expert bytes per token. Configurations interleaved: each of {} rounds runs every row once; tok/s and ideal are medians, efficiency is min / median / max of the rounds' measured / ideal; bytes per drive are from the last round.\n\n| layout | profile | drives | caps MB/s | tok/s | ideal tok/s | efficiency min / median / max | MB/token | MB read per drive |\n|---|---|---|---|---|---|---|---|---|\n", rungs.first().map_or(0, |r| r.efficiencies.len()));
                for r in &rungs {
                    writeln!(
                        md,
                        "| {} | {} | {} | {} | {:.3} | {:.3} | {} | {:.0} | {} |",
                        r.layout,
                        r.profile,
                        r.drives,
                        r.rates.iter().map(|x| format!("{:.0}", mb(*x))).collect::<Vec<_>>().join(" / "),
                        r.tok_s,
                        r.ideal,
                        {
                            let (a, b, c) = engine_runs::spread(&r.efficiencies);
                            format!("{:.0}% / {:.0}% / {:.0}%", 100.0 * a, 100.0 * b, 100.0 * c)
                        },
                        mb(r.bytes_per_token),
                        r.per_drive_bytes.iter().map(|x| format!("{:.0}", mb(*x as f64))).collect::<Vec<_>>().join(" / ")
                    )?;
                }
                // Each layout's worst round at any rung: what "every rung at >= 90%" is judged on.
                let worst: Vec<String> = ["striped", "weighted", "round-robin", "mirror"]
                    .iter()
                    .filter_map(|l| {
                        let min = rungs
                            .iter()
                            .filter(|r| r.layout.starts_with(l) && r.drives >= 2)
                            .flat_map(|r| r.efficiencies.iter().copied())
                            .fold(f64::INFINITY, f64::min);
                        min.is_finite().then(|| format!("{l} {:.0}%", 100.0 * min))
                    })
                    .collect();
                writeln!(md, "\nLowest efficiency of any round at 2 to 4 drives, equal and unequal: {}.", worst.join(", "))?;
                let labels: Vec<String> = (2..=4).map(|n| format!("{n} drives, unequal")).collect();
                let eff = |layout: &str| {
                    rungs
                        .iter()
                        .filter(|r| r.layout.starts_with(layout) && r.profile.starts_with("unequal") && r.drives >= 2)
                        .map(|r| 100.0 * r.efficiency)
                        .collect::<Vec<_>>()
                };
                let series: Vec<(&str, Vec<f64>)> = ["mirror", "striped", "weighted", "round-robin"]
                    .into_iter()
                    .map(|l| (l, eff(l)))
                    .filter(|(_, v)| !v.is_empty())
                    .collect();
                std::fs::write(
                    bench_dir.join(format!("{file}.svg")),
                    svg::bars("Drive ladder: efficiency vs ideal by layout (13.6 : 7.1 : 7.1 : 5.7)", "% of ideal", &labels, &series),
                )?;
                md += &format!("\n![ladder](bench/{file}.svg)\n");
                std::fs::write(bench_dir.join(format!("{file}.md")), md)?;
                json.insert("ladder".into(), json!(rungs.iter().map(|r| json!({"limiter": format!("{used:?}").to_lowercase(), "layout": r.layout, "profile": r.profile, "drives": r.drives, "tok_s": r.tok_s, "ideal": r.ideal, "efficiency": r.efficiency, "efficiency_runs": r.efficiencies, "tok_s_runs": r.tok_s_runs, "bytes_per_token": r.bytes_per_token})).collect::<Vec<_>>()));
            }
            Err(e) => {
                eprintln!("ladder skipped: {e:#}");
                std::fs::write(
                    bench_dir.join("ladder.md"),
                    format!("## Drive ladder\n\n`cargo xtask bench ladder{q}` did not run on the last machine: {e:#}\n"),
                )?;
            }
        }
    }
    // Assemble the report from whatever sections exist.
    let mut report = String::from("# Benchmarks\n\nEvery number below was produced by the command shown beside it (`cargo xtask bench ...`) on the development machine (2 cores, one noisy virtio disk; see `shared/BENCH-MACHINE.md`). Compare ratios within one section: the disk changes speed from minute to minute.\n\n");
    for s in [
        "device",
        "decode",
        "decode-capped",
        "decode-capped-kernel",
        "decode-runs",
        "prefill",
        "spec",
        "trained",
        "batch",
        "batch-drafts",
        "batch-prefix",
        "batch-mixed",
        "stream",
        "k3",
        "kernels",
        "ladder",
        "ladder-reader",
        "ab",
        "ab-slice",
        "tokenizer",
        "grammar",
        "k31",
        "gpu",
    ] {
        if let Ok(t) = std::fs::read_to_string(bench_dir.join(format!("{s}.md"))) {
            report += &t;
            report.push('\n');
        }
    }
    std::fs::write(docs.join("BENCHMARKS.md"), report)?;
    let all = serde_json::Value::Object(json);
    std::fs::write(bench_dir.join(format!("{}.json", format!("{which:?}").to_lowercase())), serde_json::to_vec_pretty(&all)?)?;
    if let Some(p) = json_out {
        // For `ladder --json`, the file is the list of rungs.
        let v = if which == Which::Ladder { all.get("ladder").cloned().unwrap_or(json!([])) } else { all };
        std::fs::write(p, serde_json::to_vec_pretty(&v)?).with_context(|| format!("writing {}", p.display()))?;
    }
    eprintln!("updated {}", docs.join("BENCHMARKS.md").display());
    Ok(())
}
