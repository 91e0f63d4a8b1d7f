//! Decode and prefill measured through the engine on a store, each configuration repeated so the
//! report can show min / median / max (the machine is noisy).

use std::path::Path;

use std::sync::Arc;

use anyhow::{Context, Result};
use deltafin_core::Cpu;
use deltafin_sched::{CachePolicy, EngineBuilder, GenerateOptions, LoadedModel, Stats};

use super::flops::{Rates, Tally};

/// Prompt ids spread over the vocabulary, deterministic.
pub fn prompt(n: usize, vocab: u32) -> Vec<u32> {
    crate::oracle::prompt_ids(7, n, vocab as u64)
}

/// One engine configuration.
#[derive(Clone, Debug)]
pub struct RunConfig {
    pub label: String,
    pub budget: u64,
    pub prefetch: bool,
    pub policy: CachePolicy,
    pub chunk: Option<usize>,
    /// Read cap enforced by the engine's reader, bytes/s (the capped decode run).
    pub read_cap: Option<u64>,
}

/// One measured generation.
pub fn generate(store: &Path, cfg: &RunConfig, prompt: &[u32], new: usize) -> Result<(Vec<u32>, Stats)> {
    generate_stolen(store, cfg, prompt, new).map(|(ids, stats, _)| (ids, stats))
}

/// [`generate`], with the CPU time the VM's host took from this VM while it generated (opening
/// excluded), where the host reports it.
pub fn generate_stolen(store: &Path, cfg: &RunConfig, prompt: &[u32], new: usize) -> Result<(Vec<u32>, Stats, Option<f64>)> {
    let model = EngineBuilder::new(store)
        .ram_budget(Some(cfg.budget))
        .prefetch(cfg.prefetch)
        .cache_policy(cfg.policy)
        .prefill_chunk(cfg.chunk)
        .read_caps(cfg.read_cap.into_iter().collect())
        .context(prompt.len() + new + 8)
        .open()?;
    generate_on(&model, prompt, new)
}

/// `new` tokens after `prompt` on an open model: the ids, the stats, and the CPU time stolen
/// meanwhile ([`stolen_cpu_s`]).
fn generate_on(model: &LoadedModel, prompt: &[u32], new: usize) -> Result<(Vec<u32>, Stats, Option<f64>)> {
    let mut ids = Vec::new();
    let mut seq = model.new_sequence();
    let stolen = stolen_cpu_s();
    let stats = model.engine().generate(&mut seq, prompt, &GenerateOptions::new(new), |id| {
        ids.push(id);
        true
    })?;
    Ok((ids, stats, stolen.zip(stolen_cpu_s()).map(|(a, b)| b - a)))
}

/// CPU seconds the hypervisor has taken from this VM's cores since boot ("steal" in Linux's
/// `/proc/stat`, summed over cores): on this VM the host's emulation of the disk runs partly on
/// time taken from our cores, so a run that reads loses compute a run in RAM keeps. `None` where
/// there is no such file.
fn stolen_cpu_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    // "cpu  user nice system idle iowait irq softirq steal ...", in USER_HZ (100 per second on
    // every Linux this runs on).
    let steal: u64 = stat.lines().next()?.split_whitespace().nth(8)?.parse().ok()?;
    Some(steal as f64 / 100.0)
}

/// The same generation with every weight in RAM (the checkpoint's memory maps, page cache warmed
/// by a first run): what the computation alone costs.
pub fn in_ram(ckpt: &Path, prompt: &[u32], new: usize) -> Result<Stats> {
    let model = EngineBuilder::new(ckpt).context(prompt.len() + new + 8).open()?;
    let run = || {
        let mut seq = model.new_sequence();
        model.engine().generate(&mut seq, prompt, &GenerateOptions::new(new), |_| true)
    };
    run()?;
    Ok(run()?)
}

/// A compute-only prefill, its matrix products tallied.
#[derive(Clone, Debug, Default)]
pub struct ComputeRun {
    /// Time to first token.
    pub ttft_s: f64,
    /// FLOPs of the matrix products.
    pub flops: u64,
    /// Their time at the kernels' median and best rates, measured right before and after.
    pub bound_s: f64,
    pub bound_best_s: f64,
    /// Seconds inside the MXFP4 and the BF16 products, and those products at the median rates.
    pub products_s: [(f64, f64); 2],
    /// The rates it was priced at (mean of before and after; `None` only in a default).
    pub rates: Option<Rates>,
    /// Its products by kind and row count, to price another run of the same prompt (every run
    /// of one prompt makes the same products).
    pub tally: Option<Arc<Tally>>,
}

