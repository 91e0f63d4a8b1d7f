//! Kimi K3.1 (issue 52): the sparse-attention indexer on generated K3.1 checkpoints.
//!
//! - Against an independent float64 reference (`xtask/oracle/k31_reference.py`, committed output
//!   in `tests/fixtures/k31/`): logits, and the keys each query attends to once the context passes
//!   `index_topk`, equal except where the reference's own scores nearly tie at the cut.
//! - `--indexer fp8` against the reference's transcription of vLLM's rounding: E4M3 values and
//!   scales bit for bit, selected keys except near ties.
//! - Up to `index_topk` tokens, K3.1 is K3 with dense MLA, bit for bit (either rounding).
//! - Beyond it, prefill, chunked prefill, decode, drafted and batched runs agree bit for bit.

use std::path::Path;

use deltafin_core::{index_score, prepare_index_query, round_index_key, top_keys, Cpu, IndexerRounding};
use deltafin_sched::{BatchEvent, BatchJob, Batcher, EngineBuilder, GenerateOptions, LoadedModel, LogitRows, Sequence};
use deltafin_spec::{FlakyDrafter, NgramDrafter};

fn fixtures() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/k31")
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn u32s(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn f32s(v: &serde_json::Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| f32::from_bits(x.as_u64().unwrap() as u32)).collect()
}

