//! Element-wise functions shared by the layers: RMSNorm, SiTU, sigmoid, SiLU, softmax.
//!
//! All in F32, each with one fixed evaluation order (sums go through the 16-lane kernels), and
//! `exp`/`tanh` our own (`transcendental`), so the bits do not depend on the platform's libm.

mod transcendental;

use crate::kernels::{dot_f32, Isa, IsaKind};
pub use transcendental::exp;
pub(crate) use transcendental::tanh;
pub use transcendental::CONSTANTS as TRANSCENDENTAL_CONSTANTS;

/// `1 / (1 + e^-x)`.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `x * sigmoid(x)`.
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// SiTU gated activation: `beta*tanh(g/beta)*sigmoid(g) * lin*tanh(u/lin)`.
#[inline(always)]
pub fn situ(up: f32, gate: f32, beta: f32, lin: f32) -> f32 {
    let a = beta * tanh(gate / beta) * sigmoid(gate);
    a * (lin * tanh(up / lin))
}

/// `up[i] = situ(up[i], gate[i], beta, lin)` for every `i`, bit for bit, on the widest vectors
/// `isa` has (each lane runs [`situ`]'s operations in its order).
pub fn situ_in_place(isa: Isa, up: &mut [f32], gate: &[f32], beta: f32, lin: f32) {
    assert_eq!(up.len(), gate.len(), "situ_in_place: one gate per value");
    // Inlined into each target-feature copy below, which the compiler then vectorizes.
    #[inline(always)]
    fn each(up: &mut [f32], gate: &[f32], beta: f32, lin: f32) {
        for (u, &g) in up.iter_mut().zip(gate) {
            *u = situ(*u, g, beta, lin);
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        fn avx512(up: &mut [f32], gate: &[f32], beta: f32, lin: f32) {
            each(up, gate, beta, lin)
        }
        #[target_feature(enable = "avx2")]
        fn avx2(up: &mut [f32], gate: &[f32], beta: f32, lin: f32) {
            each(up, gate, beta, lin)
        }
        match isa.kind() {
            // SAFETY: an `Isa` of these kinds is only made after feature detection.
            IsaKind::Avx512 => return unsafe { avx512(up, gate, beta, lin) },
            // SAFETY: as above.
            IsaKind::Avx2 => return unsafe { avx2(up, gate, beta, lin) },
            _ => {}
        }
    }
    let _ = isa;
    each(up, gate, beta, lin)
}

/// `1 / sqrt(n)` for an attention scale, rounded once from F64's IEEE square root and division
/// (no libm `powf`, whose last bit differs between platforms).
pub fn inv_sqrt_of(n: usize) -> f32 {
    (1.0 / (n as f64).sqrt()) as f32
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
        *v = exp(*v - m);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Values across every range the functions treat differently, specials included.
    fn inputs() -> Vec<f32> {
        let mut v = vec![0.0, -0.0, 1e-40, -1e-40, 1e-30, 0.74999994, 0.75, -0.75, 9.0, 40.0, -90.0, 120.0];
        v.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MIN_POSITIVE, f32::MAX]);
        let mut s = 0x2545_f491_4f6c_dd1du64;
        for i in 0..4000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let unit = (s >> 40) as f32 / (1u64 << 24) as f32;
            v.push((unit - 0.5) * [2.0, 8.0, 30.0, 200.0][i % 4]);
        }
        v
    }

    #[test]
    fn situ_is_the_same_on_every_instruction_set() {
        let gate = inputs();
        let up: Vec<f32> = gate.iter().rev().copied().collect();
        let want: Vec<u32> = up.iter().zip(&gate).map(|(&u, &g)| situ(u, g, 2.5, 4.0).to_bits()).collect();
        for isa in Isa::available() {
            // Odd lengths cover the vector loops' tails.
            for n in [gate.len(), 37, 1] {
                let mut got = up[..n].to_vec();
                situ_in_place(isa, &mut got, &gate[..n], 2.5, 4.0);
                for (i, (g, w)) in got.iter().zip(&want[..n]).enumerate() {
                    // A NaN's sign and payload are not part of the result.
                    let same = g.to_bits() == *w || (g.is_nan() && f32::from_bits(*w).is_nan());
                    assert!(same, "{isa:?}: situ({}, {}) = {g} against {}", up[i], gate[i], f32::from_bits(*w));
                }
            }
        }
    }

    #[test]
    fn attention_scales_are_the_correctly_rounded_ones() {
        for n in 1..=4096usize {
            let want = (n as f64).powf(-0.5) as f32;
            assert_eq!(inv_sqrt_of(n), want, "1/sqrt({n})");
        }
    }

    #[test]
    fn nan_reaches_the_output() {
        let mut up = [f32::NAN, 1.0, 1.0];
        situ_in_place(Isa::best(), &mut up, &[1.0, f32::NAN, 0.5], 2.5, 4.0);
        assert!(up[0].is_nan() && up[1].is_nan() && up[2].is_finite());
        let mut s = [0.0, f32::NAN];
        softmax_in_place(&mut s);
        assert!(s[0].is_nan(), "a NaN score poisons the softmax");
    }
}
