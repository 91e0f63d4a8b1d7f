//! `cargo xtask bench spec`: speculative decoding on the `slice` store, every drafter against plain
//! decoding in one run, configurations round-robin (each round runs every configuration once, on
//! a freshly opened model, so all start from the same cold cache), ratios paired within a round.
//!
//! Drafters: prompt lookup (`ngram`), a Qwen3 draft model sharing the slice's vocabulary
//! (`gen-qwen3 --vocab-from`), an oracle replaying the plain run (always right: the upper bound),
//! and a random drafter (always wrong), with the live cost gate choosing draft lengths, plus the
//! random drafter at a fixed length (what the gate saves). Every run's ids must equal plain
//! decoding's.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{ensure, Result};
use deltafin_sched::{DraftWith, EngineBuilder, GenerateOptions, LoadedModel, Stats};
use deltafin_spec::{Drafter, OracleDrafter, RandomDrafter};

use super::engine_runs::spread;

/// The prompt: a passage and a request to repeat it, the kind of text prompt lookup is for.
const PASSAGE: &str = "The dense spine stays in memory while the routed experts stay on disk and are read on demand, \
one contiguous read per expert, spread over every drive, through a cache bounded by the budget.";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Plain,
    Ngram,
    DraftModel,
    Oracle,
    Random,
    RandomFixed,
    DraftFixed,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Plain => "plain",
            Kind::Ngram => "ngram (prompt lookup)",
            Kind::DraftModel => "draft model (Qwen3, 2 layers)",
            Kind::Oracle => "oracle (always right)",
            Kind::Random => "random (always wrong)",
            Kind::RandomFixed => "random, gate off (4 every step)",
            Kind::DraftFixed => "draft model, gate off (4 every step)",
        }
    }
}

const KINDS: [Kind; 6] = [Kind::Plain, Kind::Ngram, Kind::DraftModel, Kind::Oracle, Kind::Random, Kind::RandomFixed];

/// One configuration's results, one entry per round.
#[derive(Clone, Debug)]
pub struct SpecResult {
    kind: Kind,
    tok_s: Vec<f64>,
    /// tok/s over plain's in the same round.
    ratio: Vec<f64>,
    bytes_per_token: Vec<f64>,
    last: Stats,
    ids_equal: bool,
}

fn run_one(model: &LoadedModel, kind: Kind, prompt: &[u32], new: usize, plain: &[u32]) -> Result<(Vec<u32>, Stats)> {
    let mut seq = model.new_sequence();
    let mut ids = Vec::new();
    let fixed = matches!(kind, Kind::RandomFixed | Kind::DraftFixed);
    let opts = GenerateOptions::new(new).draft_max(4).draft_gate(!fixed);
    let mut drafter: Option<Box<dyn Drafter + Send>> = match kind {
        Kind::Plain => None,
        Kind::Ngram | Kind::DraftModel | Kind::DraftFixed => model.drafter(),
        Kind::Oracle => {
            let mut script = prompt.to_vec();
            script.extend_from_slice(plain);
            Some(Box::new(OracleDrafter { script }))
        }
        Kind::Random | Kind::RandomFixed => Some(Box::new(RandomDrafter { vocab: model.tokenizer().bpe_len() as u32, state: 11 })),
    };
    let stats = match drafter.as_deref_mut() {
        None => model.engine().generate(&mut seq, prompt, &opts, |id| {
            ids.push(id);
            true
        })?,
        Some(d) => model.engine().generate_drafted(&mut seq, prompt, &opts, d, |s| {
            ids.push(s.id);
            true
        })?,
    };
    Ok((ids, stats))
}

/// How much a verify's rows share experts: over several positions of `ids` (after `prompt`),
/// the union of expert bytes a 5-row verify routes over 5 times what one row routes.
fn union_ratio(model: &LoadedModel, prompt: &[u32], ids: &[u32]) -> Result<f64> {
    use deltafin_sched::{Phase, Slot};
    let (mut union, mut single) = (0u64, 0u64);
    for at in (0..ids.len().saturating_sub(5)).step_by(4).take(6) {
        let mut seq = model.new_sequence();
        let mut context = prompt.to_vec();
        context.extend_from_slice(&ids[..at]);
        model.engine().step(&mut [Slot::new(&mut seq, &context, Phase::Prompt)], None)?;
        let mut one = seq.clone();
        union += model.engine().step(&mut [Slot::new(&mut seq, &ids[at..at + 5], Phase::Verify)], None)?.report.distinct_expert_bytes;
        single += 5 * model.engine().step(&mut [Slot::new(&mut one, &ids[at..at + 1], Phase::Decode)], None)?.report.distinct_expert_bytes;
    }
    Ok(union as f64 / single.max(1) as f64)
}

/// Runs every configuration `rounds` times, round-robin, on the store of `preset`; returns the
/// markdown section.
pub fn run(preset: &str, store: &Path, ckpt: &Path, budget: u64, quick: bool) -> Result<String> {
    let draft_dir = super::root().join(format!("models/{preset}-draft"));
    if !draft_dir.join("config.json").exists() {
        crate::gen_qwen3::generate(0, Some(ckpt), &draft_dir)?;
    }
    run_with(preset, store, &draft_dir, None, budget, quick)
}

