//! MXFP4 dequantize-and-multiply straight from the stored expert bytes.
//!
//! Layout as in the checkpoint: `packed` U8 `[rows, cols/2]` of E2M1 codes (low nibble = even
//! column, bit 3 = sign) and `scale` U8 `[rows, cols/32]` of E8M0 exponents (`2^(s-127)`).
//! A group of 32 columns is 16 bytes; byte `j` of a group feeds lane `j`: first its even column,
//! then its odd column. The input vector is permuted once per token by [`permute_for_mxfp4`] so
//! that both halves load contiguously. Each weight is dequantized exactly (`code * 2^(s-127)` is
//! representable in F32) and fused-multiply-added, so the scalar and SIMD kernels agree bit for bit.

use super::dot::{reduce_lanes, Isa, IsaKind, LANES};

/// E2M1 code to value, sign included (code 8 is -0.0).
const E2M1: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// The value of an E2M1 code (low 4 bits).
pub fn e2m1_value(code: u8) -> f32 {
    E2M1[(code & 15) as usize]
}

/// The value of an E8M0 scale byte, `2^(s-127)`, exact (s = 0 is the subnormal 2^-127).
#[inline(always)]
pub fn e8m0_scale(s: u8) -> f32 {
    if s == 0 {
        f32::from_bits(0x0040_0000)
    } else {
        f32::from_bits((s as u32) << 23)
    }
}

/// Reorders `x` (length a multiple of 32) so each group of 32 reads `[even cols.., odd cols..]`.
pub fn permute_for_mxfp4(x: &[f32]) -> Vec<f32> {
    assert_eq!(x.len() % 32, 0, "MXFP4 input length must be a multiple of 32");
    let mut out = vec![0f32; x.len()];
    for (g, chunk) in x.chunks_exact(32).enumerate() {
        for j in 0..16 {
            out[32 * g + j] = chunk[2 * j];
            out[32 * g + 16 + j] = chunk[2 * j + 1];
        }
    }
    out
}

/// One row: `sum_c x[c] * W[c]` with `xp` from [`permute_for_mxfp4`], `packed` of `cols/2` bytes
/// and `scales` of `cols/32` bytes.
pub fn dot_mxfp4(isa: Isa, xp: &[f32], packed: &[u8], scales: &[u8]) -> f32 {
    assert!(xp.len() == packed.len() * 2 && xp.len() == scales.len() * 32, "dot_mxfp4: length mismatch");
    match isa.kind() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: SIMD variants are only selected after feature detection.
        IsaKind::Avx2 => unsafe { x86::dot_mxfp4_avx2(xp, packed, scales) },
        #[cfg(target_arch = "x86_64")]
        IsaKind::Avx512 => unsafe { x86::dot_mxfp4_avx512(xp, packed, scales) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON is only selected after feature detection.
        IsaKind::Neon => unsafe { super::neon::dot_mxfp4_neon(xp, packed, scales) },
        _ => dot_mxfp4_scalar(xp, packed, scales),
    }
}

/// One row against several inputs: `out[t]` = [`dot_mxfp4`]`(xs[t], packed, scales)`, bit for bit.
///
/// The SIMD paths dequantize each group of weights once and fused-multiply-add it into every
/// input's own accumulators, in exactly the single dot's order: a prompt's tokens share the
/// dequantization instead of repeating it per token.
pub fn dot_mxfp4_inputs(isa: Isa, xs: &[&[f32]], packed: &[u8], scales: &[u8], out: &mut [f32]) {
    assert_eq!(xs.len(), out.len(), "dot_mxfp4_inputs: one output per input");
    for x in xs {
        assert!(x.len() == packed.len() * 2 && x.len() == scales.len() * 32, "dot_mxfp4_inputs: length mismatch");
    }
    match isa.kind() {
        #[cfg(target_arch = "x86_64")]
        IsaKind::Avx512 => {
            for (xs, out) in xs.chunks(8).zip(out.chunks_mut(8)) {
                // SAFETY: AVX-512 is only selected after feature detection; lengths checked.
                unsafe { x86::dot_mxfp4_avx512_inputs(xs, packed, scales, out) }
            }
        }
        #[cfg(target_arch = "x86_64")]
        IsaKind::Avx2 => {
            for (xs, out) in xs.chunks(4).zip(out.chunks_mut(4)) {
                // SAFETY: AVX2 is only selected after feature detection; lengths checked.
                unsafe { x86::dot_mxfp4_avx2_inputs(xs, packed, scales, out) }
            }
        }
        _ => {
            for (x, o) in xs.iter().zip(out) {
                *o = dot_mxfp4(isa, x, packed, scales);
            }
        }
    }
}

