//! x86 MXFP4 register tiles: `R` weight rows x `N` inputs per pass over the groups.
//!
//! Each group of a row is decoded once into registers (a 16-entry table of its pre-scaled E2M1
//! values, indexed by the codes) and shared by the `N` inputs; each group's inputs are loaded once
//! and shared by the `R` rows. Every (row, input) pair keeps its own accumulator and performs
//! exactly the lone dot's fused multiply-adds in the lone dot's order (even column, then odd, group
//! by group), so every value equals [`super::mxfp4::dot_mxfp4`] bit for bit. Sharing only turns one
//! latency-bound FMA chain into `R * N` independent ones.
//!
//! A tile covers a range of groups and carries each value's 16 lane accumulators in and out
//! through memory, so a prompt's tiles can be cut along K (cache blocking: the inputs' slice of
//! the row stays in L1 across all the rows) without changing any chain: a lane's additions happen
//! in the same order, merely paused between blocks.

use std::arch::x86_64::*;

use super::dot::x86::store16;
use super::dot::LANES;

/// One tile's operands: `R` rows' packed codes and scales (16 bytes and 1 byte per group) and
/// `N` permuted inputs (32 floats per group), over the groups `groups`.
pub(super) struct Tile<'a, const R: usize, const N: usize> {
    pub packed: [*const u8; R],
    pub scales: [*const u8; R],
    pub xs: [*const f32; N],
    pub groups: std::ops::Range<usize>,
    /// `[256][16]` pre-scaled E2M1 values (`scaled_e2m1`).
    pub table: &'a [[f32; 16]; 256],
    /// Bytes from each row's codes (and scales) to the same group of the next tile's row: the
    /// tile asks for those lines while it computes. A row is a few KB, too short for the
    /// hardware prefetcher to ramp up on before it ends, so a decode-sized tile over weights
    /// from DRAM would otherwise wait on each line (prefetches never fault, so past the end of
    /// the matrix is harmless).
    pub ahead: (usize, usize),
}

/// Asks for the next tile's lines of group `g`: one line of codes per row every 4 groups, one
/// line of scales every 64.
#[inline(always)]
fn prefetch_next<const R: usize, const N: usize>(tile: &Tile<'_, R, N>, g: usize) {
    if g.is_multiple_of(4) {
        for r in 0..R {
            // SAFETY: a prefetch is a hint: it reads nothing into the program and never faults,
            // whatever the address (SSE is part of x86-64).
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(tile.packed[r].wrapping_add(tile.ahead.0 + 16 * g) as *const i8);
                if g.is_multiple_of(64) {
                    _mm_prefetch::<_MM_HINT_T0>(tile.scales[r].wrapping_add(tile.ahead.1 + g) as *const i8);
                }
            }
        }
    }
}

/// Lane accumulators of one tile's values, `[row][input][lane]`.
pub(super) type Lanes<const R: usize, const N: usize> = [[[f32; LANES]; N]; R];

/// Continues `acc` over the tile's groups, on AVX-512F.
///
/// # Safety
/// AVX-512F must be available; every pointer must cover the tile's groups.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn tile_avx512<const R: usize, const N: usize>(tile: &Tile<'_, R, N>, acc_io: &mut Lanes<R, N>) {
    // SAFETY: each `[f32; 16]` is one 64-byte vector.
    let mut acc: [[__m512; N]; R] = std::array::from_fn(|r| std::array::from_fn(|t| unsafe { _mm512_loadu_ps(acc_io[r][t].as_ptr()) }));
    for g in tile.groups.clone() {
        // SAFETY: group g is inside every operand (caller's contract).
        unsafe {
            prefetch_next(tile, g);
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
    for (io, acc) in acc_io.iter_mut().zip(acc) {
        for (io, acc) in io.iter_mut().zip(acc) {
            // SAFETY: AVX-512F is enabled here.
            *io = unsafe { store16(acc) };
        }
    }
}

/// The AVX2 decode table, `[scale byte][magnitude code]`: the scaled value's bits XOR
/// `code << 28`. An 8-lane permute reads only an index's low 3 bits (the magnitude), so XOR-ing
/// the looked-up bits with the whole 4-bit code shifted to the top cancels the `code << 28` and
/// flips the sign bit exactly when the code's sign bit is set: one permute, one shift and one XOR
/// per 8 weights instead of two permutes and a blend. Exact because every E2M1 code's negative
/// is its magnitude with the sign bit flipped, scaled or not (checked as the table is built).
fn xor_table() -> &'static [[u32; 8]; 256] {
    static TABLE: std::sync::LazyLock<Box<[[u32; 8]; 256]>> = std::sync::LazyLock::new(|| {
        let scaled = super::mxfp4::scaled_e2m1();
        let mut t = Box::new([[0u32; 8]; 256]);
        for (s, row) in t.iter_mut().enumerate() {
            for (m, v) in row.iter_mut().enumerate() {
                let (pos, neg) = (scaled[s][m].to_bits(), scaled[s][m | 8].to_bits());
                // Scale byte 255 is NaN in E8M0 (the products are NaN or infinite either way).
                assert!(s == 255 || neg == pos ^ 0x8000_0000, "E2M1 negative is not a sign flip");
                *v = pos ^ ((m as u32) << 28);
            }
        }
        t
    });
    &TABLE
}

