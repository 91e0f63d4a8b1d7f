//! x86 prompt products over decoded panels: weights decoded once to F32, then a plain F32 tile.
//!
//! With many token rows, decoding a weight in registers for every few inputs (the register
//! tiles of `mxfp4_x86` and `bf16_x86`) spends ports on shuffles the inputs could share. Here a
//! block of weight rows is decoded once per K block into an F32 panel laid out exactly as the
//! inputs are (MXFP4: each group's even columns then its odd ones, as `permute_for_mxfp4` lays
//! the input; BF16: in order), which stays in L1 while every input passes over it. The tile then
//! is a dot-form F32 product: `R` panel rows x `N` inputs, each weight vector loaded once for the
//! `N` inputs and each input vector once for the `R` rows, and nothing but fused multiply-adds.
//!
//! Exactness: decoding is exact (an MXFP4 value is a code times a power of two; a BF16 widened
//! to F32 is itself), and every (row, input) value performs its lone dot's fused multiply-adds
//! in the lone dot's order (float `i` of the panel row into lane `i % 16`, ascending), carried
//! through memory between K blocks, so it equals the lone dot bit for bit.

use std::arch::x86_64::*;

use super::dot::LANES;
use super::lined::Line;

/// Floats of a panel row per K block: a chunk of inputs (24 KB) stays in L1 while the block's
/// panel rows (128 KB for 32 rows, in L2) stream past it. Hand-timed on K3's expert shape, 1024 ran
/// ahead of 512 and 256 (fewer lane round trips through memory).
const K_BLOCK: usize = 1024;
/// Floats from one panel row (or input of a chunk) to the next: a line more than the block, so
/// the streams a tile reads side by side fall in different L1 sets (at a power-of-two stride
/// they share one set and evict each other).
const STRIDE: usize = K_BLOCK + LANES;

