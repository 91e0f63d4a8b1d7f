//! The compute seam: every operation a layer runs goes through a [`Backend`], so the model's code
//! is the same whether the numbers are computed by these CPU kernels or, later, on a GPU.
//!
//! **The contract includes the order of every reduction.** A dot product accumulates element `i`
//! into lane `i % 16` in ascending order and reduces the 16 lanes by one fixed tree; a matmul
//! output is one such dot; an RMS norm is `x * w / sqrt(dot(x, x) / n + eps)`; an expert is
//! evaluated as in [`crate::expert_forward`]. A backend that keeps this contract gives every bit
//! the CPU reference gives, whatever the batch, the threads or the device, which is what lets
//! prefill, decode, verification and batching agree exactly.

use std::fmt;

use crate::config::K3Config;
use crate::error::Result;
use crate::kernels::{dot_bf16, dot_f32, matmul_bf16_with, Isa};
use crate::math::softmax_in_place;
use crate::model::{expert_forward, ExpertLayout};
use crate::tensor::Mat;
use crate::weights::Bf16Matrix;

/// One MLA head's query against the cache: the query in the latent space and its rotary part,
/// the cached latents and rotary keys (`[keys][lora]`, `[keys][rope]`), which of those keys it
/// attends to (ascending positions; `None`: all, K3's dense attention; K3.1's indexer chooses
/// otherwise), and the score scale.
#[derive(Clone, Copy, Debug)]
pub struct MlaHead<'a> {
    pub q_lat: &'a [f32],
    pub q_pe: &'a [f32],
    pub latent: &'a [f32],
    pub k_pe: &'a [f32],
    pub keys: Option<&'a [u32]>,
    pub scale: f32,
}

/// Which routed expert a product is for: a backend may keep experts it has seen (a GPU's memory)
/// under this name. The bytes handed with it are still the ones to use; a backend that keeps a
/// copy checks that they are the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExpertId {
    pub layer: usize,
    pub expert: u32,
}

/// The operations a model runs.
pub trait Backend: Send + Sync + fmt::Debug {
    /// A short name for logs (`cpu-avx2`).
    fn name(&self) -> String;
    /// `X [t, cols] @ W[rows, cols]^T -> [t, rows]`, each output one dot in the fixed order.
    fn matmul_bf16(&self, x: &Mat, w: &Bf16Matrix) -> Mat;
    /// Dot of F32 values with BF16 bytes, in the fixed order.
    fn dot_bf16(&self, x: &[f32], w: &[u8]) -> f32;
    /// Dot of two F32 slices, in the fixed order.
    fn dot_f32(&self, a: &[f32], b: &[f32]) -> f32;
    /// One routed expert over latent rows `z`, from its stored MXFP4 bytes.
    fn expert_forward(&self, cfg: &K3Config, id: ExpertId, layout: &ExpertLayout, bytes: &[u8], z: &Mat) -> Result<Mat>;
    /// One MLA head's attention over its keys (every cached key, or those `head.keys` lists):
    /// scores `(q_lat . latent[j] + q_pe . k_pe[j])
    /// * scale` (two dots in the fixed order), a softmax in key order, the latent output
    /// `sum_j p[j] * latent[j]` accumulated in key order, then the head's values: one BF16 dot of
    /// that output with each row of `w_v` in `values`.
    fn mla_attend(&self, head: MlaHead<'_>, w_v: &Bf16Matrix, values: std::ops::Range<usize>) -> Vec<f32>;
    /// One KDA delta-rule step for one head: `S <- diag(decay) S; S += beta k (v - S k)^T; o = S q`.
    #[allow(clippy::too_many_arguments)]
    fn kda_step(&self, s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], decay: &[f32], beta: f32, o: &mut [f32]);

    /// `up[i] = situ(up[i], gate[i], beta, lin)`, element by element (the same bits on every
    /// instruction set: `crate::math::situ_in_place`).
    fn situ_in_place(&self, up: &mut [f32], gate: &[f32], beta: f32, lin: f32) {
        crate::math::situ_in_place(Isa::best(), up, gate, beta, lin)
    }

