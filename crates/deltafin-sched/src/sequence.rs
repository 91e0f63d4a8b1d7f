//! Sequence state with explicit memory: KDA state is constant per layer; the MLA cache grows by
//! a fixed number of bytes per token up to a stated limit.
//!
//! A step records what undoing it needs (KDA: the state it started from, and for verification
//! each token's inputs; MLA: nothing, the cache is truncated), so a failed step is undone and a
//! verified one cut back to any prefix, bit-exactly and without cloning the state.

use deltafin_core::{K3Config, LayerState, Model, Recording};

use crate::engine::Phase;

/// The tokens a sequence has consumed and the per-layer state they produced.
#[derive(Clone, Debug)]
pub struct Sequence {
    pub(crate) ids: Vec<u32>,
    pub(crate) layers: Vec<LayerState>,
    pub(crate) context_limit: usize,
    /// Tokens consumed by the latest forward pass (what [`Sequence::rewind_to`] can undo).
    pub(crate) last_pass: usize,
    /// Every pass records enough to be cut back to any prefix (as verification passes do).
    pub(crate) record_all: bool,
    /// Run once and thrown away (prompt scoring): each layer's state exists only while the step
    /// runs that layer, so a step holds one layer's state per such sequence, not all of them.
    pub(crate) transient: bool,
}

impl Sequence {
    /// An empty sequence for `model` holding at most `context_limit` tokens.
    pub fn new(model: &Model, context_limit: usize) -> Sequence {
        Sequence {
            ids: Vec::new(),
            layers: model.new_state(context_limit),
            context_limit,
            last_pass: 0,
            record_all: false,
            transient: false,
        }
    }

    /// A sequence for one step of `tokens` tokens whose result is all that is wanted (the logits
    /// of a scored prompt): its layers' state is made when the step reaches each layer and
    /// released when the layer is done. It cannot be continued or undone.
    pub fn transient(model: &Model, tokens: usize) -> Sequence {
        let layers = (0..model.config().num_layers).map(|_| model.released_layer_state()).collect();
        Sequence { ids: Vec::new(), layers, context_limit: tokens, last_pass: 0, record_all: false, transient: true }
    }
    /// Tokens consumed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
    /// The per-layer state (read only: for checks that two sequences are bit-identical).
    #[doc(hidden)]
    pub fn layer_states(&self) -> &[LayerState] {
        &self.layers
    }
    /// From now on, record which cached keys each query of each MLA layer attends to (a
    /// diagnostic of Kimi K3.1's sparse attention: [`Sequence::attended_keys`]).
    pub fn trace_attended_keys(&mut self) {
        for l in &mut self.layers {
            if let LayerState::Mla(c) = l {
                c.trace.get_or_insert_with(Vec::new);
            }
        }
    }
    /// Per MLA layer, in layer order: per query run since [`Sequence::trace_attended_keys`], the
    /// key positions it attended to (all positions up to its own where attention was dense).
    pub fn attended_keys(&self) -> Vec<Vec<Vec<u32>>> {
        self.layers
            .iter()
            .filter_map(|l| match l {
                LayerState::Mla(c) => Some(c.trace.clone().unwrap_or_default()),
                LayerState::Kda(_) => None,
            })
            .collect()
    }
    /// Bytes of state held now.
    pub fn bytes(&self, cfg: &K3Config) -> usize {
        self.layers.iter().map(|l| l.bytes(cfg)).sum()
    }
    /// Bytes this sequence may grow to at its context limit (for the RAM budget): its state, plus
    /// the copy of its KDA state a step keeps to undo itself (per-token records of a verify step
    /// count as that step's working memory).
    pub fn max_bytes(cfg: &K3Config, context_limit: usize) -> usize {
        let kda = cfg.attention.iter().filter(|k| **k == deltafin_core::AttentionKind::Kda).count();
        let mla = cfg.num_layers - kda;
        let c = cfg.kda_dim();
        2 * kda * 4 * (3 * (cfg.conv_kernel - 1) * c + cfg.kda_heads * cfg.kda_head_dim * cfg.kda_head_dim)
            + mla * context_limit * deltafin_core::MlaCache::bytes_per_token(cfg)
    }

    /// Record what is needed to rewind every later forward to any of its prefixes, as verify
    /// steps do ([`Phase::Verify`]); off: only what undoing a whole failed step needs.
    pub fn set_recording(&mut self, on: bool) {
        self.record_all = on;
    }

    /// A step begins: record what undoing it needs (`Full` to cut it back to any prefix).
    pub(crate) fn begin_pass(&mut self, phase: Phase) {
        let mode = if phase == Phase::Verify || self.record_all { Recording::Full } else { Recording::Start };
        for l in &mut self.layers {
            l.set_record(mode);
        }
    }

    /// A step succeeded: the sequence now holds `ids` too. Outside verification its record is
    /// dropped at once (it will not be undone).
    pub(crate) fn commit_pass(&mut self, ids: &[u32], phase: Phase) {
        self.ids.extend_from_slice(ids);
        self.last_pass = ids.len();
        if phase != Phase::Verify && !self.record_all {
            for l in &mut self.layers {
                l.forget();
            }
        }
    }

    /// A step failed after the first `advanced` layers took its tokens: put them back as they
    /// were, from the step's record (no copy of the state was taken).
    pub(crate) fn undo_pass(&mut self, model: &Model, advanced: usize) -> Result<(), deltafin_core::Error> {
        for l in &mut self.layers[..advanced] {
            model.rewind(l, 0)?;
        }
        for l in &mut self.layers {
            l.forget();
        }
        Ok(())
    }

    /// Drops the tokens after the first `len`, which must lie within the latest (recorded)
    /// forward pass. Costs only the KDA recurrence of the kept tokens: no projection, no read.
    /// The state is then bit-identical to a sequence that consumed just those `len` tokens.
    #[doc(hidden)]
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
