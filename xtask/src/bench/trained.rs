//! `cargo xtask bench trained`: the tiny trained K3 (`training/models`) beside a model of its
//! exact shape with random weights, so what a trained router changes is measured apart from
//! shape: routing skew, the expert cache and prefetch under budgets that hold a quarter and half
//! of the experts, expert-major prefill, and speculative decoding with the trained draft.
//!
//! Routing skew comes from the store's demand counts (one per route while decoding one token at
//! a time) over built-in prose and technical text the models were not trained on.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{ensure, Result};
use deltafin_sched::{EngineBuilder, GenerateOptions, LoadedModel, LogitRows, Stats};

use super::engine_runs::spread;

/// Text for the skew measurement: written for this bench (in neither corpus), one prose and one
/// technical passage, so both of the corpus's domains route.
const PROSE: &str = "The rain had stopped by the time the carriage reached the village, and the children ran out \
to meet it. Their mother stood in the doorway with a lamp in her hand, and she called to them to come in before \
the supper grew cold. The old man climbed down slowly, for his legs were stiff from the long road, and he looked \
about him at the wet fields and the dark line of the hills as if he had never seen them before. \"It is good to be \
home,\" he said at last, and his daughter took his arm and led him to the fire.";
const TECH: &str = "To build the module, run make in the source directory and then load it with modprobe. The \
driver registers a character device and allocates its buffers when the device is opened; the buffers are freed on \
release. If the allocation fails, open returns -ENOMEM and the caller should retry later. In Python, the same \
interface is available through the fcntl module: call ioctl() with the request number and a bytes object, and \
check the return value for errors before reading the result.";
/// The decode and speculation prompt: prose to continue.
const PROMPT: &str = "It was a bright cold morning, and";

/// Budgets above the model's minimum (spine resident, context 512) that leave the expert cache
/// about a quarter and a half of the 8.4 MB of experts.
const BUDGETS: [(&str, u64); 2] = [("cache ~25% of experts", 61_000_000), ("cache ~50% of experts", 63_000_000)];

fn ensure_store(ckpt: &Path, store: &Path) -> Result<()> {
    if deltafin_store::Manifest::read(store).is_err() {
        deltafin_store::setup(&deltafin_store::SetupOptions::new(ckpt, store), &deltafin_store::NoProgress)?;
    }
    Ok(())
}