/// Continues `acc` over the tile's groups, on AVX2 + FMA.
///
/// Lane `j`'s chain touches only byte `j` of each group, so lanes 0-7 run over the tile's groups
/// first and lanes 8-15 after: one 8-lane accumulator per value at a time leaves the 16
/// registers room for more rows and inputs.
///
/// # Safety
/// AVX2 and FMA must be available; every pointer must cover the tile's groups.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn tile_avx2<const R: usize, const N: usize>(tile: &Tile<'_, R, N>, acc_io: &mut Lanes<R, N>) {
    let table = xor_table();
    for h in 0..2 {
        // SAFETY: lanes 8h..8h+8 of a `[f32; 16]` are one 32-byte vector.
        let mut acc: [[__m256; N]; R] =
            std::array::from_fn(|r| std::array::from_fn(|t| unsafe { _mm256_loadu_ps(acc_io[r][t].as_ptr().add(8 * h)) }));
        for g in tile.groups.clone() {
            // SAFETY: group g is inside every operand (caller's contract).
            unsafe {
                if h == 0 {
                    prefetch_next(tile, g);
                }
                let xe: [__m256; N] = std::array::from_fn(|t| _mm256_loadu_ps(tile.xs[t].add(32 * g + 8 * h)));
                let xo: [__m256; N] = std::array::from_fn(|t| _mm256_loadu_ps(tile.xs[t].add(32 * g + 16 + 8 * h)));
                for r in 0..R {
                    let lut = _mm256_loadu_si256(table[*tile.scales[r].add(g) as usize].as_ptr() as *const __m256i);
                    let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(tile.packed[r].add(16 * g + 8 * h) as *const __m128i));
                    let hi = _mm256_srli_epi32(b, 4);
                    let even = _mm256_xor_si256(_mm256_permutevar8x32_epi32(lut, b), _mm256_slli_epi32(b, 28));
                    let odd = _mm256_xor_si256(_mm256_permutevar8x32_epi32(lut, hi), _mm256_slli_epi32(hi, 28));
                    let (even, odd) = (_mm256_castsi256_ps(even), _mm256_castsi256_ps(odd));
                    for t in 0..N {
                        acc[r][t] = _mm256_fmadd_ps(xe[t], even, acc[r][t]);
                        acc[r][t] = _mm256_fmadd_ps(xo[t], odd, acc[r][t]);
                    }
                }
            }
        }
        for (io, acc) in acc_io.iter_mut().zip(acc) {
            for (io, acc) in io.iter_mut().zip(acc) {
                // SAFETY: as for the load above.
                unsafe { _mm256_storeu_ps(io.as_mut_ptr().add(8 * h), acc) };
            }
        }
    }
}

/// Writes one row's groups `groups` decoded to F32 into `out` (32 floats a group: its even
/// columns, then its odd ones, the layout of a permuted input), for a prompt's panel.
///
/// It first asks for the same groups of the row `ahead` bytes of codes (and `ahead / 16` of
/// scales) further on: a panel decodes a block of rows one after another, each a short run of
/// lines from the last, too short for the hardware prefetcher to ramp up on, so a matrix from
/// DRAM (an expert just read, never in cache) would otherwise wait on each row's lines.
///
/// # Safety
/// The chosen instruction set must be available; `packed` and `scales` cover the groups and
/// `out` holds `32 * groups.len()` floats.
pub(super) unsafe fn decode_row(
    avx512: bool,
    packed: *const u8,
    scales: *const u8,
    groups: std::ops::Range<usize>,
    table: &[[f32; 16]; 256],
    out: *mut f32,
    ahead: usize,
) {
    for line in (16 * groups.start..16 * groups.end).step_by(64) {
        // SAFETY: a prefetch is a hint: it reads nothing into the program and never faults,
        // whatever the address (SSE is part of x86-64).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(packed.wrapping_add(ahead + line) as *const i8) };
    }
    for line in (groups.start..groups.end).step_by(64) {
        // SAFETY: as above.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(scales.wrapping_add(ahead / 16 + line) as *const i8) };
    }
    // SAFETY: the caller's contract.
    unsafe {
        if avx512 {
            decode_avx512(packed, scales, groups, table, out)
        } else {
            decode_avx2(packed, scales, groups, out)
        }
    }
}

#[target_feature(enable = "avx512f")]
unsafe fn decode_avx512(packed: *const u8, scales: *const u8, groups: std::ops::Range<usize>, table: &[[f32; 16]; 256], out: *mut f32) {
    for (i, g) in groups.enumerate() {
        // SAFETY: as for `decode_row`; the decode is `tile_avx512`'s.
        unsafe {
            let lut = _mm512_loadu_ps(table[*scales.add(g) as usize].as_ptr());
            let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(packed.add(16 * g) as *const __m128i));
            _mm512_storeu_ps(out.add(32 * i), _mm512_permutexvar_ps(b, lut));
            _mm512_storeu_ps(out.add(32 * i + 16), _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut));
        }
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn decode_avx2(packed: *const u8, scales: *const u8, groups: std::ops::Range<usize>, out: *mut f32) {
    let table = xor_table();
    for (i, g) in groups.enumerate() {
        for h in 0..2 {
            // SAFETY: as for `decode_row`; the decode is `tile_avx2`'s.
            unsafe {
                let lut = _mm256_loadu_si256(table[*scales.add(g) as usize].as_ptr() as *const __m256i);
                let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(packed.add(16 * g + 8 * h) as *const __m128i));
                let hi = _mm256_srli_epi32(b, 4);
                let even = _mm256_xor_si256(_mm256_permutevar8x32_epi32(lut, b), _mm256_slli_epi32(b, 28));
                let odd = _mm256_xor_si256(_mm256_permutevar8x32_epi32(lut, hi), _mm256_slli_epi32(hi, 28));
                _mm256_storeu_si256(out.add(32 * i + 8 * h) as *mut __m256i, even);
                _mm256_storeu_si256(out.add(32 * i + 16 + 8 * h) as *mut __m256i, odd);
            }
        }
    }
}
