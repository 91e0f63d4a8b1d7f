//! `cargo xtask bench k3`: the real K3 at its full size, as a sparse layout (every weight zero,
//! written as holes). Measured: writing the layout, opening the 96 shards (every header), finding
//! all 82,432 expert spans, loading the spine (lent from memory maps, small tensors read), each
//! with the process's peak RSS; then `deltafin plan`'s projection for the upstream engine's rig
//! at 16, 64, 96 and 128 GB of RAM, with this machine's measured kernel rates.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use deltafin_core::Cpu;
use deltafin_sched::{model_sizes, peak_rss_bytes, ComputeRates, Plan, PlanInput};
use deltafin_store::Checkpoint;

/// The upstream engine's rig: four drives (GB/s).
const RIG_DRIVES: [f64; 4] = [13.6e9, 7.1e9, 7.1e9, 5.7e9];

/// Decode and prefill on `store` (slice-mini, real expert size) with the whole spine in RAM, half
/// of its layers streamed, and all of them (the minimum): tok/s, TTFT and bytes read per token,
/// beside the bound the drive's measured rate sets.
fn streamed_rows(store: &Path, vocab: u32, rounds: usize) -> Result<String> {
    use super::engine_runs::spread;
    // One context for every run, so a budget makes the same plan for decode and prefill.
    const CONTEXT: usize = 96;
    let prompt = crate::oracle::prompt_ids(21, 64, vocab as u64);
    let short = crate::oracle::prompt_ids(22, 4, vocab as u64);
    let open = |b: u64| deltafin_sched::EngineBuilder::new(store).ram_budget(Some(b)).context(CONTEXT).open();
    let generate = |b: u64, p: &[u32], new: usize| -> Result<(Vec<u32>, deltafin_sched::Stats, usize)> {
        let m = open(b)?;
        let streamed = m.memory_plan().map_or(0, |p| p.streamed_layers);
        let mut seq = m.new_sequence();
        let mut ids = Vec::new();
        let st = m.engine().generate(&mut seq, p, &deltafin_sched::GenerateOptions::new(new), |t| {
            ids.push(t);
            true
        })?;
        Ok((ids, st, streamed))
    };
    let min: u64 = match open(1) {
        Err(e) => e.to_string().split("needs at least ").nth(1).and_then(|r| r.split(' ').next()).and_then(|n| n.parse().ok()).unwrap_or(0),
        Ok(_) => 0,
    };
    anyhow::ensure!(min > 0, "no minimum budget stated");
    let spine = deltafin_store::Store::open(store)?.spine_bytes();
    // Spine layers come first in a short budget (every byte of them is read each pass), so
    // budgets below the whole spine leave the experts little.
    let layers = deltafin_store::Store::open(store)?.config().num_layers;
    let streamed_at = |b: u64| open(b).map(|m| m.memory_plan().map_or(0, |p| p.streamed_layers)).unwrap_or(layers);
    // The budget between the minimum and the whole spine that streams closest to half the layers.
    let half = (0..=32u64).map(|i| min + spine * i / 32).min_by_key(|&b| (2 * streamed_at(b)).abs_diff(layers)).unwrap_or(min);
    let budgets = [
        ("whole spine in RAM, 200 MB of experts", min + spine + 200_000_000),
        ("about half the layers streamed", half),
        ("every layer streamed (the minimum)", min),
    ];
    let mut want: Option<Vec<u32>> = None;
    let mut rows = vec![(Vec::new(), Vec::new(), 0.0, 0.0, 0usize); budgets.len()];
    for _ in 0..rounds {
        for (i, (_, b)) in budgets.iter().enumerate() {
            let (ids, d, streamed) = generate(*b, &short, 12)?;
            anyhow::ensure!(want.get_or_insert_with(|| ids.clone()) == &ids, "ids differ with the spine streamed");
            let (_, p, _) = generate(*b, &prompt, 1)?;
            // Decode passes: the generated tokens after the first, which the prompt's pass made.
            let passes = (d.generated_tokens - 1).max(1) as f64;
            let spine_decode = d.spine_bytes_read as f64 * passes / (passes + 1.0);
            let per_token = d.bytes_per_token + spine_decode / passes;
            let r = &mut rows[i];
            r.0.push(d.decode_tok_s);
            r.1.push(p.ttft_s);
            r.2 = per_token;
            r.3 = d.per_drive.iter().map(|h| h.rate).fold(0.0, f64::max);
            r.4 = streamed;
        }
    }
    let mut md = String::from("\nWith part of the spine streamed (`slice-mini`, real expert size, on this machine's disk; `cargo xtask bench k3`): a 4-token prompt and 12 new tokens for decode, a 64-token prompt for TTFT, context 96, each budget run in turn, ids equal at every budget (checked). MB/token: experts and spine read per decode token; bound: the expert drive's measured read rate over those bytes (the spine is read from the same disk).\n\n| budget | layers streamed | decode tok/s min / median / max | bound tok/s | MB/token | TTFT 64 tokens s (median) |\n|---|---|---|---|---|---|\n");
    for ((label, b), r) in budgets.iter().zip(&rows) {
        let (lo, mid, hi) = spread(&r.0);
        let bound = if r.2 > 0.0 { r.3 / r.2 } else { f64::INFINITY };
        writeln!(
            md,
            "| {label} ({:.0} MB) | {} | {lo:.2} / {mid:.2} / {hi:.2} | {bound:.2} | {:.1} | {:.2} |",
            *b as f64 / 1e6,
            r.4,
            r.2 / 1e6,
            spread(&r.1).1
        )?;
    }
    Ok(md)
}

