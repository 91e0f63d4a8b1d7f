//! The tiny trained K3 and its draft (issue 20): the steps around `training/train.py`.
//!
//! `cargo xtask tokenize-corpus` turns the corpus (`training/corpus.sh`) into the uint16 token
//! files the trainer reads, through the engine's own tokenizer on the committed
//! `training/tokenizer`, so training and inference split text identically.
//! `cargo xtask export-trained` writes what the trainer produced in the release layouts: the K3
//! in exactly `moonshotai/Kimi-K3`'s (the same writer as `gen-k3`, every trained tensor checked
//! against the layout's name, dtype and shape) and the draft in Hugging Face's Qwen3 layout with
//! the K3 vocabulary; the trainer's reference logits and reports go beside them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use deltafin_core::{Tokenizer, K3_PATTERN};
use rayon::prelude::*;
use serde_json::Value;

use crate::gen_k3::{write_release, Preset, Values};
use crate::gen_qwen3::{write_draft, Shape, Trained};

/// The committed tokenizer of the trained model.
pub fn tokenizer_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../training/tokenizer")
}

/// The committed trained models (`training/models`).
pub fn models_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../training/models")
}

fn load_tokenizer() -> Result<Tokenizer> {
    let dir = tokenizer_dir();
    let ranks = std::fs::read_to_string(dir.join("tiktoken.model")).with_context(|| format!("reading {}/tiktoken.model", dir.display()))?;
    let cfg = std::fs::read_to_string(dir.join("tokenizer_config.json"))?;
    Ok(Tokenizer::from_tiktoken(&ranks, Some(&cfg), K3_PATTERN)?)
}

/// Tokenizes `corpus/{lit,tech}.txt` into `out/{lit,tech}.bin` (little-endian uint16 ids).
pub fn tokenize_corpus(corpus: &Path, out: &Path) -> Result<()> {
    let tok = load_tokenizer()?;
    if tok.vocab_len() > u16::MAX as usize + 1 {
        bail!("{} ids do not fit in uint16", tok.vocab_len());
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    for name in ["lit", "tech"] {
        let path = corpus.join(format!("{name}.txt"));
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}: build the corpus first with training/corpus.sh", path.display()))?;
        // Lines are independent under K3's pattern except for the newline runs between them;
        // cutting after a newline that is followed by a non-space keeps every split as in one pass.
        let chunks = split_at_lines(&text, 1 << 20);
        let ids: Vec<Vec<u32>> = chunks.par_iter().map(|c| tok.encode_ordinary(c)).collect();
        let mut bytes = Vec::with_capacity(text.len() / 2);
        for id in ids.iter().flatten() {
            bytes.extend_from_slice(&(*id as u16).to_le_bytes());
        }
        crate::gen_k3::write_atomic(&out.join(format!("{name}.bin")), &bytes)?;
        eprintln!(
            "{name}: {} bytes -> {} tokens ({:.2} bytes per token)",
            text.len(),
            bytes.len() / 2,
            text.len() as f64 / (bytes.len() / 2) as f64
        );
    }
    Ok(())
}

/// Cuts `text` into pieces of about `size` bytes, each ending after a newline whose next
/// character is a letter (so no whitespace run or word straddles a cut).
fn split_at_lines(text: &str, size: usize) -> Vec<&str> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut start = 0;
    while start < b.len() {
        let mut end = (start + size).min(b.len());
        while end < b.len() && !(b[end - 1] == b'\n' && b[end].is_ascii_alphabetic()) {
            end += 1;
        }
        out.push(&text[start..end]);
        start = end;
    }
    out
}

/// The tiny trained K3's shape, as `training/train.py` reports it (`shape`).
pub fn trained_preset(shape: &Value) -> Result<Preset> {
    let n = |k: &str| shape[k].as_u64().map(|v| v as usize).with_context(|| format!("the trained shape lacks {k}"));
    let mla_layers = shape["mla_layers"]
        .as_array()
        .context("the trained shape lacks mla_layers")?
        .iter()
        .map(|v| v.as_u64().map(|v| v as usize).context("mla_layers holds a non-number"))
        .collect::<Result<Vec<_>>>()?;
    Ok(Preset {
        name: "trained",
        hidden: n("hidden")?,
        layers: n("layers")?,
        mla_layers,
        block: n("block")?,
        kda_heads: n("kda_heads")?,
        kda_dim: n("kda_dim")?,
        mla_heads: n("mla_heads")?,
        q_lora: n("q_lora")?,
        kv_lora: n("kv_lora")?,
        nope: n("nope")?,
        rope: n("rope")?,
        v_dim: n("v_dim")?,
        experts: n("experts")?,
        top_k: n("top_k")?,
        shared: n("shared")?,
        moe_inter: n("moe_inter")?,
        latent: n("latent")?,
        dense_inter: n("dense_inter")?,
        bpe_ranks: n("bpe_ranks")?,
        // Several shards, so a layer's experts span two of them as in the release.
        shard_bytes: 6 << 20,
        first_dense: 1,
        indexer: None,
    })
}

