//! `cargo xtask oracle`: reference logits for `--preset rand` models from mlx-lm's independent
//! `kimi_k3` at float32, committed under `tests/fixtures/mlx/` so CI needs no Python.
//!
//! Needs `pip install "mlx[cpu]" mlx-lm==0.32.2` (CPU only). The test
//! `xtask/tests/mlx_oracle.rs` regenerates each model from its seed and compares.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde_json::json;

/// Token ids for a seed: a spread over the BPE range, deterministic.
pub fn prompt_ids(seed: u64, n: usize, bpe: u64) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % bpe) as u32
        })
        .collect()
}

pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/mlx")
}

/// Generates each seed's model, runs the mlx-lm script and writes the fixture and manifest.
pub fn run(seeds: &[u64], tokens: usize) -> Result<()> {
    let dir = fixtures_dir();
    std::fs::create_dir_all(&dir)?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("oracle/mlx_k3_logits.py");
    let mut entries = Vec::new();
    for &seed in seeds {
        let tmp = std::env::temp_dir().join(format!("deltafin-oracle-{seed}"));
        crate::gen_k3::generate("rand", seed, &tmp)?;
        let ids = prompt_ids(seed, tokens, 1024);
        let out = dir.join(format!("rand-{seed}.safetensors"));
        let list = ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",");
        let status = Command::new("python3")
            .arg(&script)
            .arg(&tmp)
            .arg(&out)
            .arg(&list)
            .status()
            .context("running python3 (is mlx-lm installed?)")?;
        if !status.success() {
            bail!("the mlx-lm oracle failed for seed {seed}");
        }
        let config = std::fs::read_to_string(tmp.join("config.json"))?;
        entries.push(json!({"seed": seed, "ids": ids, "file": format!("rand-{seed}.safetensors"), "config": serde_json::from_str::<serde_json::Value>(&config)?}));
        std::fs::remove_dir_all(&tmp).ok();
    }
    let manifest = json!({
        "about": "float32 logits from mlx-lm 0.32.2 kimi_k3 (mlx[cpu]) for `cargo xtask gen-k3 --preset rand --seed N`; written by `cargo xtask oracle`",
        "models": entries
    });
    std::fs::write(dir.join("manifest.json"), serde_json::to_vec_pretty(&manifest)?)?;
    eprintln!("wrote {} fixtures to {}", seeds.len(), dir.display());
    Ok(())
}

/// The Qwen3 drafts the oracle checks: (fixture name, seed, share the tiny K3 fixture's vocabulary).
pub const QWEN3_DRAFTS: [(&str, u64, bool); 2] = [("qwen3-vocab", 0, false), ("k3-vocab", 1, true)];

/// The tiny K3 fixture whose vocabulary the `k3-vocab` draft shares.
pub fn tiny_k3_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-k3-dev/checkpoint")
}

/// Token ids the Qwen3 oracle runs: a spread over `vocab`, starting with a real word or two.
pub fn qwen3_ids(seed: u64, vocab: u64) -> Vec<u32> {
    prompt_ids(seed + 100, 10, vocab)
}

/// Writes `tests/fixtures/qwen3/NAME.json` for each of [`QWEN3_DRAFTS`] from mlx-lm's `qwen3`.
pub fn run_qwen3() -> Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3");
    std::fs::create_dir_all(&dir)?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("oracle/mlx_qwen3_logits.py");
    for (name, seed, k3_vocab) in QWEN3_DRAFTS {
        let tmp = std::env::temp_dir().join(format!("deltafin-oracle-{name}"));
        let fixture = tiny_k3_fixture();
        crate::gen_qwen3::generate(seed, k3_vocab.then_some(fixture.as_path()), &tmp)?;
        let ids = qwen3_ids(seed, if k3_vocab { 1000 } else { 151_643 });
        let list = ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",");
        let out = dir.join(format!("{name}.json"));
        let status = Command::new("python3")
            .arg(&script)
            .arg(&tmp)
            .arg(&list)
            .arg(&out)
            .status()
            .context("running python3 (is mlx-lm installed?)")?;
        if !status.success() {
            bail!("the mlx-lm qwen3 oracle failed for {name}");
        }
        std::fs::remove_dir_all(&tmp).ok();
    }
    eprintln!("wrote {} fixtures to {}", QWEN3_DRAFTS.len(), dir.display());
    Ok(())
}

/// mlx-lm's logits on the committed trained pair (`training/models`), over the token ids the
/// trainer's reference holds: `reference/k3-mlx.safetensors` and `reference/draft-mlx.json`.
pub fn run_trained() -> Result<()> {
    let models = crate::trained::models_dir();
    let ids = |model: &str| -> Result<String> {
        let bytes = std::fs::read(models.join(format!("reference/{model}.safetensors")))?;
        let st = safetensors::SafeTensors::deserialize(&bytes)?;
        let t = st.tensor("token_ids")?;
        Ok(t.data().chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")).to_string()).collect::<Vec<_>>().join(","))
    };
    let oracle = Path::new(env!("CARGO_MANIFEST_DIR")).join("oracle");
    let k3 = Command::new("python3")
        .arg(oracle.join("mlx_k3_logits.py"))
        .arg(models.join("k3"))
        .arg(models.join("reference/k3-mlx.safetensors"))
        .arg(ids("k3")?)
        .status()
        .context("running python3 (is mlx-lm installed?)")?;
    let draft = Command::new("python3")
        .arg(oracle.join("mlx_qwen3_logits.py"))
        .arg(models.join("draft"))
        .arg(ids("draft")?)
        .arg(models.join("reference/draft-mlx.json"))
        .status()
        .context("running python3 (is mlx-lm installed?)")?;
    if !k3.success() || !draft.success() {
        bail!("the mlx-lm oracle failed on the trained models");
    }
    Ok(())
}