fn gen(preset: &str, seed: u64) -> tempfile::TempDir {
    std::env::set_var("DELTAFIN_QUIET", "1");
    let dir = tempfile::tempdir().unwrap();
    xtask::gen_k3::generate(preset, seed, dir.path()).unwrap();
    dir
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Whether two position sets are equal once positions whose reference score lies within `tol`
/// of the cut are set aside (they may fall either side of it in F32).
fn same_keys_but_near_ties(got: &[u32], want: &[u32], margin: f64, tol: f64) -> bool {
    got == want || margin.abs() <= tol
}

#[test]
fn logits_and_attended_keys_match_the_float64_reference() {
    let r = json(&fixtures().join("reference.json"));
    let dir = gen("k31-ref", 7);
    assert_eq!(json(&dir.path().join("config.json")), r["config"], "the generator no longer writes the reference's model");
    let ids = u32s(&r["ids"]);
    let model = EngineBuilder::new(dir.path()).open().unwrap();
    let mut seq = model.new_sequence();
    seq.trace_attended_keys();
    let (got, _) = model.engine().forward(&mut seq, &ids, LogitRows::All).unwrap();
    let bytes = std::fs::read(fixtures().join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let want: Vec<f32> =
        st.tensor("logits").unwrap().data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    assert_eq!(got.data.len(), want.len());
    let num: f64 = got.data.iter().zip(&want).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    let rel = (num / den).sqrt();
    eprintln!("K3.1 logits vs the float64 reference: norm-relative error {rel:.2e}");
    assert!(rel < 1e-5, "norm-relative error {rel:e} vs the float64 reference");
    // The keys: every layer's every query, equal except at near ties.
    let topk = r["config"]["text_config"]["dsa_config"]["index_topk"].as_u64().unwrap() as usize;
    let traced = seq.attended_keys();
    let (mut sparse, mut skipped) = (0, 0);
    for (l, (layer, want)) in traced.iter().zip(r["selections"].as_array().unwrap()).enumerate() {
        let want = want.as_array().unwrap();
        assert_eq!(layer.len(), ids.len(), "layer {l}: one trace entry per query");
        for (t, (got, want)) in layer.iter().zip(want).enumerate() {
            let want = u32s(want);
            let margin = r["margins"][l][t].as_f64().unwrap();
            assert_eq!(got.len(), (t + 1).min(topk), "layer {l} query {t}: attends to min(t + 1, topk) keys");
            if t + 1 > topk {
                sparse += 1;
            }
            if got != &want {
                assert!(
                    same_keys_but_near_ties(got, &want, margin, 1e-5),
                    "layer {l} query {t}: keys {got:?}, the reference's {want:?} (gap at the cut {margin:e})"
                );
                skipped += 1;
            }
        }
    }
    assert!(sparse >= 100, "the reference exercises sparse attention: {sparse} sparse queries");
    eprintln!("{sparse} sparse queries, {skipped} differing at a near tie");
    assert!(skipped <= 2, "{skipped} queries differ at near ties: too many to be ties");
}

#[test]
fn fp8_rounding_matches_the_transcription_of_vllm() {
    let v = json(&fixtures().join("fp8_vectors.json"));
    let be = Cpu::best();
    for (i, case) in v["cases"].as_array().unwrap().iter().enumerate() {
        let (heads, dim, topk) = (
            case["heads"].as_u64().unwrap() as usize,
            case["head_dim"].as_u64().unwrap() as usize,
            case["topk"].as_u64().unwrap() as usize,
        );
        let mut q = f32s(&case["q"]);
        let mut w = f32s(&case["weights_proj"]);
        assert_eq!((q.len(), w.len()), (heads * dim, heads));
        prepare_index_query(IndexerRounding::Fp8, dim, &mut q, &mut w);
        let eq = |a: &[f32], b: &[f32]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y);
        assert!(eq(&q, &f32s(&case["q_e4m3"])), "case {i}: the query's E4M3 values differ");
        assert!(eq(&w, &f32s(&case["head_weights"])), "case {i}: the head weights (query scales folded in) differ");
        let keys = f32s(&case["keys"]);
        let (want_k, want_s) = (f32s(&case["k_e4m3"]), f32s(&case["k_scales"]));
        let n = keys.len() / dim;
        let mut cached = Vec::new();
        let mut scales = Vec::new();
        for s in 0..n {
            let mut k = keys[s * dim..(s + 1) * dim].to_vec();
            scales.push(round_index_key(IndexerRounding::Fp8, &mut k).unwrap());
            assert!(eq(&k, &want_k[s * dim..(s + 1) * dim]), "case {i}: key {s}'s E4M3 values differ");
            cached.push(k);
        }
        assert!(eq(&scales, &want_s), "case {i}: the key scales differ");
        let mut relu = vec![0f32; heads];
        let scores: Vec<f32> = (0..n).map(|s| index_score(&be, dim, &q, &w, &cached[s], Some(scales[s]), &mut relu)).collect();
        let got = top_keys(&scores, topk);
        let want = u32s(&case["selected"]);
        let margin = case["margin"].as_f64().unwrap();
        assert!(same_keys_but_near_ties(&got, &want, margin, 1e-6), "case {i}: selected {got:?}, the transcription {want:?}");
        // Without the rounding the choice is another one: the test can tell the modes apart.
        let mut qf = f32s(&case["q"]);
        let mut wf = f32s(&case["weights_proj"]);
        prepare_index_query(IndexerRounding::F32, dim, &mut qf, &mut wf);
        assert!(qf != q, "case {i}: f32 mode leaves the query as it is");
    }
}

/// `dir`'s checkpoint with its config turned into K3's (no indexer); the shards are linked.
fn as_k3(dir: &Path) -> tempfile::TempDir {
    let out = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        if e.file_name() != "config.json" {
            std::os::unix::fs::symlink(e.path(), out.path().join(e.file_name())).unwrap();
        }
    }
    let mut cfg = json(&dir.join("config.json"));
    cfg["model_type"] = "kimi_k3".into();
    cfg["architectures"] = serde_json::json!(["KimiK3ForConditionalGeneration"]);
    cfg["text_config"].as_object_mut().unwrap().remove("dsa_config");
    std::fs::write(out.path().join("config.json"), cfg.to_string()).unwrap();
    out
}

fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 131 + seed * 17 + 3) % 2000).collect()
}

fn open(dir: &Path, rounding: IndexerRounding) -> LoadedModel {
    EngineBuilder::new(dir).indexer(rounding).max_sequences(3).open().unwrap()
}

fn all_logits(model: &LoadedModel, ids: &[u32]) -> Vec<u32> {
    let mut seq = model.new_sequence();
    bits(&model.engine().forward(&mut seq, ids, LogitRows::All).unwrap().0.data)
}

