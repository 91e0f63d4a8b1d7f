//! `cargo xtask bench batch-drafts`: drafts inside a lockstep batch (issue 49), on the tiny
//! trained K3 (`training/models/k3`, in RAM), whose text repeats where its prompt does: the same
//! N jobs run in lockstep without drafts and with prompt-lookup drafts (`Batcher::drafting`),
//! configurations alternating round by round, each on a freshly opened model. Every job's ids
//! must be the same both ways (checked).

use std::fmt::Write as _;

use anyhow::{ensure, Result};
use deltafin_sched::{BatchStats, Batcher, EngineBuilder};

use super::engine_runs::spread;

/// Prompts the trained model continues by repeating what it read (as the demo's), varied per job.
fn prompts(n: usize) -> Vec<String> {
    let names = ["Ernest", "Cecily", "Gwendolen", "Algernon", "Jack", "Miriam", "Lane", "Merriman"];
    (0..n)
        .map(|i| {
            let line = format!("I am a man of honour and a man whose name is {}. ", names[i % names.len()]);
            format!("{}{line}I am a man of honour and", line.repeat(2))
        })
        .collect()
}

/// One lockstep run of `n` jobs: its stats and each job's ids.
fn run_once(n: usize, new: usize, draft: usize) -> Result<(BatchStats, Vec<Vec<u32>>)> {
    let model = EngineBuilder::new(super::root().join("training/models/k3")).max_sequences(n).context(512).open()?;
    let ids = prompts(n).iter().map(|p| model.tokenizer().encode_ordinary(p)).collect();
    super::batch::run_jobs(Batcher::new(&model, n).drafting(draft), ids, new)
}

pub fn run(quick: bool) -> Result<String> {
    let (n, new, rounds) = if quick { (4, 48, 2) } else { (4, 96, 3) };
    let (mut plain, mut drafted) = (Vec::new(), Vec::new());
    let mut last = None;
    for round in 0..rounds {
        let (p, p_ids) = run_once(n, new, 0)?;
        let (d, d_ids) = run_once(n, new, 4)?;
        ensure!(p_ids == d_ids, "round {round}: drafted ids differ from plain ones");
        eprintln!(
            "batch-drafts round {round}: plain {:.1} tok/s, drafted {:.1} tok/s ({} of {} drafts accepted)",
            p.tok_s(),
            d.tok_s(),
            d.accepted,
            d.drafted
        );
        plain.push(p.tok_s());
        drafted.push(d.tok_s());
        last = Some((p, d));
    }
    let (p, d) = last.expect("at least one round");
    let (pa, pb, pc) = spread(&plain);
    let (da, db, dc) = spread(&drafted);
    let mut md = format!(
        "## Drafts inside a lockstep batch\n\n`cargo xtask bench batch-drafts{}` — the tiny trained K3 in RAM, {n} jobs in lockstep, each a prompt the model continues by repeating it ({new} new tokens each), without drafts and with prompt-lookup drafts of up to 4 per job per step (`Batcher::drafting`); {rounds} rounds, the two alternating, each on a freshly opened model; every job's ids equal both ways (checked).\n\n",
        if quick { " --quick" } else { "" }
    );
    writeln!(md, "| batch of {n} | aggregate tok/s min / median / max | steps | drafts accepted / drafted | verify slots |")?;
    writeln!(md, "|---|---|---|---|---|")?;
    writeln!(md, "| plain | {pa:.1} / {pb:.1} / {pc:.1} | {} | - | - |", p.steps)?;
    writeln!(md, "| drafted | {da:.1} / {db:.1} / {dc:.1} | {} | {} / {} | {} |", d.steps, d.accepted, d.drafted, d.verifies)?;
    writeln!(
        md,
        "\nDrafted / plain (medians): **{:.2}x** aggregate tok/s, {:.2}x the steps.",
        db / pb,
        d.steps as f64 / p.steps.max(1) as f64
    )?;
    Ok(md)
}
