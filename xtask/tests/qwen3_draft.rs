//! The Qwen3 draft model against mlx-lm's independent `qwen3` at float32 (the committed logits in
//! `tests/fixtures/qwen3/`, made by `cargo xtask oracle --qwen3`), and the drafter around it:
//! which vocabulary path it takes, and that what it proposes are K3 ids.

use std::path::Path;
use std::sync::Arc;

use deltafin_core::{Cpu, Tokenizer, K3_PATTERN};
use deltafin_spec::{DraftModel, Drafter, ModelDrafter, Qwen3, Qwen3Config};
use deltafin_store::DraftCheckpoint;

fn load(dir: &Path) -> (Qwen3, Vec<u8>) {
    let ckpt = DraftCheckpoint::open(dir).unwrap();
    let cfg = Qwen3Config::from_json(ckpt.config_text()).unwrap();
    (Qwen3::load(cfg, &ckpt, Arc::new(Cpu::best())).unwrap(), ckpt.tokenizer_json().to_vec())
}

fn k3_tokenizer() -> Tokenizer {
    let dir = xtask::oracle::tiny_k3_fixture();
    let ranks = std::fs::read_to_string(dir.join("tiktoken.model")).unwrap();
    let config = std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap();
    Tokenizer::from_tiktoken(&ranks, Some(&config), K3_PATTERN).unwrap()
}

#[test]
fn qwen3_logits_match_mlx_lm_float32() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3");
    for (name, seed, k3_vocab) in xtask::oracle::QWEN3_DRAFTS {
        let want: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixtures.join(format!("{name}.json"))).unwrap()).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let fixture = xtask::oracle::tiny_k3_fixture();
        xtask::gen_qwen3::generate(seed, k3_vocab.then_some(fixture.as_path()), tmp.path()).unwrap();
        let (model, _) = load(tmp.path());
        let ids: Vec<u32> = want["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(ids, xtask::oracle::qwen3_ids(seed, if k3_vocab { 1000 } else { 151_643 }), "{name}: ids changed");
        let cols: Vec<usize> = want["cols"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
        // One token at a time (the cache path), and the whole prompt at once for the last row.
        let mut cache = model.new_cache();
        let mut last = Vec::new();
        for (r, &id) in ids.iter().enumerate() {
            let got = model.forward(&mut cache, &[id]).unwrap();
            let w: Vec<f32> = want["logits"][r].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
            let (mut num, mut den) = (0f64, 0f64);
            for (c, w) in cols.iter().zip(&w) {
                num += ((got[*c] - w) as f64).powi(2);
                den += (*w as f64).powi(2);
            }
            let rel = (num / den).sqrt();
            assert!(rel < 1e-4, "{name} row {r}: norm-relative error {rel:e} vs mlx-lm");
            assert_eq!(deltafin_core::argmax(&got), want["argmax"][r].as_u64().unwrap() as u32, "{name} row {r}: argmax");
            last = got;
        }
        let mut fresh = model.new_cache();
        let whole = model.forward(&mut fresh, &ids).unwrap();
        let rel = (whole.iter().zip(&last).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>()
            / last.iter().map(|b| (*b as f64).powi(2)).sum::<f64>())
        .sqrt();
        assert!(rel < 1e-5, "{name}: prompt-at-once vs token-by-token {rel:e}");
    }
}

#[test]
fn the_drafter_takes_k3_ids_directly_only_when_the_vocabularies_match() {
    let k3 = Arc::new(k3_tokenizer());
    let tmp = tempfile::tempdir().unwrap();
    let (own, shared) = (tmp.path().join("own"), tmp.path().join("shared"));
    xtask::gen_qwen3::generate(0, None, &own).unwrap();
    xtask::gen_qwen3::generate(1, Some(&xtask::oracle::tiny_k3_fixture()), &shared).unwrap();
    let context: Vec<u32> = k3.encode_ordinary("The drafts guess, and K3 verifies every token it keeps.");
    for (dir, direct) in [(&own, false), (&shared, true)] {
        let (model, tok) = load(dir);
        let draft = Arc::new(DraftModel::new(model, &tok, &k3).unwrap());
        assert_eq!(draft.is_direct(), direct, "{}", dir.display());
        let mut d = ModelDrafter::new(draft.clone(), k3.clone());
        let first = d.draft(&context, 4);
        assert!(!first.is_empty() && first.len() <= 4, "{first:?}");
        assert!(first.iter().all(|&t| (t as usize) < k3.bpe_len()), "only K3 ids are proposed: {first:?}");
        // Its cache follows the context: after a rejected draft and a longer context, it drafts
        // what a fresh drafter would.
        let mut longer = context.clone();
        longer.extend_from_slice(&k3.encode_ordinary(" Then"));
        let again = d.draft(&longer, 4);
        let fresh = ModelDrafter::new(draft, k3.clone()).draft(&longer, 4);
        assert_eq!(again, fresh, "{}: a reused cache drafts differently", dir.display());
    }
}