#[test]
fn up_to_topk_tokens_k31_is_k3_with_dense_attention_bit_for_bit() {
    let dir = gen("k31-tiny", 3);
    let k3 = EngineBuilder::new(as_k3(dir.path()).path()).open().unwrap();
    let ids = prompt(16, 1); // index_topk of k31-tiny
    let dense = all_logits(&k3, &ids);
    for rounding in [IndexerRounding::F32, IndexerRounding::Fp8] {
        let k31 = open(dir.path(), rounding);
        assert_eq!(k31.engine().model().config().indexer.as_ref().unwrap().topk, 16);
        assert!(all_logits(&k31, &ids) == dense, "{rounding:?}: K3.1 within index_topk differs from dense K3");
        // One token more and the indexer chooses: the logits of that row part from K3's.
        let longer = prompt(40, 1);
        let (a, b) = (all_logits(&k31, &longer), all_logits(&k3, &longer));
        let row = a.len() / 40;
        assert!(a[..16 * row] == b[..16 * row], "{rounding:?}: the rows that see at most 16 keys agree");
        assert!(a[39 * row..] != b[39 * row..], "{rounding:?}: with 40 keys and 16 kept, attention is sparse");
    }
    let err = EngineBuilder::new(as_k3(dir.path()).path()).indexer(IndexerRounding::Fp8).open().err().expect("fp8 needs an indexer");
    assert!(err.to_string().contains("kimi_k31"), "{err}");
}

fn generate(model: &LoadedModel, ids: &[u32], n: usize, drafter: Option<&mut dyn deltafin_spec::Drafter>) -> (Vec<u32>, Sequence) {
    let mut out = Vec::new();
    let mut seq = model.new_sequence();
    let opts = GenerateOptions::new(n).draft_max(if drafter.is_some() { 4 } else { 0 }).draft_gate(false);
    let on = |s: deltafin_sched::Step<'_>| {
        out.push(s.id);
        true
    };
    match drafter {
        Some(d) => model.engine().generate_drafted(&mut seq, ids, &opts, d, on).unwrap(),
        None => model.engine().generate_with(&mut seq, ids, &opts, on).unwrap(),
    };
    (out, seq)
}

#[test]
fn beyond_topk_prefill_chunks_decode_drafts_and_batches_agree_bit_for_bit() {
    let dir = gen("k31-tiny", 5);
    for rounding in [IndexerRounding::F32, IndexerRounding::Fp8] {
        let model = open(dir.path(), rounding);
        let ids = prompt(37, 2);
        let whole = all_logits(&model, &ids);
        // Chunked prompts, and token-by-token decode, give the same rows.
        for chunk in [1usize, 7] {
            let chunked = EngineBuilder::new(dir.path()).indexer(rounding).prefill_chunk(Some(chunk)).open().unwrap();
            assert!(all_logits(&chunked, &ids) == whole, "{rounding:?}: chunks of {chunk} differ from one pass");
        }
        // Plain generation crosses topk several times over; drafts (kept and cut back) do not
        // change it, nor does the state they leave.
        let (plain, plain_seq) = generate(&model, &ids[..10], 30, None);
        let script = [ids[..10].to_vec(), plain.clone()].concat();
        let mut flaky = FlakyDrafter::new(script, 2000, 3);
        let (drafted, drafted_seq) = generate(&model, &ids[..10], 30, Some(&mut flaky));
        assert_eq!(drafted, plain, "{rounding:?}: drafted ids differ from plain decoding");
        assert!(drafted_seq.layer_states() == plain_seq.layer_states(), "{rounding:?}: drafted state differs");
        let (ngram, _) = generate(&model, &ids[..10], 30, Some(&mut NgramDrafter::default()));
        assert_eq!(ngram, plain, "{rounding:?}: prompt-lookup drafts changed the ids");
        // In a lockstep batch, beside other sequences, each job's ids are its solo ones.
        let jobs = [(ids.clone(), 12), (ids[..10].to_vec(), 30), (prompt(21, 9), 20)];
        let mut batcher = Batcher::new(&model, 3);
        for (p, n) in &jobs {
            batcher.submit(BatchJob::new(p.clone(), GenerateOptions::new(*n)));
        }
        let mut got: Vec<Vec<u32>> = vec![Vec::new(); jobs.len()];
        batcher.run(&mut |e: BatchEvent<'_>| {
            if let BatchEvent::Token { job, step } = e {
                got[job as usize].push(step.id);
            }
            true
        });
        for (i, (p, n)) in jobs.iter().enumerate() {
            assert_eq!(got[i], generate(&model, p, *n, None).0, "{rounding:?}: job {i} in a batch differs from its solo run");
        }
        assert!(batcher.stats().sequences_per_step() > 1.5, "the jobs shared steps");
    }
}

