//! Kimi K3.1's sparse-attention indexer: which cached keys each MLA query attends to.
//!
//! Per MLA layer, as the public implementations read it (there is no Moonshot reference):
//!
//! ```text
//! qr     = q_a_layernorm(q_a_proj(x))          (MLA's own query latent)
//! iq     = wq_b(qr), heads x head_dim           (no rotary part)
//! ik_s   = LayerNorm(wk(x_s)), cached per token
//! w      = weights_proj(x) / sqrt(heads * head_dim)
//! I[t,s] = sum_h w[h] * relu(iq[h] . ik_s),  s <= t
//! ```
//!
//! and query `t` attends to the `index_topk` keys of highest `I[t, .]`, in position order; while
//! `t` sees no more keys than that, to all of them, which is K3's dense attention exactly (the
//! indexer is not even scored). Every dot is the backend's canonical F32 dot, so a query's scores,
//! and with them its keys, do not depend on what else shares its step. Equal scores: the earlier
//! token wins (a fixed rule, so selection is deterministic).
//!
//! `fp8` rounding reproduces vLLM's reading instead: the query and the key (rounded to BF16
//! first) become E4M3 values with one power-of-two scale per head (`ue8m0`: the amax over the
//! head, at least 1e-4, times f32(1/448), rounded up to a power of two), each head's weight
//! carries its query scale, `w[h] = weights_proj(x)[h] / sqrt(heads) * qscale[h] / sqrt(head_dim)`,
//! and the key's scale multiplies the head sum. The E4M3 values are exact in F32, so only the
//! order of the sums is ours.

use std::cmp::Ordering;

use rayon::prelude::*;

use super::loader::Loader;
use super::mla::MlaCache;
use crate::backend::Backend;
use crate::config::{IndexerConfig, IndexerRounding, K3Config};
use crate::error::Result;
use crate::math::inv_sqrt_of;
use crate::tensor::Mat;
use crate::weights::Bf16Matrix;

/// E4M3's largest finite value.
const E4M3_MAX: f32 = 448.0;

/// The indexer weights of one MLA layer (`self_attn.indexer.*`).
pub(crate) struct IndexerWeights {
    wq_b: Bf16Matrix,
    wk: Bf16Matrix,
    weights_proj: Bf16Matrix,
    k_norm: Vec<f32>,
    k_norm_bias: Vec<f32>,
}

/// The query side of the indexer for some rows: per row the head queries `[heads * head_dim]`
/// (E4M3 values in `fp8` mode) and the head weights `[heads]` (query scales folded in).
pub(crate) struct IndexQueries {
    q: Mat,
    w: Mat,
}

impl IndexerWeights {
    pub fn load(cfg: &K3Config, ix: &IndexerConfig, l: &Loader<'_>) -> Result<IndexerWeights> {
        let (h, n, d) = (cfg.hidden_size, ix.heads, ix.head_dim);
        Ok(IndexerWeights {
            wq_b: l.matrix("wq_b.weight", n * d, cfg.q_lora_rank)?,
            wk: l.matrix("wk.weight", d, h)?,
            weights_proj: l.matrix("weights_proj.weight", n, h)?,
            k_norm: l.vector_bf16_or_f32("k_norm.weight", d)?,
            k_norm_bias: l.vector_bf16_or_f32("k_norm.bias", d)?,
        })
    }

    /// Appends the indexer keys of the new rows `x` (normed attention inputs) to `cache`.
    pub fn append_keys(&self, ix: &IndexerConfig, be: &dyn Backend, x: &Mat, cache: &mut MlaCache) {
        let k = be.matmul_bf16(x, &self.wk);
        for t in 0..k.rows {
            let mut key = k.row(t).to_vec();
            layer_norm_in_place(be, &mut key, &self.k_norm, &self.k_norm_bias, ix.k_norm_eps);
            if let Some(scale) = round_index_key(ix.rounding, &mut key) {
                cache.index_scales.push(scale);
            }
            cache.index_keys.extend_from_slice(&key);
        }
    }

    /// The query side for rows `x` whose MLA query latents are `qr`.
    pub fn queries(&self, ix: &IndexerConfig, be: &dyn Backend, qr: &Mat, x: &Mat) -> IndexQueries {
        let mut q = be.matmul_bf16(qr, &self.wq_b);
        let mut w = be.matmul_bf16(x, &self.weights_proj);
        for t in 0..q.rows {
            prepare_index_query(ix.rounding, ix.head_dim, q.row_mut(t), w.row_mut(t));
        }
        IndexQueries { q, w }
    }
}

