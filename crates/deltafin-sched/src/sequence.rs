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
    /// Tokens consumed by the latest forward pass (what [`Sequence::rewind_to`] can undo).
    pub(crate) last_pass: usize,
}

impl Sequence {
    /// An empty sequence for `model` holding at most `context_limit` tokens.
    pub fn new(model: &Model, context_limit: usize) -> Sequence {
        Sequence { ids: Vec::new(), layers: model.new_state(context_limit), context_limit, last_pass: 0 }
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
    /// Record what is needed to rewind the next forward pass to any of its prefixes (speculative
    /// verification runs the drafts in one pass, then keeps only the accepted ones).
    pub fn set_recording(&mut self, on: bool) {
        for l in &mut self.layers {
            l.set_recording(on);
        }
    }

    /// Drops the tokens after the first `len`, which must lie within the latest (recorded)
    /// forward pass. Costs only the KDA recurrence of the kept tokens: no projection, no read.
    /// The state is then bit-identical to a sequence that consumed just those `len` tokens.
    pub fn rewind_to(&mut self, model: &Model, len: usize) -> Result<(), deltafin_core::Error> {
        let first = self.ids.len() - self.last_pass;
        if len < first || len > self.ids.len() {
            return Err(deltafin_core::Error::ContextLimit(format!(
                "can rewind only within the latest forward pass: {len} is outside {first}..={}",
                self.ids.len()
            )));
        }
        let keep = len - first;
        for l in &mut self.layers {
            model.rewind(l, keep)?;
        }
        self.ids.truncate(len);
        self.last_pass = 0;
        Ok(())
    }

    /// The most tokens this sequence can hold.
    pub fn context_limit(&self) -> usize {
        self.context_limit
    }
}