    /// `1 / sqrt(mean(x^2) + eps)`, the mean from [`Backend::dot_f32`].
    fn inv_rms(&self, x: &[f32], eps: f32) -> f32 {
        1.0 / (self.dot_f32(x, x) / x.len() as f32 + eps).sqrt()
    }
    /// RMS-normalizes `x` in place, then scales by `weight` if given.
    fn rms_norm_in_place(&self, x: &mut [f32], weight: Option<&[f32]>, eps: f32) {
        let inv = self.inv_rms(x, eps);
        match weight {
            Some(w) => x.iter_mut().zip(w).for_each(|(v, w)| *v = *v * inv * w),
            None => x.iter_mut().for_each(|v| *v *= inv),
        }
    }
    /// Every row of `m` RMS-normalized and scaled by `weight`.
    fn rms_norm_rows(&self, m: &Mat, weight: &[f32], eps: f32) -> Mat {
        let mut out = m.clone();
        for r in 0..out.rows {
            self.rms_norm_in_place(out.row_mut(r), Some(weight), eps);
        }
        out
    }
}

/// The CPU kernels on one instruction set (all give identical bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cpu {
    isa: Isa,
}

impl Cpu {
    /// The kernels on `isa`.
    pub fn new(isa: Isa) -> Cpu {
        Cpu { isa }
    }
    /// The fastest instruction set this CPU runs.
    pub fn best() -> Cpu {
        Cpu::new(Isa::best())
    }
    /// The instruction set in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }
}

impl Backend for Cpu {
    fn name(&self) -> String {
        format!("cpu-{:?}", self.isa.kind()).to_lowercase()
    }
    fn matmul_bf16(&self, x: &Mat, w: &Bf16Matrix) -> Mat {
        matmul_bf16_with(self.isa, x, w)
    }
    fn dot_bf16(&self, x: &[f32], w: &[u8]) -> f32 {
        dot_bf16(self.isa, x, w)
    }
    fn dot_f32(&self, a: &[f32], b: &[f32]) -> f32 {
        dot_f32(self.isa, a, b)
    }
    fn expert_forward(&self, cfg: &K3Config, _id: ExpertId, layout: &ExpertLayout, bytes: &[u8], z: &Mat) -> Result<Mat> {
        expert_forward(cfg, self.isa, layout, bytes, z)
    }
    fn situ_in_place(&self, up: &mut [f32], gate: &[f32], beta: f32, lin: f32) {
        crate::math::situ_in_place(self.isa, up, gate, beta, lin)
    }
    fn kda_step(&self, s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], decay: &[f32], beta: f32, o: &mut [f32]) {
        crate::model::recurrent_step(self.isa, s, q, k, v, decay, beta, o)
    }
    fn mla_attend(&self, head: MlaHead<'_>, w_v: &Bf16Matrix, values: std::ops::Range<usize>) -> Vec<f32> {
        let MlaHead { q_lat, q_pe, latent, k_pe, keys, scale } = head;
        let (lora, rope) = (q_lat.len(), q_pe.len());
        let n_keys = keys.map_or(latent.len() / lora, <[u32]>::len);
        // The i-th key attended to: a sparse list gives the same arithmetic over fewer keys.
        let key = |i: usize| keys.map_or(i, |k| k[i] as usize);
        let mut scores: Vec<f32> = (0..n_keys)
            .map(|i| {
                let j = key(i);
                let s =
                    dot_f32(self.isa, q_lat, &latent[j * lora..(j + 1) * lora]) + dot_f32(self.isa, q_pe, &k_pe[j * rope..(j + 1) * rope]);
                s * scale
            })
            .collect();
        softmax_in_place(&mut scores);
        let mut o_lat = vec![0f32; lora];
        for (i, p) in scores.iter().enumerate() {
            let j = key(i);
            for (o, l) in o_lat.iter_mut().zip(&latent[j * lora..(j + 1) * lora]) {
                *o += p * l;
            }
        }
        values.map(|r| dot_bf16(self.isa, &o_lat, w_v.row(r))).collect()
    }
}