#[test]
fn k3s_vocabulary_as_tokenizer_json_encodes_like_k3() {
    let tmp = tempfile::tempdir().unwrap();
    xtask::gen_qwen3::generate(1, Some(&xtask::oracle::tiny_k3_fixture()), tmp.path()).unwrap();
    let hf = deltafin_core::HfTokenizer::from_json_bytes(&std::fs::read(tmp.path().join("tokenizer.json")).unwrap()).unwrap();
    let k3 = k3_tokenizer();
    for text in ["Hello world, it's 2026!", "  indented\n\tcode(x) -> y;", "naïve café 東京 123456"] {
        assert_eq!(hf.encode(text).unwrap(), k3.encode_ordinary(text), "{text:?}");
    }
}

#[test]
fn a_draft_model_never_changes_the_output_and_counts_in_the_ram_budget() {
    use deltafin_sched::{DraftWith, EngineBuilder, GenerateOptions, Generator, OnToken};
    std::env::set_var("DELTAFIN_QUIET", "1");
    let tmp = tempfile::tempdir().unwrap();
    let fixture = xtask::oracle::tiny_k3_fixture();
    let (own, shared) = (tmp.path().join("own"), tmp.path().join("shared"));
    xtask::gen_qwen3::generate(0, None, &own).unwrap();
    xtask::gen_qwen3::generate(1, Some(&fixture), &shared).unwrap();
    let k3 = k3_tokenizer();
    let prompt = k3.encode_ordinary("one two three one two three one two three");
    let run = |draft: Option<DraftWith>, gate: bool| {
        let model = EngineBuilder::new(&fixture).draft(draft).open().unwrap();
        let mut g = Generator::new(&model);
        let mut ids = Vec::new();
        let stats = g
            .generate(
                &prompt,
                &GenerateOptions::new(24).draft_max(3).draft_gate(gate),
                &mut OnToken(|s: deltafin_sched::Step<'_>| {
                    ids.push(s.id);
                    true
                }),
            )
            .unwrap();
        (ids, stats)
    };
    let (plain, _) = run(None, true);
    for dir in [&own, &shared] {
        for gate in [false, true] {
            let (ids, stats) = run(Some(DraftWith::Model(dir.clone())), gate);
            assert_eq!(ids, plain, "{} gate={gate}", dir.display());
            if !gate {
                assert!(stats.verifies > 0 && stats.drafted > 0, "fixed-length drafting verifies: {stats:?}");
            }
        }
    }
    // Inside a store's budget: the plan names the draft, and a budget without room for it says so.
    let store = tmp.path().join("store");
    deltafin_store::setup(&deltafin_store::SetupOptions::new(&fixture, &store), &deltafin_store::NoProgress).unwrap();
    let opened = EngineBuilder::new(&store).ram_budget(Some(64 << 20)).draft(Some(DraftWith::Model(own.clone()))).open().unwrap();
    let plan = opened.memory_plan().unwrap().clone();
    assert!(plan.draft >= 19_000_000, "the draft's weights count: {plan:?}");
    let without = EngineBuilder::new(&store).ram_budget(Some(64 << 20)).open().unwrap();
    assert_eq!(without.memory_plan().unwrap().experts, plan.experts + plan.draft);
    // The least budget that runs without the draft is too small with it.
    let least = EngineBuilder::new(&store).ram_budget(Some(1)).open().err().unwrap().to_string();
    let least: u64 = least.split("needs at least ").nth(1).and_then(|r| r.split(' ').next()).and_then(|n| n.parse().ok()).unwrap();
    EngineBuilder::new(&store).ram_budget(Some(least)).open().unwrap();
    let err = EngineBuilder::new(&store).ram_budget(Some(least)).draft(Some(DraftWith::Model(own))).open().err().unwrap();
    assert!(err.to_string().contains("draft model"), "{err}");
    // A folder that is not a draft model is refused with what to do.
    let err = EngineBuilder::new(&fixture).draft(Some(DraftWith::Model(tmp.path().join("nothing")))).open().err().unwrap();
    assert!(err.to_string().contains("--draft ngram"), "{err}");
}
