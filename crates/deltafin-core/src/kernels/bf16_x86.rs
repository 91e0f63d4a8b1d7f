//! x86 BF16 register tiles for prompts: `R` weight rows x `N` token rows per pass.
//!
//! Each 16 weights of a row are widened once and shared by the `N` inputs; each input's 16
//! values are loaded once and shared by the `R` rows. Every (row, input) value keeps its own
//! lanes and performs exactly its lone dot's fused multiply-adds in the lone dot's order
//! (element `i` into lane `i % 16`, ascending), so it equals [`super::dot::dot_bf16`] bit for bit.
//! A tile covers a range of columns and carries its lanes in and out through memory, so a
//! prompt's tiles are cut along K (the inputs' slice stays in L1 for every row of a block) with
//! each lane's chain merely paused between blocks.

use std::arch::x86_64::*;

use super::dot::x86::store16;
use super::dot::LANES;

/// One tile's operands: `R` BF16 weight rows and `N` F32 inputs, over `cols` (element indices,
/// a multiple of 16 at both ends).
pub(super) struct Tile<const R: usize, const N: usize> {
    pub rows: [*const u8; R],
    pub xs: [*const f32; N],
    pub cols: std::ops::Range<usize>,
}

/// Lane accumulators of one tile's values, `[row][input][lane]`.
pub(super) type Lanes<const R: usize, const N: usize> = [[[f32; LANES]; N]; R];

/// Continues `acc` over the tile's columns, on AVX-512F.
///
/// # Safety
/// AVX-512F must be available; every row and input must cover the tile's columns.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn tile_avx512<const R: usize, const N: usize>(tile: &Tile<R, N>, acc_io: &mut Lanes<R, N>) {
    // SAFETY: each `[f32; 16]` is one 64-byte vector.
    let mut acc: [[__m512; N]; R] = std::array::from_fn(|r| std::array::from_fn(|t| unsafe { _mm512_loadu_ps(acc_io[r][t].as_ptr()) }));
    for i in tile.cols.clone().step_by(LANES) {
        // SAFETY: columns i..i+16 are inside every operand (caller's contract).
        unsafe {
            let x: [__m512; N] = std::array::from_fn(|t| _mm512_loadu_ps(tile.xs[t].add(i)));
            for r in 0..R {
                let h = _mm256_loadu_si256(tile.rows[r].add(2 * i) as *const __m256i);
                let w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                for t in 0..N {
                    acc[r][t] = _mm512_fmadd_ps(x[t], w, acc[r][t]);
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

/// Continues `acc` over the tile's columns, on AVX2 + FMA: lanes 0-7 over every column first,
/// then lanes 8-15 (independent chains), so one 8-lane accumulator per value fits 16 registers.
///
/// # Safety
/// AVX2 and FMA must be available; every row and input must cover the tile's columns.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn tile_avx2<const R: usize, const N: usize>(tile: &Tile<R, N>, acc_io: &mut Lanes<R, N>) {
    for h in 0..2 {
        // SAFETY: lanes 8h..8h+8 of a `[f32; 16]` are one 32-byte vector.
        let mut acc: [[__m256; N]; R] =
            std::array::from_fn(|r| std::array::from_fn(|t| unsafe { _mm256_loadu_ps(acc_io[r][t].as_ptr().add(8 * h)) }));
        for i in tile.cols.clone().step_by(LANES) {
            let i = i + 8 * h;
            // SAFETY: columns i..i+8 are inside every operand (caller's contract).
            unsafe {
                let x: [__m256; N] = std::array::from_fn(|t| _mm256_loadu_ps(tile.xs[t].add(i)));
                for r in 0..R {
                    let h = _mm_loadu_si128(tile.rows[r].add(2 * i) as *const __m128i);
                    let w = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
                    for t in 0..N {
                        acc[r][t] = _mm256_fmadd_ps(x[t], w, acc[r][t]);
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

/// Weight rows `ws` against inputs `xs` (every one `cols` long): `out[t * ws.len() + r]` =
/// `dot_bf16(xs[t], ws[r])`, bit for bit, in K-blocked register tiles. `avx512` picks the path.
///
/// # Safety
/// The chosen instruction set must be available; every row holds `2 * cols` bytes and every
/// input `cols` floats.
pub(super) unsafe fn block(avx512: bool, xs: &[&[f32]], ws: &[&[u8]], cols: usize, out: &mut [f32]) {
    let simd = cols / LANES * LANES;
    let mut t0 = 0;
    while t0 < xs.len() {
        let left = xs.len() - t0;
        // The widest tile the register file holds: AVX-512 2 rows x 8 inputs (16 of 32
        // registers accumulate), AVX2 2 x 4 (8 of 16, one half of each value at a time).
        let n = match (avx512, left) {
            (true, 8..) => 8,
            (_, 4..) => 4,
            _ => 1,
        };
        let chunk = &xs[t0..t0 + n];
        // SAFETY: forwarded from the caller.
        unsafe {
            match n {
                8 => by_rows::<8>(avx512, chunk, ws, simd, out, t0),
                4 => by_rows::<4>(avx512, chunk, ws, simd, out, t0),
                _ => by_rows::<1>(avx512, chunk, ws, simd, out, t0),
            }
        }
        t0 += n;
    }
}

/// Bytes of inputs one K block spans: with the block's weight rows and lanes it stays in L1.
const X_BLOCK_BYTES: usize = 16 << 10;

/// Every row against exactly `N` inputs (`xs[t]` is token row `t0 + t`), K block by K block,
/// then each value's tail columns and lane reduction as in its lone dot.
unsafe fn by_rows<const N: usize>(avx512: bool, xs: &[&[f32]], ws: &[&[u8]], simd: usize, out: &mut [f32], t0: usize) {
    const R: usize = 2;
    let x: [*const f32; N] = std::array::from_fn(|t| xs[t].as_ptr());
    let step = (X_BLOCK_BYTES / (N * 4)) / LANES * LANES;
    let mut lanes = vec![[[0f32; LANES]; N]; ws.len()];
    for c in (0..simd).step_by(step) {
        let cols = c..(c + step).min(simd);
        let mut r = 0;
        while r < ws.len() {
            let k = if ws.len() - r >= R { R } else { 1 };
            let acc = &mut lanes[r..r + k];
            // SAFETY: forwarded from the caller; `cols` is inside every row and input.
            unsafe {
                if k == R {
                    let tile = Tile::<R, N> { rows: std::array::from_fn(|i| ws[r + i].as_ptr()), xs: x, cols: cols.clone() };
                    run(avx512, &tile, acc.try_into().expect("R rows"));
                } else {
                    let tile = Tile::<1, N> { rows: [ws[r].as_ptr()], xs: x, cols: cols.clone() };
                    run(avx512, &tile, acc.try_into().expect("1 row"));
                }
            }
            r += k;
        }
    }
    let nrows = ws.len();
    for (r, v) in lanes.into_iter().enumerate() {
        for (t, acc) in v.into_iter().enumerate() {
            out[(t0 + t) * nrows + r] = super::dot::dot_bf16_scalar(xs[t], ws[r], simd, acc);
        }
    }
}

#[inline(always)]
unsafe fn run<const R: usize, const N: usize>(avx512: bool, tile: &Tile<R, N>, acc: &mut Lanes<R, N>) {
    // SAFETY: forwarded from the caller.
    unsafe {
        if avx512 {
            tile_avx512(tile, acc)
        } else {
            tile_avx2(tile, acc)
        }
    }
}
