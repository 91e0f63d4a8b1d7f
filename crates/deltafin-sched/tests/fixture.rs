//! The engine against `tiny-k3-dev`: reference logits from an independent float64
//! implementation, greedy ids, and exactness across schedules.

use std::path::PathBuf;

use deltafin_sched::{argmax, EngineBuilder, GenerateOptions, LogitRows};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-k3-dev")
}

fn reference() -> (serde_json::Value, Vec<f32>, Vec<usize>) {
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap()).unwrap();
    let bytes = std::fs::read(fixture().join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("logits").unwrap();
    let v = t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    (r, v, t.shape().to_vec())
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn logits_match_the_float64_reference() {
    let (r, want, shape) = reference();
    let model = EngineBuilder::new(fixture().join("checkpoint")).open().unwrap();
    let seq_ids = ids(&r["sequence_token_ids"]);
    let mut seq = model.new_sequence();
    let (got, _) = model.engine().forward(&mut seq, &seq_ids, LogitRows::All).unwrap();
    assert_eq!([got.rows, got.cols], [shape[0], shape[1]]);
    let (mut num, mut den, mut worst) = (0f64, 0f64, 0f64);
    for (a, b) in got.data.iter().zip(&want) {
        let (a, b) = (*a as f64, *b as f64);
        let excess = (a - b).abs() - (2e-3 + 1e-3 * b.abs());
        worst = worst.max(excess);
        num += (a - b).powi(2);
        den += b * b;
    }
    let rel = (num / den).sqrt();
    assert!(worst <= 0.0, "a logit is outside |a-b| <= 2e-3 + 1e-3|b| by {worst}");
    assert!(rel < 1e-4, "norm-relative error {rel}");
    for t in 0..got.rows {
        let w = &want[t * shape[1]..(t + 1) * shape[1]];
        assert_eq!(argmax(got.row(t)), argmax(w), "argmax differs at row {t}");
    }
    eprintln!("norm-relative logits error vs float64 reference: {rel:.3e}");
}

#[test]
fn greedy_generation_matches_reference_ids() {
    let (r, _, _) = reference();
    let model = EngineBuilder::new(fixture().join("checkpoint")).open().unwrap();
    let prompt = ids(&r["prompt_token_ids"]);
    let want = ids(&r["greedy_token_ids"]);
    let mut got = Vec::new();
    let mut seq = model.new_sequence();
    let opts = GenerateOptions::new(want.len());
    model
        .engine()
        .generate(&mut seq, &prompt, &opts, |id| {
            got.push(id);
            true
        })
        .unwrap();
    assert_eq!(got, want);
    assert_eq!(model.tokenizer().encode_ordinary(r["prompt_text"].as_str().unwrap()), prompt);
}

#[test]
fn prompt_forward_equals_token_by_token_decode_bitwise() {
    let (r, _, _) = reference();
    let seq_ids = ids(&r["sequence_token_ids"]);
    let model = EngineBuilder::new(fixture().join("checkpoint")).open().unwrap();
    let mut a = model.new_sequence();
    let (all, _) = model.engine().forward(&mut a, &seq_ids, LogitRows::All).unwrap();
    for chunk in [1usize, 5, 16] {
        let chunked = EngineBuilder::new(fixture().join("checkpoint")).prefill_chunk(Some(chunk)).prefetch(chunk != 5).open().unwrap();
        let mut b = chunked.new_sequence();
        let (l, _) = chunked.engine().forward(&mut b, &seq_ids, LogitRows::All).unwrap();
        assert!(l.data.iter().zip(&all.data).all(|(x, y)| x.to_bits() == y.to_bits()), "chunk {chunk} differs");
    }
    let mut c = model.new_sequence();
    for (t, id) in seq_ids.iter().enumerate() {
        let (l, _) = model.engine().forward(&mut c, &[*id], LogitRows::Last).unwrap();
        assert!(l.row(0).iter().zip(all.row(t)).all(|(x, y)| x.to_bits() == y.to_bits()), "decode row {t} differs from the prompt forward");
    }
}

#[test]
fn a_recorded_forward_rewinds_to_any_prefix_bit_exactly() {
    let (r, _, _) = reference();
    let seq_ids = ids(&r["sequence_token_ids"]);
    let (prompt, drafts) = seq_ids.split_at(20);
    let model = EngineBuilder::new(fixture().join("checkpoint")).open().unwrap();
    for keep in [0usize, 1, 5, drafts.len()] {
        // Verify-style: the drafts in one recorded pass, then keep a prefix.
        let mut a = model.new_sequence();
        model.engine().forward(&mut a, prompt, LogitRows::Last).unwrap();
        a.set_recording(true);
        model.engine().forward(&mut a, drafts, LogitRows::All).unwrap();
        model.engine().rewind(&mut a, prompt.len() + keep).unwrap();
        a.set_recording(false);
        // Reference: a sequence that only ever saw the kept tokens.
        let mut b = model.new_sequence();
        model.engine().forward(&mut b, &seq_ids[..prompt.len() + keep], LogitRows::Last).unwrap();
        assert_eq!(a.ids(), b.ids());
        // Continuing both gives the same bits.
        let next = seq_ids[prompt.len() + keep.min(drafts.len() - 1)];
        let (la, _) = model.engine().forward(&mut a, &[next], LogitRows::Last).unwrap();
        let (lb, _) = model.engine().forward(&mut b, &[next], LogitRows::Last).unwrap();
        assert!(la.data.iter().zip(&lb.data).all(|(x, y)| x.to_bits() == y.to_bits()), "keep {keep}: logits differ after rewind");
    }
    // Rewinding outside the latest pass is refused.
    let mut c = model.new_sequence();
    model.engine().forward(&mut c, prompt, LogitRows::Last).unwrap();
    model.engine().forward(&mut c, drafts, LogitRows::Last).unwrap();
    assert!(model.engine().rewind(&mut c, 3).is_err());
}
