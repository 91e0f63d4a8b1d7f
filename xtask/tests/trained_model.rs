//! The committed tiny trained K3 and its draft (`training/models`, issue 20) against the training
//! code's own forward pass: `training/train.py` ran the exported weights (BF16 spine, MXFP4
//! experts) in float32 on a held-out prompt and its greedy continuation and stored the logits.
//! The engine is a separate implementation of the same model, so this is the third independent
//! K3 reading the engine is checked against (the float64 fixture and mlx-lm are the others), and
//! mlx-lm's logits on the same checkpoints (`cargo xtask oracle --trained`) are checked against
//! both.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use deltafin_core::{argmax, Cpu};
use deltafin_sched::{EngineBuilder, GenerateOptions, LogitRows};
use deltafin_spec::{Qwen3, Qwen3Config};
use deltafin_store::DraftCheckpoint;

fn models() -> PathBuf {
    std::env::var_os("DELTAFIN_TRAINED_MODELS").map(PathBuf::from).unwrap_or_else(xtask::trained::models_dir)
}

/// `(logits [rows, vocab] row-major, rows, vocab, token ids)` the trainer stored for `model`.
fn reference(model: &str) -> (Vec<f32>, usize, usize, Vec<u32>) {
    let (logits, rows, vocab) = logits_file(&format!("{model}.safetensors"));
    let bytes = std::fs::read(models().join(format!("reference/{model}.safetensors"))).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids = st.tensor("token_ids").unwrap().data().chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap()) as u32).collect();
    (logits, rows, vocab, ids)
}

/// F32 `logits` of `reference/NAME`: (values, rows, vocab).
fn logits_file(name: &str) -> (Vec<f32>, usize, usize) {
    let bytes = std::fs::read(models().join(format!("reference/{name}"))).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let l = st.tensor("logits").unwrap();
    let logits = l.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    (logits, l.shape()[0], l.shape()[1])
}

/// Worst row's norm-relative error of `got` against `want` (both `[rows, vocab]`), asserting
/// every row's argmax agrees.
fn worst_row(got: &[f32], want: &[f32], rows: usize, vocab: usize, what: &str) -> f64 {
    (0..rows)
        .map(|r| {
            let (rel, same) = compare(&got[r * vocab..(r + 1) * vocab], &want[r * vocab..(r + 1) * vocab]);
            assert!(same, "{what}: row {r}'s argmax differs");
            rel
        })
        .fold(0.0, f64::max)
}

/// Norm-relative error over a row, and whether its argmax agrees.
fn compare(got: &[f32], want: &[f32]) -> (f64, bool) {
    let num: f64 = got.iter().zip(want).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    ((num / den).sqrt(), argmax(got) == argmax(want))
}

#[test]
fn the_engine_matches_the_training_code_on_the_trained_k3() {
    let (want, rows, vocab, ids) = reference("k3");
    let model = EngineBuilder::new(models().join("k3")).open().unwrap();
    let mut seq = model.new_sequence();
    let (got, _) = model.engine().forward(&mut seq, &ids, LogitRows::All).unwrap();
    assert_eq!([got.rows, got.cols], [rows, vocab]);
    let worst = worst_row(&got.data, &want, rows, vocab, "engine vs training code");
    eprintln!("trained K3: worst row norm-relative error vs the training code {worst:.2e}");
    assert!(worst < 1e-4, "norm-relative error {worst:e} vs the training code");
    let (mlx, mrows, mvocab) = logits_file("k3-mlx.safetensors");
    assert_eq!([mrows, mvocab], [rows, vocab]);
    let vs_mlx = worst_row(&got.data, &mlx, rows, vocab, "engine vs mlx-lm");
    let code_vs_mlx = worst_row(&want, &mlx, rows, vocab, "training code vs mlx-lm");
    eprintln!("trained K3: engine vs mlx-lm {vs_mlx:.2e}, training code vs mlx-lm {code_vs_mlx:.2e}");
    assert!(vs_mlx < 1e-4 && code_vs_mlx < 1e-4, "mlx-lm disagrees: {vs_mlx:e} / {code_vs_mlx:e}");

    // The stored continuation is the training code's greedy one: the engine must produce it.
    let prompt = rows - 16;
    let mut seq = model.new_sequence();
    let mut out = Vec::new();
    model
        .engine()
        .generate(&mut seq, &ids[..prompt], &GenerateOptions::new(16), |id| {
            out.push(id);
            true
        })
        .unwrap();
    assert_eq!(out, ids[prompt..], "greedy tokens");
}

fn load_draft(dir: &Path) -> Qwen3 {
    let ckpt = DraftCheckpoint::open(dir).unwrap();
    Qwen3::load(Qwen3Config::from_json(ckpt.config_text()).unwrap(), &ckpt, Arc::new(Cpu::best())).unwrap()
}

#[test]
fn the_draft_matches_the_training_code() {
    let (want, rows, vocab, ids) = reference("draft");
    let model = load_draft(&models().join("draft"));
    let mut cache = model.new_cache();
    let mut worst = 0f64;
    for (r, &id) in ids.iter().enumerate() {
        let got = model.forward(&mut cache, &[id]).unwrap();
        assert_eq!(got.len(), vocab);
        let (rel, same) = compare(&got, &want[r * vocab..(r + 1) * vocab]);
        assert!(same, "row {r}: the draft's argmax differs from the training code's");
        worst = worst.max(rel);
    }
    assert_eq!(rows, ids.len());
    eprintln!("trained draft: worst row norm-relative error vs the training code {worst:.2e}");
    assert!(worst < 1e-4, "norm-relative error {worst:e} vs the training code");
    // mlx-lm's `qwen3` at a fixed set of columns, and its argmax over all of them.
    let mlx: serde_json::Value = serde_json::from_slice(&std::fs::read(models().join("reference/draft-mlx.json")).unwrap()).unwrap();
    let cols: Vec<usize> = mlx["cols"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    let mut cache = model.new_cache();
    for (r, &id) in ids.iter().enumerate() {
        let got = model.forward(&mut cache, &[id]).unwrap();
        let m: Vec<f32> = mlx["logits"][r].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        let picked: Vec<f32> = cols.iter().map(|&c| got[c]).collect();
        let (rel, _) = compare(&picked, &m);
        assert!(rel < 1e-4, "row {r}: norm-relative error {rel:e} vs mlx-lm");
        assert_eq!(argmax(&got), mlx["argmax"][r].as_u64().unwrap() as u32, "row {r}: argmax vs mlx-lm");
    }
}

#[test]
fn the_trained_models_are_small_enough_to_commit() {
    let size = |d: PathBuf| -> u64 { std::fs::read_dir(d).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum() };
    let total = size(models().join("k3")) + size(models().join("draft"));
    assert!(total < 34 << 20, "the trained pair is {total} bytes");
}