/// [`in_ram`] for one new token, its matrix products tallied, each of 3 runs priced at the
/// kernel rates measured right before and after it (this VM's speed moves by up to 1.4x from
/// minute to minute, so rates from another moment would judge the run by another machine):
/// the run with the median ratio of time to bound; and the model, still open, for more runs
/// beside other configurations'.
pub fn in_ram_tallied(ckpt: &Path, prompt: &[u32]) -> Result<(ComputeRun, InRam)> {
    let tally = Arc::new(Tally::new(Cpu::best()));
    let model = EngineBuilder::new(ckpt).context(prompt.len() + 9).backend(tally.clone()).open()?;
    let run = || {
        let mut seq = model.new_sequence();
        model.engine().generate(&mut seq, prompt, &GenerateOptions::new(1), |_| true)
    };
    run()?;
    let mut before = Rates::measure(Cpu::best());
    let mut runs = Vec::new();
    for _ in 0..3 {
        tally.reset();
        let stats = run()?;
        let after = Rates::measure(Cpu::best());
        let rates = before.mean(&after);
        let [mi, bi] = tally.bound_s(&rates, false);
        let [m, b] = tally.spent_s();
        runs.push(ComputeRun {
            ttft_s: stats.ttft_s,
            flops: tally.flops(),
            bound_s: mi + bi,
            bound_best_s: tally.bound_s(&rates, true).iter().sum(),
            products_s: [(m, mi), (b, bi)],
            rates: Some(rates),
            tally: Some(Arc::new(tally.snapshot())),
        });
        before = after;
    }
    runs.sort_by(|a, b| (a.ttft_s / a.bound_s).total_cmp(&(b.ttft_s / b.bound_s)));
    let r = runs[1].clone();
    let [(m, mi), (b, bi)] = r.products_s;
    eprintln!(
        "in RAM, {} tokens: {:.2} s, {:.2}x its bound (runs {:.2?} s, {:.2?}x); MXFP4 products {m:.2} s ({mi:.2} s at the kernel rates), BF16 {b:.2} s ({bi:.2} s), the rest {:.2} s",
        prompt.len(),
        r.ttft_s,
        r.ttft_s / r.bound_s,
        runs.iter().map(|r| r.ttft_s).collect::<Vec<_>>(),
        runs.iter().map(|r| r.ttft_s / r.bound_s).collect::<Vec<_>>(),
        r.ttft_s - m - b
    );
    Ok((r, InRam { model, tally, prompt: prompt.to_vec() }))
}

/// A compute-only model kept open (warm: its runs are not the process's first), to run its
/// prompt again right beside another configuration's run, so both meet the same minute of this
/// VM.
pub struct InRam {
    model: LoadedModel,
    tally: Arc<Tally>,
    prompt: Vec<u32>,
}

impl InRam {
    /// One more run of the prompt: its first token, its time to first token, and the CPU time
    /// stolen meanwhile.
    pub fn run(&self) -> Result<(Vec<u32>, f64, Option<f64>)> {
        self.tally.reset();
        let (ids, stats, stolen) = generate_on(&self.model, &self.prompt, 1)?;
        Ok((ids, stats.ttft_s, stolen))
    }
}

/// min, median, max.
pub fn spread(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    (s[0], s[s.len() / 2], s[s.len() - 1])
}

/// Per-configuration decode summary; the vectors hold one value per repeat.
#[derive(Clone, Debug, Default)]
pub struct DecodeResult {
    pub label: String,
    pub tok_s: Vec<f64>,
    pub bytes_per_token: f64,
    pub hit_rate: f64,
    pub read_wait_s: f64,
    pub compute_s: f64,
    /// Expert bytes read during decode / decode time.
    pub read_bytes_per_s: Vec<f64>,
    /// Expert bytes read during decode / time the busiest drive had reads in flight.
    pub busy_bytes_per_s: Vec<f64>,
    /// The device limit measured right before and after each repeat (their mean).
    pub limit: Vec<f64>,
    pub prefetch_used: u64,
    pub prefetch_issued: u64,
    pub prefetch_recall: f64,
    pub prefetch_wasted_bytes: u64,
    pub ids_equal: bool,
    /// Step time / max(read time at that repeat's device limit, compute-only step time).
    pub vs_bound: Vec<f64>,
    /// Step time / max(the time the drive was busy reading, compute-only step time): how much
    /// of the step is neither reading nor unavoidable compute, whatever speed the disk ran at.
    pub overlap: Vec<f64>,
}