#[test]
fn the_indexer_keys_are_charged_to_the_sequence_state() {
    let dir = gen("k31-tiny", 3);
    let k31 = open(dir.path(), IndexerRounding::F32);
    let k3 = EngineBuilder::new(as_k3(dir.path()).path()).open().unwrap();
    let (c31, c3) = (k31.engine().model().config(), k3.engine().model().config());
    let mla = c31.attention.iter().filter(|a| **a == deltafin_core::AttentionKind::Mla).count();
    let per_token = 4 * c31.indexer.as_ref().unwrap().head_dim;
    assert_eq!(Sequence::max_bytes(c31, 1000) - Sequence::max_bytes(c3, 1000), mla * 1000 * per_token);
    // The state really holds them: after 30 tokens, K3.1's sequence is that much bigger.
    let (mut a, mut b) = (k31.new_sequence(), k3.new_sequence());
    k31.engine().forward(&mut a, &prompt(30, 4), LogitRows::Last).unwrap();
    k3.engine().forward(&mut b, &prompt(30, 4), LogitRows::Last).unwrap();
    assert_eq!(a.bytes(c31) - b.bytes(c3), mla * 30 * per_token);
}

/// The ids of `n` tokens after `ids` on `model` under `budget`, and the spine layers streamed.
fn budget_ids(model: &Path, budget: Option<u64>, ids: &[u32], n: usize) -> Result<(Vec<u32>, usize), String> {
    let m = EngineBuilder::new(model).ram_budget(budget).context(128).open().map_err(|e| e.to_string())?;
    let streamed = m.memory_plan().map_or(0, |p| p.streamed_layers);
    let mut seq = m.new_sequence();
    let mut out = Vec::new();
    m.engine()
        .generate(&mut seq, ids, &GenerateOptions::new(n), |t| {
            out.push(t);
            true
        })
        .map_err(|e| e.to_string())?;
    Ok((out, streamed))
}

#[test]
fn k31_runs_in_place_installed_streamed_from_a_hub_and_planned_with_its_checkpoints_ids() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = gen("k31-tiny", 11);
    let ids = prompt(30, 6); // past index_topk, so every path selects keys
    let (want, _) = budget_ids(dir.path(), None, &ids, 10).unwrap();
    // A store over two homes, then in place, at budgets down to the minimum (every spine layer,
    // the indexers' included, read and checked each pass).
    let store = tmp.path().join("store");
    deltafin_store::setup(&deltafin_store::SetupOptions::new(dir.path(), &store), &deltafin_store::NoProgress).unwrap();
    let err = budget_ids(&store, Some(1), &ids, 10).unwrap_err();
    let min: u64 = err
        .split("needs at least ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{err}"));
    for budget in [None, Some(64 << 20), Some(min)] {
        let (got, streamed) = budget_ids(&store, budget, &ids, 10).unwrap();
        assert_eq!(got, want, "store, budget {budget:?} ({streamed} layers streamed)");
        if budget == Some(min) {
            assert_eq!(streamed, 6, "at the minimum every layer streams");
        }
    }
    assert_eq!(budget_ids(dir.path(), Some(64 << 20), &ids, 10).unwrap().0, want, "in place");
    // Stream install from a hub: spine now, experts on first use.
    let hub = xtask::hub_emulator::HubEmulator::start(dir.path(), "moonshotai/Kimi-K3.1-Pro-tiny").unwrap();
    let streamed = tmp.path().join("streamed");
    let mut o = deltafin_store::StreamOptions::new("hf://moonshotai/Kimi-K3.1-Pro-tiny", &streamed);
    o.hub.endpoint = hub.endpoint.clone();
    o.hub.offline = false;
    deltafin_store::setup_stream(&o, &deltafin_store::NoProgress).unwrap();
    assert_eq!(budget_ids(&streamed, Some(64 << 20), &ids, 10).unwrap().0, want, "stream install");
    // `plan` reads the indexer's bytes as spine (against K3 of the same shape).
    let sizes = deltafin_sched::model_sizes(dir.path()).unwrap();
    let k3_sizes = deltafin_sched::model_sizes(gen("tiny", 11).path()).unwrap();
    let cfg = deltafin_store::Checkpoint::open(dir.path()).unwrap().config().clone();
    let ix = cfg.indexer.clone().unwrap();
    let mla = cfg.attention.iter().filter(|a| **a == deltafin_core::AttentionKind::Mla).count() as u64;
    let per_layer = 2
        * (ix.heads * ix.head_dim * cfg.q_lora_rank + ix.head_dim * cfg.hidden_size + ix.heads * cfg.hidden_size + 2 * ix.head_dim) as u64;
    assert_eq!(sizes.spine_bytes - k3_sizes.spine_bytes, mla * per_layer, "the indexers' weights are spine");
}
