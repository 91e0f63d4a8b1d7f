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

/// The AVX2 decode tables, `[scale byte][byte]`: `[0]` holds bits 16-23 of each scaled E2M1
/// value, `[1]` bits 24-31, indexed by the whole 4-bit code. Every scaled value is a BF16 (its
/// low 16 bits are zero: a code has at most two significant bits, times a power of two, and the
/// subnormal and infinite scales keep that; checked as the tables are built), so these two bytes
/// are the whole value, and a byte shuffle looks up 32 of them at once where an 8-lane permute
/// looks up 8.
fn byte_tables() -> &'static [[[u8; 16]; 2]; 256] {
    static TABLE: std::sync::LazyLock<Box<[[[u8; 16]; 2]; 256]>> = std::sync::LazyLock::new(|| {
        let scaled = super::mxfp4::scaled_e2m1();
        let mut t = Box::new([[[0u8; 16]; 2]; 256]);
        for (s, row) in t.iter_mut().enumerate() {
            for c in 0..16 {
                let bits = scaled[s][c].to_bits();
                assert_eq!(bits & 0xFFFF, 0, "scaled E2M1 value {bits:#x} is not a BF16");
                row[0][c] = (bits >> 16) as u8;
                row[1][c] = (bits >> 24) as u8;
            }
        }
        t
    });
    &TABLE
}

/// One group of one row decoded to F32 on AVX2: lanes 0-7's even columns, lanes 0-7's odd
/// columns, lanes 8-15's even, lanes 8-15's odd (each the register a permuted input's 8 floats
/// at `0`, `16`, `8`, `24` meet).
///
/// The 16 code bytes are spread to 16-bit words (bytes 0-3 and 8-11 in the low 128-bit half,
/// 4-7 and 12-15 in the high one) and split into their nibbles, low byte the even column's code
/// and high byte the odd one's; two byte shuffles look up each code's bits 16-23 and 24-31;
/// interleaving those bytes gives each lane's even and odd value side by side in one 32-bit
/// word, and a shift and a mask pull them apart. 11 operations per 32 weights, against 16 for
/// one 8-lane permute per 8 (a permute, like a byte shuffle, runs on the shuffle pipes).
///
/// `top` is [`top_halves`]: a mask the compiler cannot see through, since it would otherwise
/// turn the two ANDs into word blends, which Intel runs only on its one shuffle port, beside
/// every shuffle here (on Zen 3 the kernel bench could not tell the two apart).
///
/// # Safety
/// AVX2 must be available; `codes` must cover 16 bytes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn decode_group_avx2(codes: *const u8, table: &[[u8; 16]; 2], top: __m256i) -> [__m256; 4] {
    // SAFETY: the caller's contract; the tables are 16 bytes each.
    unsafe {
        let words = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(codes as *const __m128i)), spread_words());
        // A word holds one byte `b`: `b | b << 4` has the low nibble in bits 0-3 and the high
        // one in bits 8-11; the mask drops the rest (a shuffle index with bit 7 set reads zero).
        let nibbles = _mm256_and_si256(_mm256_or_si256(words, _mm256_slli_epi16(words, 4)), _mm256_set1_epi16(0x0F0F));
        let lo = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(table[0].as_ptr() as *const __m128i)), nibbles);
        let hi = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(table[1].as_ptr() as *const __m128i)), nibbles);
        // Word pairs (even value's top half, odd value's top half) per lane.
        let (first, second) = (_mm256_unpacklo_epi8(lo, hi), _mm256_unpackhi_epi8(lo, hi));
        [_mm256_slli_epi32(first, 16), _mm256_and_si256(first, top), _mm256_slli_epi32(second, 16), _mm256_and_si256(second, top)]
            .map(|v| _mm256_castsi256_ps(v))
    }
}

/// The byte shuffle that spreads a group's 16 code bytes to 16-bit words, bytes 0-3 and 8-11 in
/// the low 128-bit half and 4-7 and 12-15 in the high one, for [`decode_group_avx2`].
#[inline]
#[target_feature(enable = "avx2")]
fn spread_words() -> __m256i {
    _mm256_setr_epi8(
        0, -1, 1, -1, 2, -1, 3, -1, 8, -1, 9, -1, 10, -1, 11, -1, //
        4, -1, 5, -1, 6, -1, 7, -1, 12, -1, 13, -1, 14, -1, 15, -1,
    )
}