/// One token's indexer query as scoring uses it, in place: the head queries `q` `[heads *
/// head_dim]` (E4M3 values in `fp8` mode) and the head weights `w` (`weights_proj`'s output in,
/// the weights with their scales out).
pub fn prepare_index_query(rounding: IndexerRounding, head_dim: usize, q: &mut [f32], w: &mut [f32]) {
    let heads = w.len();
    match rounding {
        IndexerRounding::F32 => {
            let scale = inv_sqrt_of(heads * head_dim);
            w.iter_mut().for_each(|v| *v *= scale);
        }
        IndexerRounding::Fp8 => {
            let (per_head, per_dim) = (inv_sqrt_of(heads), inv_sqrt_of(head_dim));
            for (head, wh) in q.chunks_exact_mut(head_dim).zip(w.iter_mut()) {
                let qscale = quantize_e4m3(head);
                *wh = *wh * per_head * qscale * per_dim;
            }
        }
    }
}

/// One token's normed indexer key as the cache holds it, in place: unchanged in `f32` mode
/// (`None`); in `fp8` mode rounded to BF16, then E4M3 values, returning their scale.
pub fn round_index_key(rounding: IndexerRounding, key: &mut [f32]) -> Option<f32> {
    match rounding {
        IndexerRounding::F32 => None,
        IndexerRounding::Fp8 => {
            key.iter_mut().for_each(|v| *v = round_to_bf16(*v));
            Some(quantize_e4m3(key))
        }
    }
}

/// The index score of one key for one prepared query ([`prepare_index_query`]): each head's
/// canonical dot, its ReLU (into `relu`, one per head: scratch the caller keeps, since this runs
/// once per cached key), the canonical dot of those with the head weights, times the key's scale
/// (`fp8` mode).
pub fn index_score(be: &dyn Backend, head_dim: usize, q: &[f32], w: &[f32], key: &[f32], key_scale: Option<f32>, relu: &mut [f32]) -> f32 {
    for (r, qh) in relu.iter_mut().zip(q.chunks_exact(head_dim)) {
        let l = be.dot_f32(qh, key);
        *r = if l > 0.0 { l } else { 0.0 };
    }
    let score = be.dot_f32(relu, w);
    match key_scale {
        Some(s) => score * s,
        None => score,
    }
}

impl IndexQueries {
    /// Row `t`'s score of each of the first `n_keys` cached keys (`I[t, s]`), each one score
    /// computed alone in a fixed order, so in parallel over keys with the same bits.
    pub fn scores(&self, ix: &IndexerConfig, be: &dyn Backend, t: usize, cache: &MlaCache, n_keys: usize) -> Vec<f32> {
        let (q, w, d) = (self.q.row(t), self.w.row(t), ix.head_dim);
        (0..n_keys)
            .into_par_iter()
            .map_init(
                || vec![0f32; w.len()],
                |relu, s| {
                    let scale = (ix.rounding == IndexerRounding::Fp8).then(|| cache.index_scales[s]);
                    index_score(be, d, q, w, &cache.index_keys[s * d..(s + 1) * d], scale, relu)
                },
            )
            .collect()
    }
}

/// The `k` positions of highest score, in ascending position order; equal scores go to the
/// earlier position, NaN ranks below every number. All positions when there are at most `k`.
pub fn top_keys(scores: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..scores.len() as u32).collect();
    if scores.len() > k && k > 0 {
        let rank = |a: &u32, b: &u32| {
            let (x, y) = (scores[*a as usize], scores[*b as usize]);
            match (x.is_nan(), y.is_nan()) {
                (true, true) => a.cmp(b),
                (true, false) => Ordering::Greater,
                (false, true) => Ordering::Less,
                _ => y.partial_cmp(&x).expect("numbers").then(a.cmp(b)),
            }
        };
        idx.select_nth_unstable_by(k - 1, rank);
        idx.truncate(k);
        idx.sort_unstable();
    } else if k == 0 {
        idx.clear();
    }
    idx
}

/// LayerNorm with bias: the mean and the variance each from one canonical dot, then
/// `(x - mean) * (1 / sqrt(var + eps)) * w + b`, element by element.
pub(crate) fn layer_norm_in_place(be: &dyn Backend, x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let n = x.len() as f32;
    let ones = vec![1f32; x.len()];
    let mean = be.dot_f32(x, &ones) / n;
    x.iter_mut().for_each(|v| *v -= mean);
    let var = be.dot_f32(x, x) / n;
    let inv = 1.0 / (var + eps).sqrt();
    for ((v, w), b) in x.iter_mut().zip(w).zip(b) {
        *v = *v * inv * w + b;
    }
}