/// As [`run`] with a given draft model and, instead of the repeat-this-passage prompt, `text`
/// (a prompt to continue: what a trained pair drafts on).
pub fn run_with(preset: &str, store: &Path, draft_dir: &Path, text: Option<&str>, budget: u64, quick: bool) -> Result<String> {
    let (new, rounds) = if quick { (24, 2) } else { (96, 3) };
    let draft_dir = draft_dir.to_path_buf();
    let open = |kind: Kind| {
        let draft = match kind {
            Kind::Ngram => Some(DraftWith::Ngram),
            Kind::DraftModel | Kind::DraftFixed => Some(DraftWith::Model(draft_dir.clone())),
            _ => None,
        };
        EngineBuilder::new(store).ram_budget(Some(budget)).context(512).draft(draft).open()
    };
    let prompt = {
        let m = open(Kind::Plain)?;
        let tok = m.tokenizer();
        match text {
            Some(t) => tok.encode_ordinary(t),
            None => {
                tok.encode_ordinary(&format!("Repeat this passage word for word.\n\n{PASSAGE}\n\nRepeated:\n\n{PASSAGE}\n\nAgain:\n\n"))
            }
        }
    };
    // The reference ids (and the oracle's script) from one plain run first.
    let (plain_ids, _) = run_one(&open(Kind::Plain)?, Kind::Plain, &prompt, new, &[])?;
    let ratio = union_ratio(&open(Kind::Plain)?, &prompt, &plain_ids)?;
    eprintln!("spec {preset}: a 5-row verify routes {ratio:.2} of 5 single rows' expert bytes");
    // A trained pair's drafts can be right: also measure the draft model at a fixed length,
    // whatever the gate would choose, so its acceptance is on record.
    let kinds: Vec<Kind> = KINDS.iter().copied().chain(text.map(|_| Kind::DraftFixed)).collect();
    let mut results: Vec<SpecResult> = kinds
        .iter()
        .map(|&kind| SpecResult { kind, tok_s: vec![], ratio: vec![], bytes_per_token: vec![], last: Stats::default(), ids_equal: true })
        .collect();
    for round in 0..rounds {
        let mut plain_rate = None;
        for r in results.iter_mut() {
            let model = open(r.kind)?;
            let (ids, stats) = run_one(&model, r.kind, &prompt, new, &plain_ids)?;
            eprintln!(
                "spec round {round}: {:<34} {:.2} tok/s, {:.0} MB/token, {} verifies, {}/{} accepted",
                r.kind.label(),
                stats.decode_tok_s,
                stats.bytes_per_token / 1e6,
                stats.verifies,
                stats.accepted,
                stats.drafted
            );
            r.ids_equal &= ids == plain_ids;
            let rate = stats.decode_tok_s;
            let base = *plain_rate.get_or_insert(rate);
            r.tok_s.push(rate);
            r.ratio.push(rate / base);
            r.bytes_per_token.push(stats.bytes_per_token);
            r.last = stats;
        }
    }
    ensure!(results.iter().all(|r| r.ids_equal), "a drafter changed the output: speculation is broken");
    let median = |v: &[f64]| spread(v).1;
    let plain_bpt = median(&results[0].bytes_per_token);
    let mut md = format!(
        "### `{preset}`\n\n`cargo xtask bench {}{}` — `{preset}` store, RAM budget {:.1} GB, the disk uncapped. Routing overlap: a 5-row verify routes **{:.2}x** the expert bytes of 5 separate rows ({:.2} extra expert reads per extra row, against 1 row's; WARP measured 0.39 on real text). A {}-token prompt {}, {new} new tokens; {rounds} rounds, each running every configuration once on a freshly opened model (configurations round-robin); *vs plain* is tok/s over plain's in the same round. The live cost gate picks each step's draft length (up to 4, 0 included) unless noted. Every run's ids equal plain decoding's (checked). *Bytes bound* = plain MB/token over the configuration's MB/token: the speed-up if expert reads were all that mattered.\n\n| drafter | tok/s min / median / max | vs plain min / median / max | MB per emitted token | bytes bound | acceptance | tokens per verify | verifies (probes) | verify union MB | drafting s |\n|---|---|---|---|---|---|---|---|---|---|\n",
        if text.is_some() { "trained" } else { "spec" },
        if quick { " --quick" } else { "" },
        budget as f64 / 1e9,
        ratio,
        (5.0 * ratio - 1.0) / 4.0,
        prompt.len(),
        if text.is_some() { "of prose to continue" } else { "that asks to repeat a passage" },
    );
    // Megabytes to whole numbers at K3's expert size, to hundredths for small experts.
    let prec = if plain_bpt > 1e8 { 0 } else { 2 };
    for r in &results {
        let (a, b, c) = spread(&r.tok_s);
        let (ra, rb, rc) = spread(&r.ratio);
        let s = &r.last;
        let bpt = median(&r.bytes_per_token);
        writeln!(
            md,
            "| {} | {a:.2} / {b:.2} / {c:.2} | {ra:.3}x / {rb:.3}x / {rc:.3}x | {:.prec$} | {:.2}x | {} | {} | {} | {} | {:.3} |",
            r.kind.label(),
            bpt / 1e6,
            plain_bpt / bpt.max(1.0),
            if s.drafted > 0 { format!("{:.0}%", 100.0 * s.acceptance_rate()) } else { "-".into() },
            if s.verifies > 0 { format!("{:.2}", s.tokens_per_verify()) } else { "-".into() },
            if r.kind == Kind::Plain { "-".into() } else { format!("{} ({})", s.verifies, s.draft_probes) },
            if s.verifies > 0 { format!("{:.prec$}", s.verify_union_bytes_mean() / 1e6) } else { "-".into() },
            s.draft_s,
        )?;
    }
    md += "\nAcceptance, tokens per verify, verifies and drafting time are from the last round.\n";
    Ok(md)
}
