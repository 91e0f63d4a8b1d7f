//! aarch64 NEON versions of the dot products: the same 16 lanes (four `float32x4_t`), the same
//! fused multiply-adds in the same order, the same reduction, so they equal the scalar reference
//! bit for bit. E2M1 codes are decoded arithmetically into exact F32 bit patterns.

use std::arch::aarch64::*;

use super::dot::{dot_bf16_scalar, dot_f32_scalar, reduce_lanes, LANES};
use super::mxfp4::e8m0_scale;

#[target_feature(enable = "neon")]
unsafe fn store4(a: [float32x4_t; 4]) -> [f32; LANES] {
    let mut acc = [0f32; LANES];
    // SAFETY: acc has 16 floats.
    unsafe {
        for (i, v) in a.iter().enumerate() {
            vst1q_f32(acc.as_mut_ptr().add(4 * i), *v);
        }
    }
    acc
}

#[target_feature(enable = "neon")]
pub(crate) unsafe fn dot_f32_neon(x: &[f32], w: &[f32]) -> f32 {
    let n = x.len() / LANES * LANES;
    let mut acc = [vdupq_n_f32(0.0); 4];
    let mut i = 0;
    while i < n {
        for (q, a) in acc.iter_mut().enumerate() {
            // SAFETY: i + 16 <= len of both slices.
            unsafe { *a = vfmaq_f32(*a, vld1q_f32(x.as_ptr().add(i + 4 * q)), vld1q_f32(w.as_ptr().add(i + 4 * q))) };
        }
        i += LANES;
    }
    dot_f32_scalar(x, w, n, unsafe { store4(acc) })
}

#[target_feature(enable = "neon")]
pub(crate) unsafe fn dot_bf16_neon(x: &[f32], w: &[u8]) -> f32 {
    let n = x.len() / LANES * LANES;
    let mut acc = [vdupq_n_f32(0.0); 4];
    let mut i = 0;
    while i < n {
        // SAFETY: 16 inputs and 32 weight bytes are readable at i.
        unsafe {
            let lo = vld1q_u16(w.as_ptr().add(2 * i) as *const u16);
            let hi = vld1q_u16(w.as_ptr().add(2 * i + 16) as *const u16);
            let ws = [
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(lo))),
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_high_u16(lo))),
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(hi))),
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_high_u16(hi))),
            ];
            for q in 0..4 {
                acc[q] = vfmaq_f32(acc[q], vld1q_f32(x.as_ptr().add(i + 4 * q)), ws[q]);
            }
        }
        i += LANES;
    }
    dot_bf16_scalar(x, w, n, unsafe { store4(acc) })
}

/// Four E2M1 codes (one per u32 lane, low 4 bits) to their exact F32 values.
#[target_feature(enable = "neon")]
unsafe fn e2m1x4(c: uint32x4_t) -> float32x4_t {
    // bit 3 sign, bits 2..1 exponent, bit 0 mantissa: e > 0 -> (1 + m/2) 2^(e-1); e = 0 -> m/2.
    let sign = vshlq_n_u32::<28>(vandq_u32(c, vdupq_n_u32(8)));
    let e = vandq_u32(vshrq_n_u32::<1>(c), vdupq_n_u32(3));
    let m = vandq_u32(c, vdupq_n_u32(1));
    let normal = vorrq_u32(vshlq_n_u32::<23>(vaddq_u32(e, vdupq_n_u32(126))), vshlq_n_u32::<22>(m));
    let sub = vmulq_n_u32(m, 0x3F00_0000);
    let bits = vbslq_u32(vcgtq_u32(e, vdupq_n_u32(0)), normal, sub);
    vreinterpretq_f32_u32(vorrq_u32(bits, sign))
}

#[target_feature(enable = "neon")]
pub(crate) unsafe fn dot_mxfp4_neon(xp: &[f32], packed: &[u8], scales: &[u8]) -> f32 {
    let mut acc = [vdupq_n_f32(0.0); 4];
    for (g, &s) in scales.iter().enumerate() {
        let sc = e8m0_scale(s);
        // SAFETY: group g has 16 packed bytes and 32 inputs (lengths asserted by the caller).
        unsafe {
            let b = vld1q_u8(packed.as_ptr().add(16 * g));
            let w16 = [vmovl_u8(vget_low_u8(b)), vmovl_u8(vget_high_u8(b))];
            let bytes = [
                vmovl_u16(vget_low_u16(w16[0])),
                vmovl_u16(vget_high_u16(w16[0])),
                vmovl_u16(vget_low_u16(w16[1])),
                vmovl_u16(vget_high_u16(w16[1])),
            ];
            let x = xp.as_ptr().add(32 * g);
            for q in 0..4 {
                let even = vmulq_n_f32(e2m1x4(vandq_u32(bytes[q], vdupq_n_u32(15))), sc);
                acc[q] = vfmaq_f32(acc[q], vld1q_f32(x.add(4 * q)), even);
            }
            for q in 0..4 {
                let odd = vmulq_n_f32(e2m1x4(vshrq_n_u32::<4>(bytes[q])), sc);
                acc[q] = vfmaq_f32(acc[q], vld1q_f32(x.add(16 + 4 * q)), odd);
            }
        }
    }
    reduce_lanes(&unsafe { store4(acc) })
}