impl DecodeResult {
    /// Read throughput over the device limit, per repeat.
    pub fn device_fraction(&self) -> Vec<f64> {
        self.read_bytes_per_s.iter().zip(&self.limit).map(|(r, l)| r / l).collect()
    }
    /// Read throughput while the drive was busy over the device limit, per repeat.
    pub fn busy_fraction(&self) -> Vec<f64> {
        self.busy_bytes_per_s.iter().zip(&self.limit).map(|(r, l)| r / l).collect()
    }
}

/// Expert reads per device-limit measurement around a repeat (about 0.5 GB: long enough to
/// average over the disk's short stalls, short enough to sit close to the run it brackets).
const LIMIT_READS: usize = 32;

/// Runs `f` between two device-limit measurements (QD 4, the engine's queue depth) and returns
/// its result with their mean: the limit that run is judged against.
fn bracketed<T>(store: &Path, f: impl FnOnce() -> Result<T>) -> Result<(T, f64)> {
    let before = crate::bench::device::read_rate(store, 4, LIMIT_READS)?;
    let out = f()?;
    let after = crate::bench::device::read_rate(store, 4, LIMIT_READS)?;
    eprintln!("device limit around the run: {:.0} -> {:.0} MB/s", before / 1e6, after / 1e6);
    Ok((out, (before + after) / 2.0))
}

/// Tokens per decode repeat and repeats per configuration.
fn decode_shape(quick: bool) -> (usize, usize) {
    if quick {
        (6, 2)
    } else {
        (16, 3)
    }
}

/// The compute-only decode step (seconds per token, everything in RAM) for the decode prompt.
fn compute_step(ckpt: &Path, vocab: u32, quick: bool) -> Result<f64> {
    let step = 1.0 / in_ram(ckpt, &prompt(8, vocab), decode_shape(quick).0)?.decode_tok_s.max(1e-9);
    eprintln!("decode compute-only: {step:.3} s/token");
    Ok(step)
}

/// Decode results plus the compute-only step time (seconds per token, everything in RAM).
///
/// The disk changes speed from minute to minute, so each repeat is bracketed by its own
/// device-limit measurement (QD 4, the engine's queue depth) and judged against it.
pub fn decode(store: &Path, ckpt: &Path, vocab: u32, budget: u64, quick: bool) -> Result<(Vec<DecodeResult>, f64)> {
    let step = compute_step(ckpt, vocab, quick)?;
    Ok((decode_with(store, vocab, budget, quick, step, None)?, step))
}

/// The decode configurations, judged against `compute_step`; `read_cap` (a reader-enforced
/// cap) also bounds each repeat's device limit.
pub fn decode_with(
    store: &Path,
    vocab: u32,
    budget: u64,
    quick: bool,
    compute_step: f64,
    read_cap: Option<u64>,
) -> Result<Vec<DecodeResult>> {
    let (new, repeats) = decode_shape(quick);
    let p = prompt(8, vocab);
    let config = |label: &str, prefetch, policy| RunConfig { label: label.into(), budget, prefetch, policy, chunk: None, read_cap };
    let configs = [
        config("next-use+prefetch (default)", true, CachePolicy::NextUse),
        config("next-use, no prefetch", false, CachePolicy::NextUse),
        config("lru+prefetch", true, CachePolicy::Lru),
    ];
    let mut reference: Option<Vec<u32>> = None;
    let mut out: Vec<DecodeResult> =
        configs.iter().map(|c| DecodeResult { label: c.label.clone(), ids_equal: true, ..Default::default() }).collect();
    // Round-robin: each round runs every configuration once, so a change of the disk's regime
    // lands on all of them and the rounds can be compared pairwise.
    for _ in 0..repeats {
        for (c, r) in configs.iter().zip(&mut out) {
            let ((ids, s), measured) = bracketed(store, || generate(store, c, &p, new))?;
            let limit = read_cap.map_or(measured, |cap| measured.min(cap as f64));
            match &reference {
                None => reference = Some(ids),
                Some(want) => r.ids_equal &= *want == ids,
            }
            let decode_time = (s.generated_tokens - 1) as f64 / s.decode_tok_s.max(1e-9);
            r.tok_s.push(s.decode_tok_s);
            r.limit.push(limit);
            let decode_bytes = (s.expert_bytes_read - s.expert_bytes_read_prefill) as f64;
            r.read_bytes_per_s.push(decode_bytes / decode_time);
            r.busy_bytes_per_s.push(decode_bytes / s.decode_read_busy_s.max(1e-9));
            r.vs_bound.push((1.0 / s.decode_tok_s.max(1e-9)) / (s.bytes_per_token / limit).max(compute_step));
            let steps = (s.generated_tokens - 1) as f64;
            r.overlap.push(decode_time / s.decode_read_busy_s.max(compute_step * steps));
            r.bytes_per_token = s.bytes_per_token;
            r.hit_rate = s.cache_hit_rate;
            r.read_wait_s = s.read_wait_s;
            r.compute_s = s.compute_s;
            r.prefetch_used = s.prefetch_used;
            r.prefetch_recall = s.prefetch_recall;
            r.prefetch_issued = s.prefetch_issued;
            r.prefetch_wasted_bytes = s.prefetch_wasted_bytes;
            eprintln!(
                "decode {}: {:.2} tok/s, {:.0} MB/token, {:.2}x the bound, {:.2}x busy reads",
                c.label,
                s.decode_tok_s,
                s.bytes_per_token / 1e6,
                r.vs_bound.last().expect("pushed"),
                r.overlap.last().expect("pushed")
            );
        }
    }
    Ok(out)
}