/// `x` rounded to the nearest BF16 (ties to even), back in F32.
pub fn round_to_bf16(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let b = x.to_bits();
    f32::from_bits(b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000)
}

/// `v` (within E4M3's range) rounded to the nearest E4M3 value, ties to even: 3 mantissa bits,
/// normal exponents from -6, subnormal steps of 2^-9.
pub fn round_to_e4m3(v: f32) -> f32 {
    let a = v.abs();
    if a == 0.0 || a.is_nan() {
        return v;
    }
    let e = ((a.to_bits() >> 23) as i32 - 127).max(-6);
    let quantum = f32::from_bits(((e - 3 + 127) as u32) << 23);
    ((a / quantum).round_ties_even() * quantum).copysign(v)
}

/// The power-of-two (UE8M0) scale of a block whose largest magnitude is `amax`: `max(amax,
/// 1e-4) * f32(1/448)`, rounded up to a power of two.
pub fn ue8m0_scale(amax: f32) -> f32 {
    let s = amax.max(1e-4) * (1.0f32 / E4M3_MAX);
    let bits = s.to_bits();
    if bits & 0x007f_ffff == 0 {
        s
    } else {
        f32::from_bits(((bits >> 23) + 1) << 23)
    }
}

/// Replaces `block` with its E4M3 values (`x / scale` clamped to +-448, rounded) and returns
/// the scale: `block[i] * scale` is the value it stands for.
pub fn quantize_e4m3(block: &mut [f32]) -> f32 {
    let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = ue8m0_scale(amax);
    block.iter_mut().for_each(|v| *v = round_to_e4m3((*v / scale).clamp(-E4M3_MAX, E4M3_MAX)));
    scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_rounding_hits_the_format_grid() {
        assert_eq!(round_to_e4m3(448.0), 448.0);
        assert_eq!(round_to_e4m3(1.0625), 1.0); // halfway between 1 and 1.125: even
        assert_eq!(round_to_e4m3(1.1875), 1.25); // halfway between 1.125 and 1.25: even
        assert_eq!(round_to_e4m3(-3.3), -3.25);
        assert_eq!(round_to_e4m3(2f32.powi(-9)), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(round_to_e4m3(2f32.powi(-10)), 0.0); // halfway to zero: even
        assert_eq!(round_to_e4m3(1.5 * 2f32.powi(-10)), 2f32.powi(-9));
        assert_eq!(round_to_e4m3(15.9), 16.0);
    }

    #[test]
    fn ue8m0_scales_are_powers_of_two_at_or_above_amax_over_448() {
        assert_eq!(ue8m0_scale(448.0), 1.0);
        assert_eq!(ue8m0_scale(449.0), 2.0);
        assert_eq!(ue8m0_scale(0.0), ue8m0_scale(1e-4));
        for amax in [1e-3f32, 0.7, 3.0, 1000.0] {
            let s = ue8m0_scale(amax);
            assert_eq!(s.to_bits() & 0x007f_ffff, 0);
            assert!(amax / s <= 448.0 && amax / s > 224.0 * (1.0 - 1e-6), "{amax} -> {s}");
        }
    }

    #[test]
    fn bf16_rounding_is_to_nearest_even() {
        assert_eq!(round_to_bf16(1.0 + 2f32.powi(-8)), 1.0); // halfway: even
        assert_eq!(round_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6));
        assert_eq!(round_to_bf16(-1.0 - 2f32.powi(-7) - 2f32.powi(-12)), -1.0 - 2f32.powi(-7));
        assert_eq!(round_to_bf16(-1.0 - 2f32.powi(-7) - 2f32.powi(-8) - 2f32.powi(-12)), -1.0 - 2f32.powi(-6));
    }

    #[test]
    fn top_keys_breaks_ties_toward_earlier_positions_and_keeps_position_order() {
        let s = [1.0, 3.0, 2.0, 3.0, f32::NAN, 2.0, -0.0, 0.0];
        assert_eq!(top_keys(&s, 3), vec![1, 2, 3]);
        assert_eq!(top_keys(&s, 2), vec![1, 3]);
        assert_eq!(top_keys(&s, 4), vec![1, 2, 3, 5]);
        assert_eq!(top_keys(&s, 8), (0..8).collect::<Vec<_>>());
        assert_eq!(top_keys(&[0.0, -0.0, 0.0], 1), vec![0], "zeros of either sign are equal");
        assert_eq!(top_keys(&s, 7), vec![0, 1, 2, 3, 5, 6, 7], "NaN ranks last");
    }
}