pub fn run(work: &Path, store: &Path, vocab: u32, quick: bool) -> Result<String> {
    let dir = work.join("k3-sparse");
    let mut rows = Vec::new();
    let mut phase = |name: &str, t: Instant| {
        rows.push(format!("| {name} | {:.2} | {:.0} |", t.elapsed().as_secs_f64(), peak_rss_bytes() as f64 / 1e6));
        eprintln!("bench k3: {}", rows.last().expect("just pushed"));
    };
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    let t = Instant::now();
    // In a child process, so the peak RSS below is the opening's alone.
    let st = std::process::Command::new(std::env::current_exe()?)
        .args(["gen-k3", "--preset", "k3", "--sparse", "--out"])
        .arg(&dir)
        .env("DELTAFIN_QUIET", "1")
        .status()?;
    anyhow::ensure!(st.success(), "gen-k3 failed");
    phase("`gen-k3 --preset k3 --sparse` (96 shards, 497,220 tensors, 1.56 TB apparent)", t);
    let t = Instant::now();
    let ckpt = Checkpoint::open(&dir)?;
    phase("open: config, index, 96 shard headers", t);
    let t = Instant::now();
    let mut experts = 0;
    for l in ckpt.config().moe_layers() {
        experts += ckpt.expert_spans(l)?.1.len();
    }
    anyhow::ensure!(experts == 82_432, "{experts} experts");
    phase("expert manifest: 82,432 spans, one contiguous read each", t);
    let t = Instant::now();
    let model = deltafin_core::Model::load(ckpt.config().clone(), &ckpt)?;
    phase("spine: 113.5 GB lent from memory maps (small tensors read and widened)", t);
    drop(model);
    let on_disk: u64 =
        std::fs::read_dir(&dir)?.map(|e| Ok(std::os::unix::fs::MetadataExt::blocks(&e?.metadata()?) * 512)).sum::<Result<u64>>()?;

    let sizes = model_sizes(&dir)?;
    let rates = ComputeRates::measure(&sizes.config, &Cpu::best());
    let mut md = String::from("## The real K3 at full size\n\n`cargo xtask bench k3` — the full K3 layout (`gen-k3 --preset k3 --sparse`: real config, names, dtypes, shapes, 96 shards, index, tokenizer; every weight zero, written as holes), opened as a downloaded K3 is. Times in seconds; peak RSS of the bench process after each phase (the layout is written by a child process, so from the second row on it is the opening's own).\n\n| phase | s | peak RSS MB |\n|---|---|---|\n");
    for r in &rows {
        md += r;
        md.push('\n');
    }
    writeln!(md, "\nThe layout takes {:.0} MB of disk. Running it: `deltafin run --model models/k3-sparse` works (everything mapped; zero weights give zero logits). Under a RAM budget, spine layers that do not fit are read each pass (two at a time); the minimum is below.\n", on_disk as f64 / 1e6)?;
    writeln!(md, "Projection for the upstream engine's rig (drives of 13.6, 7.1, 7.1 and 5.7 GB/s), by `deltafin plan --model models/k3-sparse --ram SIZE --drive 13.6G --drive 7.1G --drive 7.1G --drive 5.7G`. Its compute rates are this machine's (2 CPU cores, measured with the engine's kernels at K3's shapes), not a Mac's GPU: the compute-bound figures say what this CPU would do, the read figures what the drives allow.\n")?;
    for ram in [16e9, 64e9, 96e9, 128e9] {
        let input = PlanInput {
            ram: ram as u64,
            drives: RIG_DRIVES.to_vec(),
            read_efficiency: None,
            prompt_tokens: 512,
            context: deltafin_sched::DEFAULT_CONTEXT,
            compute_scale: 1.0,
        };
        let plan = Plan::new(&sizes, &input, &rates);
        writeln!(md, "RAM {:.0} GB:\n\n```\n{}```\n", ram / 1e9, plan.render(&rates))?;
    }
    writeln!(md, "The upstream engine on that rig (its README): 1.0 tok/s decode and 375 s to the first token of a 512-token prompt, on a Mac's GPU; the projection's read-bound figures are what Deltafin's reads would allow there, its compute figures this machine's 2 CPU cores.")?;
    std::fs::remove_dir_all(&dir)?;
    md += &streamed_rows(store, vocab, if quick { 1 } else { 3 })?;
    Ok(md)
}