/// The mask of each 32-bit word's top 16 bits, for [`decode_group_avx2`], hidden from the
/// optimizer.
#[inline]
#[target_feature(enable = "avx2")]
fn top_halves() -> __m256i {
    std::hint::black_box(_mm256_set1_epi32(0xFFFF_0000u32 as i32))
}

/// Continues `acc` over the tile's groups, on AVX2 + FMA: each group of a row decoded once
/// ([`decode_group_avx2`]) into its 16 lanes' even and odd values, two 8-lane accumulators per
/// value. With `assembly`, a tile of 3 rows by 1 input (a token's decode) runs its whole passes
/// of groups through `mxfp4_avx2_asm`, the same operations in the same order.
///
/// # Safety
/// AVX2 and FMA must be available; every pointer must cover the tile's groups.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn tile_avx2<const R: usize, const N: usize>(tile: &Tile<'_, R, N>, acc_io: &mut Lanes<R, N>, assembly: bool) {
    use super::mxfp4_avx2_asm::{tile_3x1, GROUPS_PER_PASS};
    if assembly && R == 3 && N == 1 && tile.groups.len() >= GROUPS_PER_PASS {
        // The decode's tile, written out (`mxfp4_avx2_asm`), over whole passes; the rest here.
        let split = tile.groups.start + tile.groups.len() / GROUPS_PER_PASS * GROUPS_PER_PASS;
        // SAFETY: R is 3 and N is 1, so the casts are to the same types; the caller's contract
        // covers both halves of the groups.
        unsafe {
            let three = &*(tile as *const Tile<'_, R, N>).cast::<Tile<'_, 3, 1>>();
            let acc = &mut *(acc_io as *mut Lanes<R, N>).cast::<Lanes<3, 1>>();
            let constants = (spread_words(), _mm256_set1_epi16(0x0F0F), top_halves());
            tile_3x1(&Tile { groups: three.groups.start..split, ..*three }, byte_tables(), constants, acc);
            tile_avx2_groups(&Tile { groups: split..tile.groups.end, ..*tile }, acc_io);
        }
        return;
    }
    // SAFETY: the caller's contract.
    unsafe { tile_avx2_groups(tile, acc_io) }
}

/// [`tile_avx2`]'s loop for every tile shape.
///
/// # Safety
/// As for [`tile_avx2`].
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2_groups<const R: usize, const N: usize>(tile: &Tile<'_, R, N>, acc_io: &mut Lanes<R, N>) {
    let table = byte_tables();
    let top = top_halves();
    // SAFETY: lanes 0-7 and 8-15 of a `[f32; 16]` are two 32-byte vectors.
    let mut acc: [[[__m256; 2]; N]; R] = std::array::from_fn(|r| {
        std::array::from_fn(|t| unsafe { [_mm256_loadu_ps(acc_io[r][t].as_ptr()), _mm256_loadu_ps(acc_io[r][t].as_ptr().add(8))] })
    });
    for g in tile.groups.clone() {
        // SAFETY: group g is inside every operand (caller's contract).
        unsafe {
            prefetch_next(tile, g);
            for r in 0..R {
                let w = decode_group_avx2(tile.packed[r].add(16 * g), &table[*tile.scales[r].add(g) as usize], top);
                for t in 0..N {
                    let x = tile.xs[t].add(32 * g);
                    // Per lane: the even column, then the odd one (the lone dot's order).
                    acc[r][t][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x), w[0], acc[r][t][0]);
                    acc[r][t][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(16)), w[1], acc[r][t][0]);
                    acc[r][t][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(8)), w[2], acc[r][t][1]);
                    acc[r][t][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(24)), w[3], acc[r][t][1]);
                }
            }
        }
    }
    for (io, acc) in acc_io.iter_mut().zip(acc) {
        for (io, acc) in io.iter_mut().zip(acc) {
            // SAFETY: as for the loads above.
            unsafe {
                _mm256_storeu_ps(io.as_mut_ptr(), acc[0]);
                _mm256_storeu_ps(io.as_mut_ptr().add(8), acc[1]);
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
    let table = byte_tables();
    let top = top_halves();
    for (i, g) in groups.enumerate() {
        // SAFETY: as for `decode_row`; the decode is `tile_avx2`'s.
        unsafe {
            let w = decode_group_avx2(packed.add(16 * g), &table[*scales.add(g) as usize], top);
            for (at, w) in [0, 16, 8, 24].into_iter().zip(w) {
                _mm256_storeu_ps(out.add(32 * i + at), w);
            }
        }
    }
}