fn dot_mxfp4_scalar(xp: &[f32], packed: &[u8], scales: &[u8]) -> f32 {
    let mut acc = [0f32; LANES];
    for (g, &s) in scales.iter().enumerate() {
        let sc = e8m0_scale(s);
        let bytes = &packed[16 * g..16 * g + 16];
        let x = &xp[32 * g..32 * g + 32];
        for j in 0..16 {
            let b = bytes[j];
            acc[j] = x[j].mul_add(E2M1[(b & 15) as usize] * sc, acc[j]);
            acc[j] = x[16 + j].mul_add(E2M1[(b >> 4) as usize] * sc, acc[j]);
        }
    }
    reduce_lanes(&acc)
}

/// A row-major MXFP4 matrix `[rows, cols]` over borrowed packed and scale bytes.
#[derive(Clone, Copy, Debug)]
pub struct Mxfp4Matrix<'a> {
    pub rows: usize,
    pub cols: usize,
    pub packed: &'a [u8],
    pub scales: &'a [u8],
}

impl<'a> Mxfp4Matrix<'a> {
    /// Checks the byte lengths against `[rows, cols]`.
    pub fn new(rows: usize, cols: usize, packed: &'a [u8], scales: &'a [u8]) -> crate::Result<Self> {
        if !cols.is_multiple_of(32) || packed.len() != rows * cols / 2 || scales.len() != rows * cols / 32 {
            return Err(crate::Error::ExpertLayout(format!(
                "MXFP4 [{rows}, {cols}] needs {} packed and {} scale bytes, got {} and {}",
                rows * cols / 2,
                rows * cols / 32,
                packed.len(),
                scales.len()
            )));
        }
        Ok(Mxfp4Matrix { rows, cols, packed, scales })
    }
    /// Row `r`'s packed codes and scales.
    #[inline]
    pub fn row_bytes(&self, r: usize) -> (&'a [u8], &'a [u8]) {
        let pb = self.cols / 2;
        let sb = self.cols / 32;
        (&self.packed[r * pb..(r + 1) * pb], &self.scales[r * sb..(r + 1) * sb])
    }