/// The trained store and the random twin's (same shape, same tokenizer, seeded weights).
fn stores() -> Result<[(&'static str, PathBuf, PathBuf); 2]> {
    let models = super::root().join("models");
    let trained_ckpt = crate::trained::models_dir().join("k3");
    let trained = models.join("trained-store");
    ensure_store(&trained_ckpt, &trained)?;
    let twin_ckpt = models.join("trained-random");
    if !twin_ckpt.join("config.json").exists() {
        let report: serde_json::Value = serde_json::from_slice(&std::fs::read(crate::trained::models_dir().join("k3-report.json"))?)?;
        let preset = crate::trained::trained_preset(&report["shape"])?;
        let ranks = std::fs::read_to_string(crate::trained::tokenizer_dir().join("tiktoken.model"))?;
        crate::gen_k3::write_release(&preset, crate::gen_k3::Values::Seeded(0), &ranks, &twin_ckpt)?;
    }
    let twin = models.join("trained-random-store");
    ensure_store(&twin_ckpt, &twin)?;
    Ok([("trained", trained_ckpt, trained), ("random, same shape", twin_ckpt, twin)])
}

/// Per MoE layer, the share of routes the hottest 10% and 30% of its experts took, decoding
/// `text` one token at a time.
fn skew(model: &LoadedModel, text: &str) -> Result<Vec<(usize, f64, f64)>> {
    let ids = model.tokenizer().encode_ordinary(text);
    let mut seq = model.new_sequence();
    model.engine().experts().take_heat();
    for &id in &ids {
        model.engine().forward(&mut seq, &[id], LogitRows::Last)?;
    }
    let mut by_layer: HashMap<usize, Vec<u64>> = HashMap::new();
    for ((layer, _), n) in model.engine().experts().take_heat() {
        by_layer.entry(layer).or_default().push(n);
    }
    let experts = model.engine().model().config().num_experts;
    let mut out: Vec<(usize, f64, f64)> = by_layer
        .into_iter()
        .map(|(layer, mut counts)| {
            counts.sort_unstable_by(|a, b| b.cmp(a));
            let total: u64 = counts.iter().sum();
            let top = |share: f64| counts.iter().take((experts as f64 * share).round() as usize).sum::<u64>() as f64 / total as f64;
            (layer, top(0.1), top(0.3))
        })
        .collect();
    out.sort_by_key(|r| r.0);
    Ok(out)
}

fn decode(store: &Path, budget: u64, new: usize) -> Result<(Vec<u32>, Stats)> {
    let model = EngineBuilder::new(store).ram_budget(Some(budget)).context(512).open()?;
    let prompt = model.tokenizer().encode_ordinary(PROMPT);
    let mut seq = model.new_sequence();
    let mut ids = Vec::new();
    let stats = model.engine().generate(&mut seq, &prompt, &GenerateOptions::new(new), |id| {
        ids.push(id);
        true
    })?;
    Ok((ids, stats))
}

/// The prefill's stats and the bytes of all the model's experts.
fn prefill(store: &Path, budget: u64, tokens: usize) -> Result<(Stats, f64)> {
    let model = EngineBuilder::new(store).ram_budget(Some(budget)).context(512).open()?;
    let text = format!("{PROSE}\n\n{TECH}\n\n{PROSE}\n\n{TECH}");
    let mut prompt = model.tokenizer().encode_ordinary(&text);
    prompt.truncate(tokens);
    let mut seq = model.new_sequence();
    let stats = model.engine().generate(&mut seq, &prompt, &GenerateOptions::new(1), |_| true)?;
    let cfg = &model.engine().model().config();
    Ok((stats, (cfg.moe_layers().len() * cfg.num_experts) as f64 * model.engine().experts().expert_bytes() as f64))
}

pub fn run(quick: bool) -> Result<String> {
    let stores = stores()?;
    let (new, rounds) = if quick { (32, 2) } else { (128, 3) };
    let q = if quick { " --quick" } else { "" };
    let mut md = format!(
        "## The tiny trained K3\n\n`cargo xtask bench trained{q}` — the trained model of `training/models` (6 layers, 32 experts of 52 KB per MoE layer, top-4) beside a model of exactly its shape and tokenizer with random weights (`gen-k3`'s draws), both as stores on this disk.\n\n### Routing skew\n\nShare of routes taken by the hottest 10% (3) and 30% (10) of each MoE layer's 32 experts, decoding built-in text the models never saw one token at a time. The random model is the baseline at this sample size: about 120 tokens x 4 routes over 32 experts put ~19% / ~51% on the hottest by chance (over endless text a uniform router gives 10% / 30%).\n\n| model | text | tokens | hottest 10%: per layer 1..5 | mean | hottest 30%: per layer | mean |\n|---|---|---|---|---|---|---|\n"
    );
    for (label, _, store) in &stores {
        let model = EngineBuilder::new(store).context(1024).open()?;
        for (name, text) in [("prose", PROSE), ("technical", TECH)] {
            let s = skew(&model, text)?;
            let n = s.len() as f64;
            let list =
                |f: &dyn Fn(&(usize, f64, f64)) -> f64| s.iter().map(|r| format!("{:.0}%", 100.0 * f(r))).collect::<Vec<_>>().join(" ");
            writeln!(
                md,
                "| {label} | {name} | {} | {} | {:.0}% | {} | {:.0}% |",
                model.tokenizer().encode_ordinary(text).len(),
                list(&|r| r.1),
                100.0 * s.iter().map(|r| r.1).sum::<f64>() / n,
                list(&|r| r.2),
                100.0 * s.iter().map(|r| r.2).sum::<f64>() / n
            )?;
        }
    }

    // Decode: every (model, budget) once per round, round-robin.
    let mut rows: Vec<(String, Vec<f64>, Vec<Stats>)> = Vec::new();
    for (label, _, _) in &stores {
        for (b, _) in BUDGETS {
            rows.push((format!("{label}, {b}"), vec![], vec![]));
        }
    }
    for round in 0..rounds {
        let mut i = 0;
        for (label, _, store) in &stores {
            let mut first: Option<Vec<u32>> = None;
            for (_, budget) in BUDGETS {
                let (ids, stats) = decode(store, budget, new)?;
                eprintln!(
                    "trained round {round}: {label} at {budget}: {:.1} tok/s, hit rate {:.1}%",
                    stats.decode_tok_s,
                    100.0 * stats.cache_hit_rate
                );
                ensure!(first.get_or_insert_with(|| ids.clone()) == &ids, "{label}: the budget changed the output");
                rows[i].1.push(stats.decode_tok_s);
                rows[i].2.push(stats);
                i += 1;
            }
        }
    }
    write!(
        md,
        "\n### Expert cache and prefetch\n\nDecoding {new} tokens after `{PROMPT}` (greedy), RAM budget with the spine resident and the expert cache holding about a quarter or a half of the experts, context 512; {rounds} rounds, configurations round-robin, each on a freshly opened model. Ids equal across budgets (checked). Counters from the last round. At this size compute dominates (a step is well under a millisecond of reads), so tok/s says little; the hit rate and bytes per token are what a trained router changes. Prefetch is rarely issued here: the engine guesses the next layer's experts while the current layer's last read is in flight, and a 52 KB read is over before the guess.\n\n| model, budget | tok/s min / median / max | hit rate | MB read per token | prefetch used / issued | prefetch recall | read wait s |\n|---|---|---|---|---|---|---|\n"
    )?;
    for (label, tok_s, stats) in &rows {
        let (a, b, c) = spread(tok_s);
        let s = stats.last().expect("a round ran");
        writeln!(
            md,
            "| {label} | {a:.0} / {b:.0} / {c:.0} | {:.1}% | {:.2} | {} / {} | {:.0}% | {:.3} |",
            100.0 * s.cache_hit_rate,
            s.bytes_per_token / 1e6,
            s.prefetch_used,
            s.prefetch_issued,
            100.0 * s.prefetch_recall,
            s.read_wait_s
        )?;
    }

    md += "\n### Prefill\n\nA prompt of built-in prose and technical text, expert-major (each routed expert read once per layer), budget with the cache at ~25% of the experts. *Routed share* = distinct expert bytes the prompt routes over all experts' bytes: a trained router leaves more experts unrouted on short prompts.\n\n| model | prompt tokens | TTFT s | expert MB read | distinct MB routed | routed share |\n|---|---|---|---|---|---|\n";
    for (label, _, store) in &stores {
        for tokens in [16, 64, 256] {
            let (s, all_experts) = prefill(store, BUDGETS[0].1, tokens)?;
            writeln!(
                md,
                "| {label} | {} | {:.3} | {:.2} | {:.2} | {:.0}% |",
                s.prompt_tokens,
                s.ttft_s,
                s.expert_bytes_read_prefill as f64 / 1e6,
                s.expert_bytes_distinct_prefill as f64 / 1e6,
                100.0 * s.expert_bytes_distinct_prefill as f64 / all_experts
            )?;
        }
    }

    md += &placement(&stores, new)?;
    md += "\n### Speculative decoding with the trained draft\n\nThe trained Qwen3 draft (2 layers, 192 wide) on the trained K3, every drafter of `bench spec` plus the draft at a fixed 4 tokens a step (its acceptance whatever the gate would choose). One budget for all: the draft's 5 MB come out of the expert cache, so a drafted run's cache is about a quarter of the experts and plain's holds nearly all of them; that, more than verification, is the drafted runs' extra bytes per token at this size.\n\n";
    md += &super::spec::run_with(
        "trained",
        &stores[0].2,
        &crate::trained::models_dir().join("draft"),
        Some(PROMPT),
        BUDGETS[0].1 + 9_000_000,
        quick,
    )?;
    Ok(md)
}

/// Each placement over two equal homes: how evenly decoding's expert reads fall on the drives.
/// Whole-expert placements put a hot expert on one drive; stripes split every read.
fn placement(stores: &[(&'static str, PathBuf, PathBuf); 2], new: usize) -> Result<String> {
    use deltafin_store::{DriveFacts, Placement, SetupOptions};
    let models = super::root().join("models");
    let mut md = format!(
        "\n### Placement\n\nThe same decode ({new} tokens, cache ~25% of experts) from stores over two equal homes (folders on this disk, rates stated so none is probed), one per placement. *Busiest drive* = its share of the expert bytes read (50% is even); with whole experts a hot expert's reads all land on one drive. Stripes are page-aligned, so a 52 KB expert splits 28 KB / 24 KB (55%): at K3's 17.5 MB the split is even to a page.\n\n| model | placement | drive bytes MB | busiest drive | reads |\n|---|---|---|---|---|\n"
    );
    for (label, ckpt, _) in stores {
        for (name, p) in [("striped", Placement::Striped), ("weighted", Placement::Weighted), ("round-robin", Placement::RoundRobin)] {
            let dir = models.join(format!("trained-placement/{}-{name}", if *label == "trained" { "trained" } else { "random" }));
            let homes = vec![dir.join("home0"), dir.join("home1")];
            for h in &homes {
                std::fs::create_dir_all(h)?;
            }
            let out = dir.join("store");
            if deltafin_store::Manifest::read(&out).is_err() {
                let facts = vec![DriveFacts { capacity: None, rate: Some(1e9) }; 2];
                let opts = SetupOptions::new(ckpt, &out).homes(homes).placement(p).drives(facts).reinstall(true);
                deltafin_store::setup(&opts, &deltafin_store::NoProgress)?;
            }
            let (_, stats) = decode(&out, BUDGETS[0].1, new)?;
            let bytes: Vec<u64> = stats.per_drive.iter().map(|d| d.bytes).collect();
            let total: u64 = bytes.iter().sum();
            writeln!(
                md,
                "| {label} | {name} | {} | {:.0}% | {} |",
                bytes.iter().map(|b| format!("{:.1}", *b as f64 / 1e6)).collect::<Vec<_>>().join(" / "),
                100.0 * *bytes.iter().max().unwrap_or(&0) as f64 / total.max(1) as f64,
                stats.per_drive.iter().map(|d| d.reads.to_string()).collect::<Vec<_>>().join(" / ")
            )?;
        }
    }
    Ok(md)
}
