//! Element-wise functions shared by the layers: RMSNorm, SiTU, sigmoid, SiLU, softmax.
//!
//! All in F32, each with one fixed evaluation order (sums go through the 16-lane kernels).

use crate::kernels::{dot_f32, Isa};

/// `1 / (1 + e^-x)`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `x * sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// SiTU gated activation: `beta*tanh(g/beta)*sigmoid(g) * lin*tanh(u/lin)`.
#[inline]
pub fn situ(up: f32, gate: f32, beta: f32, lin: f32) -> f32 {
    let a = beta * (gate / beta).tanh() * sigmoid(gate);
    a * (lin * (up / lin).tanh())
}

/// `1 / sqrt(mean(x^2) + eps)`.
#[inline]
pub fn inv_rms(isa: Isa, x: &[f32], eps: f32) -> f32 {
    1.0 / (dot_f32(isa, x, x) / x.len() as f32 + eps).sqrt()
}

/// RMSNorm of one vector in place, with an optional weight.
pub fn rms_norm_in_place(isa: Isa, x: &mut [f32], weight: Option<&[f32]>, eps: f32) {
    let inv = inv_rms(isa, x, eps);
    match weight {
        Some(w) => x.iter_mut().zip(w).for_each(|(v, w)| *v = *v * inv * w),
        None => x.iter_mut().for_each(|v| *v *= inv),
    }
}

/// Softmax in place (max-subtracted; sum in index order).
pub fn softmax_in_place(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// Index of the largest value; ties go to the lowest index. The one greedy rule: plain decoding
/// and draft verification both use it, so they pick the same token from the same logits.
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}