/// Every tensor of the safetensors files `paths`, by name: `(dtype, shape, bytes)`.
fn read_tensors(paths: &[PathBuf]) -> Result<Trained> {
    let mut out = HashMap::new();
    for path in paths {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let st = safetensors::SafeTensors::deserialize(&bytes).with_context(|| format!("{} is not a safetensors file", path.display()))?;
        for (name, view) in st.tensors() {
            let dtype = format!("{:?}", view.dtype());
            out.insert(name, (dtype, view.shape().to_vec(), view.data().to_vec()));
        }
    }
    Ok(out)
}

fn parts(from: &Path, model: &str) -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(from)
        .with_context(|| format!("reading {}", from.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let n = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            n.starts_with(&format!("{model}-")) && n.ends_with(".safetensors") && !n.contains("reference")
        })
        .collect();
    v.sort();
    if v.is_empty() {
        bail!("{} holds no {model}-NN.safetensors: run training/train.py --model {model} --out {} first", from.display(), from.display());
    }
    Ok(v)
}

fn report(from: &Path, model: &str) -> Result<Value> {
    let path = from.join(format!("{model}-report.json"));
    serde_json::from_slice(&std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?)
        .with_context(|| format!("parsing {}", path.display()))
}

/// Writes the trainer's output in `from` as `out/k3` (release layout), `out/draft` (Qwen3
/// layout, K3's vocabulary), `out/reference/{k3,draft}.safetensors` and `out/{k3,draft}-report.json`.
pub fn export(from: &Path, out: &Path) -> Result<()> {
    let k3_report = report(from, "k3")?;
    let preset = trained_preset(&k3_report["shape"])?;
    let trained = read_tensors(&parts(from, "k3")?)?;
    let expected = crate::gen_k3::tensor_names(&preset);
    if let Some(extra) = trained.keys().find(|n| !expected.contains(n)) {
        bail!("the trained K3 has {extra}, which the release layout does not");
    }
    let ranks = std::fs::read_to_string(tokenizer_dir().join("tiktoken.model"))?;
    if ranks.lines().count() != preset.bpe_ranks {
        bail!("the model was trained on {} ranks; training/tokenizer has {}", preset.bpe_ranks, ranks.lines().count());
    }
    let k3_dir = out.join("k3");
    write_release(&preset, Values::Trained(&trained), &ranks, &k3_dir)?;
    // The trained tokenizer's own config (the same specials `write_release` derives).
    std::fs::copy(tokenizer_dir().join("tokenizer_config.json"), k3_dir.join("tokenizer_config.json"))?;

    let d = report(from, "draft")?;
    let n = |k: &str| d["shape"][k].as_u64().map(|v| v as usize).with_context(|| format!("the draft's shape lacks {k}"));
    let shape = Shape {
        hidden: n("hidden")?,
        layers: n("layers")?,
        heads: n("heads")?,
        kv_heads: n("kv_heads")?,
        head_dim: n("head_dim")?,
        inter: n("inter")?,
    };
    let draft = read_tensors(&parts(from, "draft")?)?;
    write_draft(&shape, 0, Some(&draft), Some(&k3_dir), &out.join("draft"))?;

    std::fs::create_dir_all(out.join("reference"))?;
    for model in ["k3", "draft"] {
        std::fs::copy(from.join(format!("{model}-reference.safetensors")), out.join(format!("reference/{model}.safetensors")))
            .with_context(|| format!("copying {model}-reference.safetensors"))?;
        std::fs::copy(from.join(format!("{model}-report.json")), out.join(format!("{model}-report.json")))?;
    }
    eprintln!("exported the trained K3 to {} and its draft to {}", k3_dir.display(), out.join("draft").display());
    Ok(())
}
