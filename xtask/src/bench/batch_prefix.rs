//! `cargo xtask bench batch-prefix`: a batch whose requests share a system prompt (issue 49), on
//! the tiny trained K3 (`training/models/k3`, in RAM): the same N jobs (one long system text,
//! then a short question of each job's own) run in lockstep as they are and with the shared
//! prefix run once (`Batcher::share_prefixes`), configurations alternating round by round, each
//! on a freshly opened model. Every job's ids must be the same both ways (checked).

use std::fmt::Write as _;

use anyhow::{ensure, Result};
use deltafin_sched::{BatchStats, Batcher, EngineBuilder};

use super::engine_runs::spread;

/// A system text every job starts with, then each job's own question.
fn prompts(n: usize) -> Vec<String> {
    let system = "You are the harbour master of a small port on a cold northern coast. You answer the questions of sailors, fishermen and travellers about the tides, the weather, the boats in the harbour and the roads inland, in plain words and short sentences, and you never guess: when you do not know, you say so and name someone who might. ".repeat(2);
    let topics = [
        "the evening tide",
        "the fishing boats",
        "the road to the mill",
        "the storm last night",
        "the ferry",
        "the lighthouse",
        "the new pier",
        "the market",
    ];
    (0..n).map(|i| format!("{system}A traveller asks about {}.", topics[i % topics.len()])).collect()
}

/// One lockstep run of `n` jobs, sharing the prefix or not: its stats and each job's ids.
fn run_once(n: usize, new: usize, share: bool) -> Result<(BatchStats, Vec<Vec<u32>>)> {
    let model = EngineBuilder::new(super::root().join("training/models/k3")).max_sequences(n).kept_states(1).context(512).open()?;
    let ids = prompts(n).iter().map(|p| model.tokenizer().encode_ordinary(p)).collect();
    let b = Batcher::new(&model, n);
    super::batch::run_jobs(if share { b.share_prefixes(16) } else { b }, ids, new)
}

pub fn run(quick: bool) -> Result<String> {
    let (n, new, rounds) = if quick { (8, 8, 2) } else { (8, 16, 3) };
    let (mut plain, mut shared) = (Vec::new(), Vec::new());
    let mut last = None;
    for round in 0..rounds {
        let (p, p_ids) = run_once(n, new, false)?;
        let (s, s_ids) = run_once(n, new, true)?;
        ensure!(p_ids == s_ids, "round {round}: ids differ with the prefix shared");
        eprintln!("batch-prefix round {round}: {:.3} s as they are, {:.3} s sharing the prefix", p.seconds, s.seconds);
        plain.push(p.seconds);
        shared.push(s.seconds);
        last = Some((p, s));
    }
    let (p, s) = last.expect("at least one round");
    let submitted = p.prompt_tokens;
    let (pa, pb, pc) = spread(&plain);
    let (sa, sb, sc) = spread(&shared);
    let mut md = format!(
        "## A batch sharing a system prompt\n\n`cargo xtask bench batch-prefix{}` — the tiny trained K3 in RAM, {n} jobs in lockstep, each the same {}-token system text and a question of its own ({new} new tokens each), run as they are and with the shared prefix run once (`Batcher::share_prefixes`; `deltafin batch` does this); {rounds} rounds, the two alternating, each on a freshly opened model; every job's ids equal both ways (checked).\n\n",
        if quick { " --quick" } else { "" },
        s.cached_tokens / (n as u64 - 1).max(1)
    );
    writeln!(md, "| batch of {n} | prompt tokens computed / submitted | shared prefixes | seconds min / median / max |")?;
    writeln!(md, "|---|---|---|---|")?;
    writeln!(md, "| as they are | {} / {submitted} | - | {pa:.3} / {pb:.3} / {pc:.3} |", p.prompt_tokens)?;
    writeln!(md, "| prefix shared | {} / {submitted} | {} | {sa:.3} / {sb:.3} / {sc:.3} |", s.prompt_tokens, s.shared_prefixes)?;
    writeln!(
        md,
        "\nShared / as they are: **{:.2}x** the prompt tokens computed, {:.2}x the time (medians; the jobs sharing the prefix wait for it before they start).",
        s.prompt_tokens as f64 / p.prompt_tokens.max(1) as f64,
        sb / pb
    )?;
    Ok(md)
}
