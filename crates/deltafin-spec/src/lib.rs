//! Speculative decoding for Deltafin: small drafters guess ahead, K3 verifies every guess.
//!
//! Exactness rule: a draft token is accepted only if it equals K3's own greedy choice at that
//! position, computed by the same batch-invariant kernels as plain decoding; the first mismatch
//! is replaced by K3's choice. Output is therefore identical, token for token, to decoding without
//! a drafter. This crate holds that rule ([`verify_greedy`]), the [`Drafter`] interface and
//! model-free drafters (`drafters.rs`), a draft model (`qwen3.rs`, driven by `model_drafter.rs`)
//! and the live cost gate that chooses each step's draft length (`gate.rs`); the engine's
//! generation (`deltafin-sched`) feeds drafts through its verify step and applies the rule.

mod drafters;
mod error;
mod gate;
mod model_drafter;
mod qwen3;

pub use drafters::{FlakyDrafter, NgramDrafter, OracleDrafter, RandomDrafter};
pub use error::{Error, Result};
pub use gate::{CostGate, FIRST_PROBE, MIN_GAIN, PLAIN_REFRESH, PROBE_MAX, PROBE_MIN};
pub use model_drafter::{DraftModel, ModelDrafter};
pub use qwen3::{KvCache, Qwen3, Qwen3Config};

use deltafin_core::{argmax, Mat};

/// Something that proposes the next tokens after a context.
pub trait Drafter {
    /// Up to `n` guessed ids following `context`.
    fn draft(&mut self, context: &[u32], n: usize) -> Vec<u32>;
    /// How the last draft fared: `accepted` of its `drafted` tokens were K3's choices.
    fn accepted(&mut self, drafted: usize, accepted: usize) {
        let _ = (drafted, accepted);
    }
    /// The K3 layers whose hidden states this drafter reads, ascending (hidden-state drafters:
    /// EAGLE-3 / DSpark-style heads fed by K3's states at a low, a middle and a high layer).
    /// Empty, the default, for drafters that read only tokens.
    fn hidden_layers(&self) -> Vec<usize> {
        Vec::new()
    }
    /// K3's hidden states for the tokens at positions `first..first + rows` of the sequence, once
    /// they are kept (rejected drafts' rows are never shown): `states[i]` `[rows, hidden]` after
    /// layer `hidden_layers()[i]`, the residual stream's running sum once that layer's MLP output
    /// has joined it. Called after the prompt and after every step, in position order.
    fn observe_hidden(&mut self, first: usize, states: &[Mat]) {
        let _ = (first, states);
    }
}

/// The outcome of verifying one draft.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// How many draft tokens K3 agreed with.
    pub accepted: usize,
    /// K3's own token after the accepted prefix (always produced: a correction or a bonus).
    pub next: u32,
}

/// Verifies `draft` against K3's logits. `logits` row `i` holds K3's distribution after the
/// context plus `draft[..i]` (so `logits.rows == draft.len() + 1`).
pub fn verify_greedy(draft: &[u32], logits: &Mat) -> Verdict {
    verify_with(draft, logits, |row, _| argmax(row))
}

/// [`verify_greedy`] with K3's choice at each row made by `choose(logits row, row index)` (a
/// seeded sampler's draw, say): a draft is kept when it is the token chosen there, so the
/// emitted tokens are those plain decoding with the same `choose` emits.
pub fn verify_with(draft: &[u32], logits: &Mat, choose: impl Fn(&[f32], usize) -> u32) -> Verdict {
    assert_eq!(logits.rows, draft.len() + 1, "one logits row per draft position plus one");
    for (i, &d) in draft.iter().enumerate() {
        let k3 = choose(logits.row(i), i);
        if k3 != d {
            return Verdict { accepted: i, next: k3 };
        }
    }
    Verdict { accepted: draft.len(), next: choose(logits.row(draft.len()), draft.len()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_hot_rows(ids: &[u32], vocab: usize) -> Mat {
        let mut m = Mat::zeros(ids.len(), vocab);
        for (r, &id) in ids.iter().enumerate() {
            m.row_mut(r)[id as usize] = 1.0;
        }
        m
    }

    #[test]
    fn accepts_the_agreeing_prefix_and_corrects_the_rest() {
        let k3 = one_hot_rows(&[5, 6, 7, 8], 10);
        assert_eq!(verify_greedy(&[5, 6, 7], &k3), Verdict { accepted: 3, next: 8 });
        assert_eq!(verify_greedy(&[5, 9, 7], &k3), Verdict { accepted: 1, next: 6 });
        assert_eq!(verify_greedy(&[1, 6, 7], &k3), Verdict { accepted: 0, next: 5 });
        assert_eq!(verify_greedy(&[], &one_hot_rows(&[3], 10)), Verdict { accepted: 0, next: 3 });
    }

    #[test]
    fn ties_resolve_like_plain_decoding() {
        let m = Mat::from_vec(1, 4, vec![0.5, 2.0, 2.0, 1.0]);
        assert_eq!(verify_greedy(&[], &m).next, 1);
    }
}