/// Where each finished (row, input) value goes.
pub(super) enum Finish<'a> {
    /// Value `(r, t)`, its lanes reduced as [`super::dot::reduce_lanes`] reduces them (in the
    /// tile's registers, as the last K block ends), into `out[r * row + t * input]`.
    Sums { out: &'a mut [f32], row: usize, input: usize },
    /// Value `(r, t)`'s 16 lanes, for a caller that still adds columns past `len`.
    Lanes(&'a mut dyn FnMut(usize, usize, &[f32; LANES])),
}

/// Every (row, input) value's 16 lane accumulators over the first `len` floats (a multiple of
/// 16), from zero, delivered as `finish` says.
///
/// `decode(r, k, out)` writes row `r`'s weights for floats `k` (a multiple of 16 at both ends)
/// as F32 into `out[..k.len()]`, in the inputs' layout.
///
/// # Safety
/// AVX-512F (`avx512`) or AVX2 + FMA must be available; every input holds at least `len` floats.
pub(super) unsafe fn lanes(
    avx512: bool,
    xs: &[&[f32]],
    rows: usize,
    len: usize,
    mut decode: impl FnMut(usize, std::ops::Range<usize>, &mut [f32]),
    mut finish: Finish<'_>,
) {
    let n = xs.len();
    if let Finish::Sums { out, row, input } = &finish {
        let last = (rows.max(1) - 1) * row + (n.max(1) - 1) * input;
        assert!(rows == 0 || n == 0 || last < out.len(), "panel: value ({rows}, {n}) past the output");
    }
    SCRATCH.with_borrow_mut(|scratch| {
        // Every buffer on 64-byte lines (a vector load across two lines costs two), kept by the
        // thread between calls: a fresh panel each call cost page faults and zeroing.
        let Scratch { lanes, panel, chunk } = scratch;
        for (v, len) in [(&mut *lanes, rows * n), (&mut *panel, rows * STRIDE / LANES), (&mut *chunk, 6 * STRIDE / LANES)] {
            if v.len() < len {
                v.resize(len, Line([0.0; LANES]));
            }
        }
        let sums = match &mut finish {
            Finish::Sums { out, row, input } => Some((out.as_mut_ptr(), *row, *input)),
            Finish::Lanes(_) => None,
        };
        for k0 in (0..len).step_by(K_BLOCK) {
            let k = k0..(k0 + K_BLOCK).min(len);
            let panel = Line::floats(panel);
            for r in 0..rows {
                decode(r, k.clone(), &mut panel[r * STRIDE..r * STRIDE + k.len()]);
            }
            let at = Block {
                panel: panel.as_ptr(),
                k: k.clone(),
                lanes: lanes.as_mut_ptr() as *mut [f32; LANES],
                n,
                first: k0 == 0,
                sums: if k.end == len { sums } else { None },
            };
            // Inputs in chunks the register file holds (AVX-512: 4 rows x up to 6 inputs, 24 of
            // 32 registers accumulating; AVX2: 2 rows x up to 4 inputs of 8-lane halves, 8 of 16).
            // Chunks as even as the widest allows (85 inputs: 10 of 6 and 5 of 5, not 14 of 6 and
            // a lone input, whose tiles load 5 vectors per 4 FMAs).
            let widest = if avx512 { 6 } else { 4 };
            let chunks = n.div_ceil(widest);
            let mut t0 = 0;
            for c in 0..chunks {
                let m = n / chunks + usize::from(c < n % chunks);
                let chunk = Line::floats(chunk);
                let x = chunk.as_ptr();
                let mut xp: [*const f32; 6] = std::array::from_fn(|t| x.wrapping_add(t * STRIDE));
                if lined(&xs[t0..t0 + m], k0) {
                    // Already on lines, in distinct L1 sets: read in place (no copy per task).
                    for t in 0..m {
                        xp[t] = xs[t0 + t][k0..].as_ptr();
                    }
                } else {
                    // The chunk's inputs, copied onto aligned lines (in L1 for every row).
                    for t in 0..m {
                        chunk[t * STRIDE..t * STRIDE + k.len()].copy_from_slice(&xs[t0 + t][k.clone()]);
                    }
                }
                // SAFETY: forwarded from the caller; the block's floats are inside every input
                // and the panel, and its values inside `lanes` and the sums.
                unsafe {
                    match (avx512, m) {
                        (true, 6) => at.rows::<4, 6>(true, rows, t0, xp),
                        (true, 5) => at.rows::<4, 5>(true, rows, t0, xp),
                        (true, 4) => at.rows::<4, 4>(true, rows, t0, xp),
                        (true, 3) => at.rows::<4, 3>(true, rows, t0, xp),
                        (true, 2) => at.rows::<4, 2>(true, rows, t0, xp),
                        (true, _) => at.rows::<4, 1>(true, rows, t0, xp),
                        (false, 4) => at.rows::<2, 4>(false, rows, t0, xp),
                        (false, 3) => at.rows::<2, 3>(false, rows, t0, xp),
                        (false, 2) => at.rows::<2, 2>(false, rows, t0, xp),
                        (false, _) => at.rows::<2, 1>(false, rows, t0, xp),
                    }
                }
                t0 += m;
            }
        }
        match finish {
            Finish::Sums { out, row, input } => {
                if len == 0 {
                    for r in 0..rows {
                        for t in 0..n {
                            out[r * row + t * input] = super::dot::reduce_lanes(&[0.0; LANES]);
                        }
                    }
                }
            }
            Finish::Lanes(f) => {
                if len == 0 {
                    lanes[..rows * n].fill(Line([0.0; LANES]));
                }
                for r in 0..rows {
                    for t in 0..n {
                        f(r, t, &lanes[r * n + t].0);
                    }
                }
            }
        }
    });
}

/// Whether the inputs' floats from `k0` start on 64-byte lines that fall in distinct L1 sets
/// (64 sets of 64-byte lines), so a tile can stream them in place without their lines evicting
/// each other.
fn lined(xs: &[&[f32]], k0: usize) -> bool {
    let mut sets = 0u64;
    for x in xs {
        let at = x[k0..].as_ptr() as usize;
        let set = 1u64 << ((at >> 6) & 63);
        if !at.is_multiple_of(64) || sets & set != 0 {
            return false;
        }
        sets |= set;
    }
    true
}

/// A thread's buffers: lanes of every value, the decoded panel, one chunk of inputs.
#[derive(Default)]
struct Scratch {
    lanes: Vec<Line>,
    panel: Vec<Line>,
    chunk: Vec<Line>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// One K block of decoded panel rows against the inputs, and where its values' lanes live.
struct Block {
    panel: *const f32,
    k: std::ops::Range<usize>,
    lanes: *mut [f32; LANES],
    n: usize,
    /// The first K block: lanes start at zero, not from memory.
    first: bool,
    /// The last K block with [`Finish::Sums`]: each value goes, reduced, to
    /// `sums.0[r * sums.1 + t * sums.2]` instead of back to its lanes.
    sums: Option<(*mut f32, usize, usize)>,
}

impl Block {
    /// Every panel row, `R` at a time (the tail one at a time), against inputs `t0..t0 + N`
    /// (the block's floats of input `t0 + t` at `xp[t]`).
    #[inline(always)]
    unsafe fn rows<const R: usize, const N: usize>(&self, avx512: bool, rows: usize, t0: usize, xp: [*const f32; 6]) {
        let x: [*const f32; N] = std::array::from_fn(|t| xp[t]);
        let mut r = 0;
        while r < rows {
            // SAFETY: forwarded from `lanes`.
            unsafe {
                if rows - r >= R {
                    self.tile::<R, N>(avx512, r, t0, x);
                    r += R;
                } else {
                    self.tile::<1, N>(avx512, r, t0, x);
                    r += 1;
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn tile<const R: usize, const N: usize>(&self, avx512: bool, r0: usize, t0: usize, x: [*const f32; N]) {
        // SAFETY: row r0 + i of the panel holds the block's floats; value (r0 + i, t0 + t) is
        // inside `lanes` (rows * n of them).
        unsafe {
            let w: [*const f32; R] = std::array::from_fn(|i| self.panel.add((r0 + i) * STRIDE));
            let acc: [[*mut f32; N]; R] =
                std::array::from_fn(|i| std::array::from_fn(|t| self.lanes.add((r0 + i) * self.n + t0 + t) as *mut f32));
            let sums: Option<[[*mut f32; N]; R]> = self
                .sums
                .map(|(out, row, input)| std::array::from_fn(|i| std::array::from_fn(|t| out.add((r0 + i) * row + (t0 + t) * input))));
            if avx512 {
                tile_avx512(w, x, self.k.len(), acc, self.first, sums)
            } else {
                tile_avx2(w, x, self.k.len(), acc, self.first, sums)
            }
        }
    }
}

/// `R` panel rows x `N` inputs over `len` floats, each value's 16 lanes continued in `acc`
/// (from zero where `first`), or with `sums` the values reduced into them.
///
/// # Safety
/// AVX-512F must be available; every row and input holds `len` floats (a multiple of 16),
/// every `acc` points at 16 floats and every `sums` at one.
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512<const R: usize, const N: usize>(
    w: [*const f32; R],
    x: [*const f32; N],
    len: usize,
    acc: [[*mut f32; N]; R],
    first: bool,
    sums: Option<[[*mut f32; N]; R]>,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let mut a: [[__m512; N]; R] =
            std::array::from_fn(|r| std::array::from_fn(|t| if first { _mm512_setzero_ps() } else { _mm512_loadu_ps(acc[r][t]) }));
        for i in (0..len).step_by(LANES) {
            let wv: [__m512; R] = std::array::from_fn(|r| _mm512_loadu_ps(w[r].add(i)));
            for t in 0..N {
                let xv = _mm512_loadu_ps(x[t].add(i));
                for r in 0..R {
                    a[r][t] = _mm512_fmadd_ps(xv, wv[r], a[r][t]);
                }
            }
        }
        for r in 0..R {
            for t in 0..N {
                match sums {
                    Some(s) => *s[r][t] = reduce16(a[r][t]),
                    None => _mm512_storeu_ps(acc[r][t], a[r][t]),
                }
            }
        }
    }
}

/// A value's 16 lanes reduced in [`super::dot::reduce_lanes`]'s order: `a[j] = lane j +
/// lane j + 8`, then `a[j] + a[j + 4]`, `b[j] + b[j + 2]`, `c[0] + c[1]`.
///
/// Only 512-bit operations: a 256- or 128-bit view of an accumulator needs AVX-512VL to stay in
/// registers 16-31, so without it the compiler keeps every accumulator in the lower 16 and
/// spilled 6 of a 4 x 6 tile's 24 to the stack inside the loop.
#[inline]
#[target_feature(enable = "avx512f")]
fn reduce16(v: __m512) -> f32 {
    // Lanes 0-7 get lanes 8-15 (128-bit blocks 2, 3), then 0-3 get 4-7 (block 1).
    let a = _mm512_add_ps(v, _mm512_shuffle_f32x4::<0b11_10_11_10>(v, v));
    let b = _mm512_add_ps(a, _mm512_shuffle_f32x4::<0b01_01_01_01>(a, a));
    // Within the block: lanes 0, 1 get lanes 2, 3, then lane 0 gets lane 1.
    let c = _mm512_add_ps(b, _mm512_permute_ps::<0b11_10_11_10>(b));
    _mm512_cvtss_f32(_mm512_add_ps(c, _mm512_permute_ps::<0b01_01_01_01>(c)))
}

/// As [`reduce16`] on AVX2, lanes 0-7 in `lo` and 8-15 in `hi`.
#[inline]
#[target_feature(enable = "avx2")]
fn reduce_halves(lo: __m256, hi: __m256) -> f32 {
    let a = _mm256_add_ps(lo, hi);
    let b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
    let c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps::<1>(c, c)))
}

/// As [`tile_avx512`] on AVX2 + FMA: lanes 0-7 over the block, then lanes 8-15 (independent
/// chains), so one 8-lane accumulator per value fits 16 registers.
///
/// # Safety
/// AVX2 and FMA must be available; otherwise as [`tile_avx512`].
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const R: usize, const N: usize>(
    w: [*const f32; R],
    x: [*const f32; N],
    len: usize,
    acc: [[*mut f32; N]; R],
    first: bool,
    sums: Option<[[*mut f32; N]; R]>,
) {
    // SAFETY: the caller's contract.
    unsafe {
        for h in [0, 8] {
            let mut a: [[__m256; N]; R] = std::array::from_fn(|r| {
                std::array::from_fn(|t| if first { _mm256_setzero_ps() } else { _mm256_loadu_ps(acc[r][t].add(h)) })
            });
            for i in (h..len).step_by(LANES) {
                let wv: [__m256; R] = std::array::from_fn(|r| _mm256_loadu_ps(w[r].add(i)));
                for t in 0..N {
                    let xv = _mm256_loadu_ps(x[t].add(i));
                    for r in 0..R {
                        a[r][t] = _mm256_fmadd_ps(xv, wv[r], a[r][t]);
                    }
                }
            }
            for r in 0..R {
                for t in 0..N {
                    match sums {
                        // Lanes 0-7 went to `acc` in the first pass.
                        Some(s) if h == 8 => *s[r][t] = reduce_halves(_mm256_loadu_ps(acc[r][t]), a[r][t]),
                        _ => _mm256_storeu_ps(acc[r][t].add(h), a[r][t]),
                    }
                }
            }
        }
    }
}

/// Writes BF16 weights `src` (2 bytes each, a multiple of 16 of them) widened to F32 into `out`.
///
/// # Safety
/// The chosen instruction set must be available; `out` holds `src.len() / 2` floats.
pub(super) unsafe fn widen_bf16(avx512: bool, src: &[u8], out: &mut [f32]) {
    debug_assert!(out.len() * 2 == src.len() && out.len().is_multiple_of(LANES));
    // SAFETY: the caller's contract; each step reads 32 bytes and writes 16 floats in bounds.
    unsafe {
        if avx512 {
            widen_avx512(src, out)
        } else {
            widen_avx2(src, out)
        }
    }
}

#[target_feature(enable = "avx512f")]
unsafe fn widen_avx512(src: &[u8], out: &mut [f32]) {
    for i in (0..out.len()).step_by(LANES) {
        // SAFETY: floats i..i+16 are inside `out`, bytes 2i..2i+32 inside `src` (checked by the caller).
        unsafe {
            let h = _mm256_loadu_si256(src.as_ptr().add(2 * i) as *const __m256i);
            _mm512_storeu_si512(out.as_mut_ptr().add(i) as *mut __m512i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        }
    }
}

#[target_feature(enable = "avx2")]
unsafe fn widen_avx2(src: &[u8], out: &mut [f32]) {
    for i in (0..out.len()).step_by(8) {
        // SAFETY: as for `widen_avx512`, 8 at a time.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(2 * i) as *const __m128i);
            _mm256_storeu_si256(out.as_mut_ptr().add(i) as *mut __m256i, _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
    }
}
