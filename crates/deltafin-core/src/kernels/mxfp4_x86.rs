//! x86 MXFP4 register tiles: `R` weight rows x `N` inputs per pass over the groups.
//!
//! Each group of a row is decoded once into registers (a 16-entry table of its pre-scaled E2M1
//! values, indexed by the codes) and shared by the `N` inputs; each group's inputs are loaded once
//! and shared by the `R` rows. Every (row, input) pair keeps its own accumulator and performs
//! exactly the lone dot's fused multiply-adds in the lone dot's order (even column, then odd, group
//! by group), so every value equals [`super::mxfp4::dot_mxfp4`] bit for bit. Sharing only turns one
//! latency-bound FMA chain into `R * N` independent ones.

use std::arch::x86_64::*;

use super::dot::reduce_lanes;
use super::dot::x86::{store16, store2};

/// One tile's operands: `R` rows' packed codes and scales (each `groups * 16` and `groups` bytes)
/// and `N` permuted inputs (each `groups * 32` floats).
pub(super) struct Tile<'a, const R: usize, const N: usize> {
    pub packed: [*const u8; R],
    pub scales: [*const u8; R],
    pub xs: [*const f32; N],
    pub groups: usize,
    /// `[256][16]` pre-scaled E2M1 values (`scaled_e2m1`).
    pub table: &'a [[f32; 16]; 256],
}

/// `out[r][t]` for the tile, on AVX-512F.
///
/// # Safety
/// AVX-512F must be available; every pointer must cover `groups` groups.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn tile_avx512<const R: usize, const N: usize>(tile: &Tile<'_, R, N>) -> [[f32; N]; R] {
    let mut acc = [[_mm512_setzero_ps(); N]; R];
    for g in 0..tile.groups {
        // SAFETY: group g is inside every operand (caller's contract).
        unsafe {
            let xe: [__m512; N] = std::array::from_fn(|t| _mm512_loadu_ps(tile.xs[t].add(32 * g)));
            let xo: [__m512; N] = std::array::from_fn(|t| _mm512_loadu_ps(tile.xs[t].add(32 * g + 16)));
            for r in 0..R {
                let lut = _mm512_loadu_ps(tile.table[*tile.scales[r].add(g) as usize].as_ptr());
                let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(tile.packed[r].add(16 * g) as *const __m128i));
                // The permute reads the low 4 bits of each index: the low nibble as it is.
                let even = _mm512_permutexvar_ps(b, lut);
                let odd = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut);
                for t in 0..N {
                    acc[r][t] = _mm512_fmadd_ps(xe[t], even, acc[r][t]);
                    acc[r][t] = _mm512_fmadd_ps(xo[t], odd, acc[r][t]);
                }
            }
        }
    }
    // SAFETY: AVX-512F is enabled here.
    std::array::from_fn(|r| std::array::from_fn(|t| reduce_lanes(&unsafe { store16(acc[r][t]) })))
}

/// `out[r][t]` for the tile, on AVX2 + FMA: lanes 0-7 (group bytes 0-7), then lanes 8-15.
///
/// # Safety
/// AVX2 and FMA must be available; every pointer must cover `groups` groups.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn tile_avx2<const R: usize, const N: usize>(tile: &Tile<'_, R, N>) -> [[f32; N]; R] {
    let mut acc = [[[_mm256_setzero_ps(); N]; R]; 2];
    for g in 0..tile.groups {
        for (h, acc) in acc.iter_mut().enumerate() {
            // SAFETY: group g is inside every operand (caller's contract).
            unsafe {
                let xe: [__m256; N] = std::array::from_fn(|t| _mm256_loadu_ps(tile.xs[t].add(32 * g + 8 * h)));
                let xo: [__m256; N] = std::array::from_fn(|t| _mm256_loadu_ps(tile.xs[t].add(32 * g + 16 + 8 * h)));
                for r in 0..R {
                    let lut = tile.table[*tile.scales[r].add(g) as usize].as_ptr();
                    let (pos, neg) = (_mm256_loadu_ps(lut), _mm256_loadu_ps(lut.add(8)));
                    let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(tile.packed[r].add(16 * g + 8 * h) as *const __m128i));
                    // The permute reads the low 3 bits of each index; the blend takes the
                    // negative half where the code's sign bit (moved to bit 31) is set.
                    let hi = _mm256_srli_epi32(b, 4);
                    let even = _mm256_blendv_ps(
                        _mm256_permutevar8x32_ps(pos, b),
                        _mm256_permutevar8x32_ps(neg, b),
                        _mm256_castsi256_ps(_mm256_slli_epi32(b, 28)),
                    );
                    let odd = _mm256_blendv_ps(
                        _mm256_permutevar8x32_ps(pos, hi),
                        _mm256_permutevar8x32_ps(neg, hi),
                        _mm256_castsi256_ps(_mm256_slli_epi32(b, 24)),
                    );
                    for t in 0..N {
                        acc[r][t] = _mm256_fmadd_ps(xe[t], even, acc[r][t]);
                        acc[r][t] = _mm256_fmadd_ps(xo[t], odd, acc[r][t]);
                    }
                }
            }
        }
    }
    // SAFETY: AVX2 is enabled here.
    std::array::from_fn(|r| std::array::from_fn(|t| reduce_lanes(&unsafe { store2(acc[0][r][t], acc[1][r][t]) })))
}
