//! Sequence state with explicit memory: KDA state is constant per layer; the MLA cache grows by
//! a fixed number of bytes per token up to a stated limit.
//!
//! A snapshot is cheap to take before a multi-token forward and restores every layer exactly,
//! which is what exact speculative verification and conversation reuse need.

use deltafin_core::{K3Config, LayerState, Model};

/// The tokens a sequence has consumed and the per-layer state they produced.
#[derive(Clone, Debug)]
pub struct Sequence {
    pub(crate) ids: Vec<u32>,
    pub(crate) layers: Vec<LayerState>,
    pub(crate) context_limit: usize,
}

impl Sequence {
    /// An empty sequence for `model` holding at most `context_limit` tokens.
    pub fn new(model: &Model, context_limit: usize) -> Sequence {
        Sequence { ids: Vec::new(), layers: model.new_state(context_limit), context_limit }
    }
    /// Tokens consumed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
    /// Bytes of state held now.
    pub fn bytes(&self, cfg: &K3Config) -> usize {
        self.layers.iter().map(|l| l.bytes(cfg)).sum()
    }
    /// Bytes this sequence may grow to at its context limit (for the RAM budget).
    pub fn max_bytes(cfg: &K3Config, context_limit: usize) -> usize {
        let kda = cfg.attention.iter().filter(|k| **k == deltafin_core::AttentionKind::Kda).count();
        let mla = cfg.num_layers - kda;
        let c = cfg.kda_dim();
        kda * 4 * (3 * (cfg.conv_kernel - 1) * c + cfg.kda_heads * cfg.kda_head_dim * cfg.kda_head_dim)
            + mla * context_limit * deltafin_core::MlaCache::bytes_per_token(cfg)
    }
    /// The most tokens this sequence can hold.
    pub fn context_limit(&self) -> usize {
        self.context_limit
    }
}