/// Per round, the first configuration's tok/s over the second's (prefetch on / off): paired
/// within a round, so the disk's regime changes between rounds cancel.
pub fn paired_gain(d: &[DecodeResult]) -> Vec<f64> {
    d[0].tok_s.iter().zip(&d[1].tok_s).map(|(a, b)| a / b.max(1e-9)).collect()
}

/// Per-prompt-length prefill summary.
#[derive(Clone, Debug, Default)]
pub struct PrefillResult {
    pub tokens: usize,
    pub schedule: String,
    pub ttft_s: Vec<f64>,
    pub amplification: f64,
    pub bytes_read: u64,
    pub distinct_bytes: u64,
    pub ids_equal: bool,
    /// Compute-only time to first token (everything in RAM).
    pub compute_s: f64,
    /// The device limit bracketing each repeat (mean of before and after).
    pub limit: Vec<f64>,
    /// Per repeat: TTFT / (distinct bytes at that repeat's device limit + compute-only TTFT).
    pub vs_bound: Vec<f64>,
    /// FLOPs of the prompt's matrix products (compute-only run).
    pub flops: u64,
    /// Per repeat: those products' time at the kernel rates (median repeats) measured right
    /// before and after that repeat, as the compute-only runs are priced.
    pub flop_bound_s: Vec<f64>,
    /// The same at the best repeats' rates.
    pub flop_bound_best_s: Vec<f64>,
    /// The compute-only run in detail (the bound at the best repeats' rates, products' time).
    pub compute: ComputeRun,
    /// Per repeat: TTFT / max(distinct bytes at that repeat's device limit, its `flop_bound_s`).
    pub vs_max_bound: Vec<f64>,
    /// The same against `flop_bound_best_s`.
    pub vs_max_bound_best: Vec<f64>,
    /// Expert-major only, per repeat: TTFT / the compute-only TTFT of a run in RAM right after
    /// it (the same minute of this VM): what streaming the experts costs, whatever the minute.
    pub vs_beside: Vec<f64>,
    /// Expert-major only, per repeat: CPU seconds the VM's host stole during the streamed run
    /// and during the run in RAM beside it.
    pub stolen_s: Vec<(f64, f64)>,
}

/// Repeats of the expert-major schedule, the one the targets are about: a median of 3 (this VM's
/// minutes differ by up to 1.4x, and a median of 2 is their mean).
pub fn major_repeats(quick: bool) -> usize {
    if quick {
        1
    } else {
        3
    }
}

