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

pub fn run(work: &Path) -> Result<String> {
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
        };
        let plan = Plan::new(&sizes, &input, &rates);
        writeln!(md, "RAM {:.0} GB:\n\n```\n{}```\n", ram / 1e9, plan.render(&rates))?;
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(md)
}
