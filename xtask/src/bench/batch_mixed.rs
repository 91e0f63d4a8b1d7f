//! `cargo xtask bench batch-mixed`: a long prompt arriving while others decode (issue 49), on the
//! tiny trained K3 (`training/models/k3`, in RAM). Three short jobs start decoding; a few steps
//! later a 2048-token prompt and another short job arrive. Configurations, alternating round by
//! round, each on a freshly opened model: the long prompt run whole in one step (the engine's
//! chunk, no bound: lockstep as it was) and in chunks of 512 and 256 while others decode
//! (`Batcher::mixed_prompt_chunk`). Measured: the longest wait between two tokens of the
//! decoding jobs, the late short job's time to first token, the long job's, and the whole batch.
//! Every job's ids must be the same in every configuration (checked).

use std::fmt::Write as _;
use std::time::Instant;

use anyhow::{ensure, Result};
use deltafin_sched::{BatchEvent, BatchJob, Batcher, EngineBuilder, GenerateOptions};

use super::engine_runs::spread;

/// What one run measured (seconds) and each job's ids.
struct Mixed {
    stall: f64,
    late_ttft: f64,
    long_ttft: f64,
    total: f64,
    ids: Vec<Vec<u32>>,
}

fn short(seed: u32, n: usize) -> BatchJob {
    BatchJob::new((0..20).map(|i| (i * 131 + seed * 17 + 5) % 8000).collect(), GenerateOptions::new(n))
}

fn run_once(chunk: Option<usize>, long: usize, new: usize) -> Result<Mixed> {
    let model = EngineBuilder::new(super::root().join("training/models/k3")).max_sequences(5).context(long + 64).open()?;
    let mut b = Batcher::new(&model, 5).mixed_prompt_chunk(chunk);
    for s in 0..3 {
        b.submit(short(s, new));
    }
    let start = Instant::now();
    let mut times: Vec<Vec<Instant>> = vec![Vec::new(); 5];
    let mut ids: Vec<Vec<u32>> = vec![Vec::new(); 5];
    let mut on = |e: BatchEvent<'_>| {
        if let BatchEvent::Token { job, step } = e {
            times[job as usize].push(Instant::now());
            ids[job as usize].push(step.id);
        }
        true
    };
    for _ in 0..4 {
        b.step(&mut on);
    }
    let arrived = Instant::now();
    b.submit(BatchJob::new((0..long as u32).map(|i| (i * 37 + 11) % 8000).collect(), GenerateOptions::new(8)));
    b.submit(short(9, 16));
    while !b.is_idle() {
        b.step(&mut on);
    }
    ensure!(b.stats().jobs_failed == 0, "a job failed");
    let total = start.elapsed().as_secs_f64();
    let stall = times[..3].iter().flat_map(|t| t.windows(2).map(|w| (w[1] - w[0]).as_secs_f64())).fold(0.0, f64::max);
    let ttft = |j: usize| (times[j][0] - arrived).as_secs_f64();
    Ok(Mixed { stall, late_ttft: ttft(4), long_ttft: ttft(3), total, ids })
}

pub fn run(quick: bool) -> Result<String> {
    let (long, new, rounds) = if quick { (2048, 32, 2) } else { (2048, 64, 3) };
    let configs: [(&str, Option<usize>); 3] =
        [("whole (lockstep as it was)", None), ("chunks of 512", Some(512)), ("chunks of 256", Some(256))];
    let mut results: Vec<Vec<Mixed>> = configs.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        for (i, (name, chunk)) in configs.iter().enumerate() {
            let m = run_once(*chunk, long, new)?;
            eprintln!(
                "batch-mixed round {round} {name}: longest gap {:.3} s, late short TTFT {:.3} s, long TTFT {:.3} s",
                m.stall, m.late_ttft, m.long_ttft
            );
            results[i].push(m);
        }
    }
    for (i, r) in results.iter().enumerate().skip(1) {
        ensure!(r.iter().zip(&results[0]).all(|(a, b)| a.ids == b.ids), "{}: ids differ from the whole-prompt run", configs[i].0);
    }
    let mut md = format!(
        "## A long prompt among decoding jobs\n\n`cargo xtask bench batch-mixed{}` — the tiny trained K3 in RAM, no budget (so the engine's prefill chunk sets no bound): three 20-token jobs decode {new} tokens each; after 4 steps a {long}-token prompt and another short job arrive. The long prompt runs whole in one step, as lockstep did, or in chunks while others decode (`Batcher::mixed_prompt_chunk`, default 512 in `serve --max-batch` and `deltafin batch`); {rounds} rounds, configurations alternating, each on a freshly opened model; every job's ids equal in all three (checked). Seconds, min / median / max.\n\n",
        if quick { " --quick" } else { "" }
    );
    writeln!(md, "| long prompt | longest gap between a decoding job's tokens | late short job's TTFT | long job's TTFT | whole batch |")?;
    writeln!(md, "|---|---|---|---|---|")?;
    let cell = |v: Vec<f64>| {
        let (a, b, c) = spread(&v);
        format!("{a:.3} / {b:.3} / {c:.3}")
    };
    for ((name, _), r) in configs.iter().zip(&results) {
        writeln!(
            md,
            "| {name} | {} | {} | {} | {} |",
            cell(r.iter().map(|m| m.stall).collect()),
            cell(r.iter().map(|m| m.late_ttft).collect()),
            cell(r.iter().map(|m| m.long_ttft).collect()),
            cell(r.iter().map(|m| m.total).collect())
        )?;
    }
    let med = |i: usize, f: fn(&Mixed) -> f64| spread(&results[i].iter().map(f).collect::<Vec<_>>()).1;
    writeln!(
        md,
        "\nChunks of 512 / whole (medians): **{:.2}x** the longest gap, {:.2}x the late short job's TTFT, {:.2}x the long job's TTFT, {:.2}x the whole batch.",
        med(1, |m| m.stall) / med(0, |m| m.stall),
        med(1, |m| m.late_ttft) / med(0, |m| m.late_ttft),
        med(1, |m| m.long_ttft) / med(0, |m| m.long_ttft),
        med(1, |m| m.total) / med(0, |m| m.total)
    )?;
    Ok(md)
}