/// Prefill results; like decode, each repeat is judged against its own bracketing device limit.
pub fn prefill(store: &Path, ckpt: &Path, vocab: u32, budget: u64, quick: bool) -> Result<(Vec<PrefillResult>, Rates)> {
    let lengths: &[usize] = if quick { &[64] } else { &[64, 256, 512] };
    let repeats = if quick { 1 } else { 2 };
    // The rates the longest prompt's compute-only run was priced at, for the table's header.
    let mut rates = None;
    let mut out = Vec::new();
    for &n in lengths {
        let p = prompt(n, vocab);
        // Expert-major (whole prompt), the upstream engine's 64-token chunks, and token by token.
        let mut schedules = vec![("expert-major", None), ("64-token chunks", Some(64))];
        // Token by token for every length (the quick mode has only the shortest).
        schedules.push(("token by token", Some(1)));
        let mut want: Option<Vec<u32>> = None;
        // Amplification is against the distinct experts the *whole* prompt routes per layer,
        // which the expert-major pass (first) measures.
        let mut distinct: Option<u64> = None;
        let (compute, beside) = in_ram_tallied(ckpt, &p)?;
        // Kernel rates measured right after this length's last streamed repeat: the next one's
        // "before" (a new length starts afresh: its compute-only runs took minutes).
        let mut last_rates: Option<Rates> = None;
        rates = compute.rates.clone();
        let (compute_s, flops) = (compute.ttft_s, compute.flops);
        let tally = compute.tally.clone().context("the compute-only run keeps its tally")?;
        for (name, chunk) in schedules {
            if chunk == Some(64) && n <= 64 {
                continue;
            }
            let c = RunConfig { label: name.into(), budget, prefetch: false, policy: CachePolicy::NextUse, chunk, read_cap: None };
            let mut r = PrefillResult {
                tokens: n,
                schedule: name.into(),
                ids_equal: true,
                compute_s,
                flops,
                compute: compute.clone(),
                ..Default::default()
            };
            let reps = match chunk {
                None => major_repeats(quick),
                Some(1) => 1,
                Some(_) => repeats,
            };
            for _ in 0..reps {
                // Priced like the compute-only runs: at kernel rates measured right before and
                // after this repeat, so the bound meets the machine the run met.
                let before = last_rates.take().unwrap_or_else(|| Rates::measure(Cpu::best()));
                let ((ids, s, stolen), limit) = bracketed(store, || generate_stolen(store, &c, &p, 1))?;
                let after = Rates::measure(Cpu::best());
                let rates = before.mean(&after);
                last_rates = Some(after);
                if chunk.is_none() {
                    let (in_ram_ids, in_ram, in_ram_stolen) = beside.run()?;
                    // The same token in RAM as streamed (and every repeat's, checked below).
                    r.ids_equal &= in_ram_ids == ids;
                    r.vs_beside.push(s.ttft_s / in_ram);
                    if let (Some(a), Some(b)) = (stolen, in_ram_stolen) {
                        r.stolen_s.push((a, b));
                    }
                    // The next repeat measures its own "before": this one's "after" is a run ago.
                    last_rates = None;
                }
                let flop_bound_s: f64 = tally.bound_s(&rates, false).iter().sum();
                let flop_bound_best_s: f64 = tally.bound_s(&rates, true).iter().sum();
                match &want {
                    None => want = Some(ids),
                    Some(w) => r.ids_equal &= *w == ids,
                }
                r.ttft_s.push(s.ttft_s);
                r.bytes_read = s.expert_bytes_read_prefill;
                let d = *distinct.get_or_insert(s.expert_bytes_distinct_prefill);
                r.distinct_bytes = d;
                r.amplification = s.expert_bytes_read_prefill as f64 / d.max(1) as f64;
                r.limit.push(limit);
                r.vs_bound.push(s.ttft_s / (d as f64 / limit + compute_s));
                r.vs_max_bound.push(s.ttft_s / (d as f64 / limit).max(flop_bound_s));
                r.vs_max_bound_best.push(s.ttft_s / (d as f64 / limit).max(flop_bound_best_s));
                r.flop_bound_s.push(flop_bound_s);
                r.flop_bound_best_s.push(flop_bound_best_s);
            }
            eprintln!(
                "prefill {n} tokens, {name}: TTFT {:.2?} s, amplification {:.2}, {:.2?}x the bound, {:.2?}x the FLOP bound ({:.2?} s), {:.2?}x in RAM beside it, CPU s stolen by the host (streamed, in RAM) {:.2?}",
                r.ttft_s, r.amplification, r.vs_bound, r.vs_max_bound, r.flop_bound_s, r.vs_beside, r.stolen_s
            );
            out.push(r);
        }
    }
    Ok((out, rates.context("no prompt length to measure")?))
}