    /// Row `r`: one output of `W x` for a permuted input.
    #[inline]
    pub fn dot_row(&self, isa: Isa, r: usize, xp: &[f32]) -> f32 {
        let pb = self.cols / 2;
        let sb = self.cols / 32;
        dot_mxfp4(isa, xp, &self.packed[r * pb..(r + 1) * pb], &self.scales[r * sb..(r + 1) * sb])
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::kernels::dot::x86::{store16, store2};
    use std::arch::x86_64::*;

    /// Calls `$f::<N>` for N = the number of inputs (the last count takes any larger number):
    /// each count gets its own accumulator array in registers.
    macro_rules! by_count {
        ($f:ident, $xs:expr, $p:expr, $s:expr, $o:expr, $($n:literal)*; $max:literal) => {
            match $xs.len() {
                $($n => $f::<$n>($xs, $p, $s, $o),)*
                _ => $f::<$max>($xs, $p, $s, $o),
            }
        };
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn half_avx2(bytes8: *const u8, mag: __m256, shift: i32) -> __m256 {
        // SAFETY: caller guarantees 8 readable bytes.
        unsafe {
            let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(bytes8 as *const __m128i));
            let code = if shift == 0 { _mm256_and_si256(b, _mm256_set1_epi32(15)) } else { _mm256_srli_epi32(b, 4) };
            let m = _mm256_permutevar8x32_ps(mag, _mm256_and_si256(code, _mm256_set1_epi32(7)));
            let sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(8)), 28);
            _mm256_xor_ps(m, _mm256_castsi256_ps(sign))
        }
    }

    /// One input: the multi-input kernel with N = 1 (the same code, so the same bits).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_mxfp4_avx2(xp: &[f32], packed: &[u8], scales: &[u8]) -> f32 {
        let mut out = [0f32];
        // SAFETY: lengths asserted by the caller.
        unsafe { avx2_n::<1>(&[xp], packed, scales, &mut out) };
        out[0]
    }

    /// One input: the multi-input kernel with N = 1.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot_mxfp4_avx512(xp: &[f32], packed: &[u8], scales: &[u8]) -> f32 {
        let mut out = [0f32];
        // SAFETY: lengths asserted by the caller.
        unsafe { avx512_n::<1>(&[xp], packed, scales, &mut out) };
        out[0]
    }

    /// Up to 8 inputs against one row: each group dequantized once (as in `dot_mxfp4_avx512`),
    /// then the same two FMAs per input into that input's accumulator.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot_mxfp4_avx512_inputs(xs: &[&[f32]], packed: &[u8], scales: &[u8], out: &mut [f32]) {
        // SAFETY: lengths checked by the caller; at most 8 inputs.
        unsafe { by_count!(avx512_n, xs, packed, scales, out, 1 2 3 4 5 6 7; 8) }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn avx512_n<const N: usize>(xs: &[&[f32]], packed: &[u8], scales: &[u8], out: &mut [f32]) {
        // SAFETY: E2M1 has 16 floats.
        let lut = unsafe { _mm512_loadu_ps(E2M1.as_ptr()) };
        let x: [*const f32; N] = std::array::from_fn(|t| xs[t].as_ptr());
        let mut acc = [_mm512_setzero_ps(); N];
        for (g, &s) in scales.iter().enumerate() {
            let sc = _mm512_set1_ps(e8m0_scale(s));
            // SAFETY: group g has 16 packed bytes and 32 inputs per x (lengths checked).
            unsafe {
                let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(packed.as_ptr().add(16 * g) as *const __m128i));
                let even = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)), lut), sc);
                let odd = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut), sc);
                for t in 0..N {
                    let xt = x[t].add(32 * g);
                    acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xt), even, acc[t]);
                    acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xt.add(16)), odd, acc[t]);
                }
            }
        }
        for t in 0..N {
            out[t] = reduce_lanes(&unsafe { store16(acc[t]) });
        }
    }

    /// Up to 4 inputs against one row: each group dequantized once (as in `dot_mxfp4_avx2`).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_mxfp4_avx2_inputs(xs: &[&[f32]], packed: &[u8], scales: &[u8], out: &mut [f32]) {
        // SAFETY: lengths checked by the caller; at most 4 inputs.
        unsafe { by_count!(avx2_n, xs, packed, scales, out, 1 2 3; 4) }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2_n<const N: usize>(xs: &[&[f32]], packed: &[u8], scales: &[u8], out: &mut [f32]) {
        let mag = _mm256_setr_ps(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0);
        let x: [*const f32; N] = std::array::from_fn(|t| xs[t].as_ptr());
        let (mut lo, mut hi) = ([_mm256_setzero_ps(); N], [_mm256_setzero_ps(); N]);
        for (g, &s) in scales.iter().enumerate() {
            let sc = _mm256_set1_ps(e8m0_scale(s));
            // SAFETY: group g has 16 packed bytes and 32 inputs per x (lengths checked).
            unsafe {
                let p = packed.as_ptr().add(16 * g);
                let w_even_lo = _mm256_mul_ps(half_avx2(p, mag, 0), sc);
                let w_even_hi = _mm256_mul_ps(half_avx2(p.add(8), mag, 0), sc);
                let w_odd_lo = _mm256_mul_ps(half_avx2(p, mag, 4), sc);
                let w_odd_hi = _mm256_mul_ps(half_avx2(p.add(8), mag, 4), sc);
                for t in 0..N {
                    let xt = x[t].add(32 * g);
                    lo[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xt), w_even_lo, lo[t]);
                    hi[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xt.add(8)), w_even_hi, hi[t]);
                    lo[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xt.add(16)), w_odd_lo, lo[t]);
                    hi[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xt.add(24)), w_odd_hi, hi[t]);
                }
            }
        }
        for t in 0..N {
            out[t] = reduce_lanes(&unsafe { store2(lo[t], hi[t]) });
        }
    }
}
