//! Kimi K3.1's sparse-attention indexer (`text_config.dsa_config`): which MLA layers carry one,
//! its shape, and how many keys each query keeps.
//!
//! K3.1 differs from K3 only here (public implementations: vLLM's `kimi_linear` config class and
//! DeepSeek-V3.2-style `dsa` modules; llama.cpp's notes). Moonshot's own config.json text has not
//! been seen, so parsing is strict: a field this engine does not implement, or a value that would
//! change the math it does implement (an indexer RoPE, another key norm, an indexer on a KDA
//! layer), is refused by name rather than guessed at.

use super::{unsupported, Fields};
use crate::error::Result;

/// How the indexer's scores are rounded before the top-k choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum IndexerRounding {
    /// The definition: queries, keys and scores in F32, every dot in the canonical order.
    #[default]
    F32,
    /// vLLM's reading: the query and the key (rounded to BF16 first) as E4M3 with one
    /// power-of-two (UE8M0) scale per head-sized block, the scores from those values.
    Fp8,
}

impl IndexerRounding {
    /// `f32` or `fp8` (the CLI's `--indexer`).
    pub fn parse(s: &str) -> Option<IndexerRounding> {
        match s {
            "f32" => Some(IndexerRounding::F32),
            "fp8" => Some(IndexerRounding::Fp8),
            _ => None,
        }
    }
    /// The name [`IndexerRounding::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            IndexerRounding::F32 => "f32",
            IndexerRounding::Fp8 => "fp8",
        }
    }
}

/// The indexer of every MLA layer of a K3.1 checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexerConfig {
    /// Keys each query attends to at most (`index_topk`); below it attention is K3's dense one.
    pub topk: usize,
    /// Indexer heads (`index_num_heads`).
    pub heads: usize,
    /// Width of each indexer head and of the cached indexer key (`index_head_dim`).
    pub head_dim: usize,
    /// LayerNorm epsilon of the key norm (`rms_norm_eps`, as the public implementations use).
    pub k_norm_eps: f32,
    /// What the checkpoint's `indexer_use_fp8` says (informational: the rounding is the
    /// user's choice, [`IndexerConfig::rounding`]).
    pub checkpoint_fp8: bool,
    /// How scores are rounded (the engine's option; `F32` unless asked).
    pub rounding: IndexerRounding,
}

impl IndexerConfig {
    /// Bytes one cached token's indexer key takes (F32 values, and one F32 scale in `fp8` mode).
    pub fn key_bytes(&self) -> usize {
        4 * self.head_dim + if self.rounding == IndexerRounding::Fp8 { 4 } else { 0 }
    }
}

/// Every field of `dsa_config` this engine reads; any other is refused.
const KNOWN: &[&str] =
    &["layers", "index_topk", "index_num_heads", "index_head_dim", "index_rope_dim", "index_k_norm_type", "indexer_use_fp8"];

/// Parses `text_config.dsa_config` against the MLA layers (`full_attn_layers`, 1-based).
pub(super) fn parse(tc: &Fields<'_>, mla_layers: &[usize], rms_norm_eps: f32) -> Result<IndexerConfig> {
    let d = tc.obj("dsa_config")?;
    if let serde_json::Value::Object(map) = d.v {
        if let Some(k) = map.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return Err(unsupported(&d.name(k), &map[k].to_string(), "a dsa_config field this engine does not implement"));
        }
    }
    let mut layers = d.usize_list("layers")?;
    let mut mla = mla_layers.to_vec();
    layers.sort_unstable();
    mla.sort_unstable();
    if layers != mla {
        return Err(unsupported(
            &d.name("layers"),
            &format!("{layers:?}"),
            &format!("the indexer must sit on exactly the MLA layers (full_attn_layers = {mla:?})"),
        ));
    }
    let rope = d.usize("index_rope_dim")?;
    if rope != 0 {
        return Err(unsupported(
            &d.name("index_rope_dim"),
            &rope.to_string(),
            "a rotary part in the indexer is not implemented (K3.1 uses 0)",
        ));
    }
    let norm = d.str("index_k_norm_type")?;
    if norm.to_ascii_lowercase().replace(['_', '-'], "") != "layernorm" {
        return Err(unsupported(&d.name("index_k_norm_type"), &format!("{norm:?}"), "only a LayerNorm with bias is implemented"));
    }
    let cfg = IndexerConfig {
        topk: d.usize("index_topk")?,
        heads: d.usize("index_num_heads")?,
        head_dim: d.usize("index_head_dim")?,
        k_norm_eps: rms_norm_eps,
        checkpoint_fp8: d.bool_or("indexer_use_fp8", false)?,
        rounding: IndexerRounding::F32,
    };
    for (field, v) in [("index_topk", cfg.topk), ("index_num_heads", cfg.heads), ("index_head_dim", cfg.head_dim)] {
        if v == 0 {
            return Err(unsupported(&d.name(field), "0", "must be positive"));
        }
    }
    Ok(cfg)
}
