//! MXFP4 dequantize-and-multiply straight from the stored expert bytes.
//!
//! Layout as in the checkpoint: `packed` U8 `[rows, cols/2]` of E2M1 codes (low nibble = even
//! column, bit 3 = sign) and `scale` U8 `[rows, cols/32]` of E8M0 exponents (`2^(s-127)`).
//! A group of 32 columns is 16 bytes; byte `j` of a group feeds lane `j`: first its even column,
//! then its odd column. The input vector is permuted once per token by [`permute_for_mxfp4`] so
//! that both halves load contiguously. Each weight is dequantized exactly (`code * 2^(s-127)` is
//! representable in F32) and fused-multiply-added, so the scalar and SIMD kernels agree bit for bit.

use super::dot::{reduce_lanes, Isa, IsaKind, LANES};
#[cfg(target_arch = "x86_64")]
use super::mxfp4_x86::{decode_row, tile_avx2, tile_avx512, Tile};

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
    let mut out = vec![0f32; x.len()];
    permute_for_mxfp4_into(x, &mut out);
    out
}

/// [`permute_for_mxfp4`] into `out` (as long as `x`).
pub fn permute_for_mxfp4_into(x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len() % 32, 0, "MXFP4 input length must be a multiple of 32");
    assert_eq!(out.len(), x.len(), "permute_for_mxfp4_into: output length differs");
    for (chunk, out) in x.chunks_exact(32).zip(out.chunks_exact_mut(32)) {
        for j in 0..16 {
            out[j] = chunk[2 * j];
            out[16 + j] = chunk[2 * j + 1];
        }
    }
}

/// The E2M1 values times each E8M0 scale, `[scale byte][code]`: every kernel multiplies by
/// these same products (exact: a code times a power of two), so they agree bit for bit.
pub(crate) fn scaled_e2m1() -> &'static [[f32; 16]; 256] {
    static TABLE: std::sync::LazyLock<Box<[[f32; 16]; 256]>> = std::sync::LazyLock::new(|| {
        let mut t = Box::new([[0f32; 16]; 256]);
        for (s, row) in t.iter_mut().enumerate() {
            for (c, v) in row.iter_mut().enumerate() {
                *v = E2M1[c] * e8m0_scale(s as u8);
            }
        }
        t
    });
    &TABLE
}

/// One row: `sum_c x[c] * W[c]` with `xp` from [`permute_for_mxfp4`], `packed` of `cols/2` bytes
/// and `scales` of `cols/32` bytes.
pub fn dot_mxfp4(isa: Isa, xp: &[f32], packed: &[u8], scales: &[u8]) -> f32 {
    let mut out = [0f32];
    dot_mxfp4_inputs(isa, &[xp], packed, scales, &mut out);
    out[0]
}

/// One row against several inputs: `out[t]` = [`dot_mxfp4`]`(xs[t], packed, scales)`, bit for bit
/// (each group decoded once for all of them).
pub fn dot_mxfp4_inputs(isa: Isa, xs: &[&[f32]], packed: &[u8], scales: &[u8], out: &mut [f32]) {
    let w = Mxfp4Matrix::new(1, scales.len() * 32, packed, scales).expect("dot_mxfp4_inputs: packed and scale lengths differ");
    matmul_mxfp4(isa, xs, &w, 0..1, out);
}

/// Weight rows `rows` of `w` against every input: `out[(r - rows.start) * xs.len() + t]` =
/// [`dot_mxfp4`]`(xs[t], row r)`, bit for bit, whatever the number of rows and inputs.
///
/// The SIMD paths walk register tiles of several rows by several inputs: each group of a row is
/// decoded once for all the tile's inputs, each input's group loaded once for all its rows, and
/// every value keeps its lone dot's own chain of fused multiply-adds (`mxfp4_x86`). Threads are
/// the caller's: this is one task's block.
pub fn matmul_mxfp4(isa: Isa, xs: &[&[f32]], w: &Mxfp4Matrix, rows: std::ops::Range<usize>, out: &mut [f32]) {
    product(isa, xs, w, rows, out, true)
}

/// [`matmul_mxfp4`] with the compiler's AVX2 tile where it takes the decode's one written in
/// assembly (`mxfp4_avx2_asm`): the same bits, for benchmarks to set the two side by side.
pub fn matmul_mxfp4_without_assembly(isa: Isa, xs: &[&[f32]], w: &Mxfp4Matrix, rows: std::ops::Range<usize>, out: &mut [f32]) {
    product(isa, xs, w, rows, out, false)
}

/// [`matmul_mxfp4`], with or without the assembly tile.
fn product(isa: Isa, xs: &[&[f32]], w: &Mxfp4Matrix, rows: std::ops::Range<usize>, out: &mut [f32], assembly: bool) {
    assert!(rows.end <= w.rows, "matmul_mxfp4: rows {rows:?} past {}", w.rows);
    assert_eq!(out.len(), rows.len() * xs.len(), "matmul_mxfp4: one output per row and input");
    for x in xs {
        assert_eq!(x.len(), w.cols, "matmul_mxfp4: input length differs from the matrix width");
    }
    let table = scaled_e2m1();
    match isa.kind() {
        #[cfg(target_arch = "x86_64")]
        IsaKind::Avx512 | IsaKind::Avx2 => {
            tiles::run(isa.kind(), isa.prompt_kernel() == super::dot::PromptKernel::Panels, assembly, xs, w, rows, out, table)
        }
        #[cfg(target_arch = "aarch64")]
        IsaKind::Neon => each_value(xs, w, rows, out, |x, p, s| {
            // SAFETY: NEON is only selected after feature detection; lengths checked above.
            unsafe { super::neon::dot_mxfp4_neon(x, p, s) }
        }),
        _ => {
            let _ = assembly;
            each_value(xs, w, rows, out, |x, p, s| dot_mxfp4_scalar(x, p, s, table))
        }
    }
}

/// One dot per value, for the paths without tiles.
fn each_value(xs: &[&[f32]], w: &Mxfp4Matrix, rows: std::ops::Range<usize>, out: &mut [f32], dot: impl Fn(&[f32], &[u8], &[u8]) -> f32) {
    let t = xs.len();
    for (i, r) in rows.enumerate() {
        let (p, s) = w.row_bytes(r);
        for (o, x) in out[i * t..(i + 1) * t].iter_mut().zip(xs) {
            *o = dot(x, p, s);
        }
    }
}

fn dot_mxfp4_scalar(xp: &[f32], packed: &[u8], scales: &[u8], table: &[[f32; 16]; 256]) -> f32 {
    let mut acc = [0f32; LANES];
    for (g, &s) in scales.iter().enumerate() {
        let lut = &table[s as usize];
        let bytes = &packed[16 * g..16 * g + 16];
        let x = &xp[32 * g..32 * g + 32];
        for j in 0..16 {
            let b = bytes[j];
            acc[j] = x[j].mul_add(lut[(b & 15) as usize], acc[j]);
            acc[j] = x[16 + j].mul_add(lut[(b >> 4) as usize], acc[j]);
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

/// Tile shapes per instruction set and input count, and the walk over a block.
#[cfg(target_arch = "x86_64")]
mod tiles {
    use super::*;
    use crate::kernels::mxfp4_x86::Lanes;

    /// Inputs from which a block's rows are decoded once into an F32 panel that every input
    /// shares (`panel_x86`); below, each tile decodes its groups in registers (hand-timed on
    /// K3's expert shape: panels lost at 8 inputs and drew even at 16; the kernel bench
    /// measures both at 64 and 512).
    pub(crate) const PANEL_FROM: usize = 32;

    /// Rows ahead whose codes a panel's decode asks for (`decode_row`).
    const AHEAD_ROWS: usize = 2;

    /// Bytes of the inputs one K block spans: with the block's weight rows and lane
    /// accumulators it stays in L1 while every row of the block passes over it.
    const X_BLOCK_BYTES: usize = 16 << 10;

    #[allow(clippy::too_many_arguments)]
    pub(super) fn run(
        kind: IsaKind,
        panels: bool,
        assembly: bool,
        xs: &[&[f32]],
        w: &Mxfp4Matrix,
        rows: std::ops::Range<usize>,
        out: &mut [f32],
        table: &[[f32; 16]; 256],
    ) {
        let t = xs.len();
        if panels && t >= PANEL_FROM {
            let avx512 = kind == IsaKind::Avx512;
            // SAFETY: `kind` comes from an `Isa` (made only after feature detection); every
            // input holds `w.cols` floats and every row `w.cols / 32` groups (checked by
            // `matmul_mxfp4`), and the panel asks for whole groups.
            unsafe {
                crate::kernels::panel_x86::lanes(
                    avx512,
                    xs,
                    rows.len(),
                    w.cols,
                    |r, k, dst| {
                        let (p, s) = w.row_bytes(rows.start + r);
                        decode_row(
                            avx512,
                            p.as_ptr(),
                            s.as_ptr(),
                            k.start / 32..k.end / 32,
                            table,
                            dst.as_mut_ptr(),
                            AHEAD_ROWS * w.cols / 2,
                        )
                    },
                    crate::kernels::panel_x86::Finish::Sums { out, row: t, input: 1 },
                )
            };
            return;
        }
        // Tiles of up to 4 inputs: each decoded group feeds 8 FMAs per row against the decode's
        // 3-4 shuffles, and 4 rows x 4 inputs of accumulators leave AVX-512 room for the inputs
        // (6 and 8 inputs were tried by hand this session and were not faster).
        let n = 4;
        for (c, chunk) in xs.chunks(n).enumerate() {
            let cols = c * n..c * n + chunk.len();
            let a = (kind, assembly, chunk, w, rows.clone(), &mut *out, t, cols, table);
            // Accumulators fill the register file: AVX-512 has 32 vector registers, AVX2 16,
            // where each value takes two and the inputs are read from L1 by the FMAs. AVX2's
            // shapes were picked on Zen 3 by timing builds changed by hand (not kept): 3 rows x
            // 1 input led 2 to 6 rows, and 1 x 4 led 2 x 4, whose 16 accumulators spill.
            match (kind, chunk.len()) {
                (IsaKind::Avx512, 1) => by_rows::<8, 1>(a),
                (IsaKind::Avx512, 2) => by_rows::<6, 2>(a),
                (IsaKind::Avx512, 3) => by_rows::<4, 3>(a),
                (IsaKind::Avx512, _) => by_rows::<4, 4>(a),
                (_, 1) => by_rows::<3, 1>(a),
                (_, 2) => by_rows::<2, 2>(a),
                (_, 3) => by_rows::<1, 3>(a),
                (_, _) => by_rows::<1, 4>(a),
            }
        }
    }

    type Args<'a, 'b> = (
        IsaKind,
        bool,
        &'a [&'a [f32]],
        &'a Mxfp4Matrix<'a>,
        std::ops::Range<usize>,
        &'b mut [f32],
        usize,
        std::ops::Range<usize>,
        &'a [[f32; 16]; 256],
    );

    /// `rows` in tiles of `R` (the tail one row at a time) against exactly `N` inputs, K block by
    /// K block, written to `out[(r - rows.start) * stride + cols]`.
    fn by_rows<const R: usize, const N: usize>((kind, assembly, xs, w, rows, out, stride, cols, table): Args<'_, '_>) {
        let x: [*const f32; N] = std::array::from_fn(|t| xs[t].as_ptr());
        let groups = w.cols / 32;
        let block = (X_BLOCK_BYTES / (N * 32 * 4)).max(4);
        let mut lanes = vec![[[0f32; LANES]; N]; rows.len()];
        for g in (0..groups).step_by(block) {
            let span = g..(g + block).min(groups);
            let mut i = 0;
            while i < rows.len() {
                let r = if rows.len() - i >= R { R } else { 1 };
                let acc = &mut lanes[i..i + r];
                if r == R {
                    tile::<R, N>(kind, assembly, w, rows.start + i, x, span.clone(), table, acc.try_into().expect("R rows"));
                } else {
                    tile::<1, N>(kind, assembly, w, rows.start + i, x, span.clone(), table, acc.try_into().expect("1 row"));
                }
                i += r;
            }
        }
        for (i, v) in lanes.iter().enumerate() {
            for (o, acc) in out[i * stride + cols.start..][..N].iter_mut().zip(v) {
                *o = reduce_lanes(acc);
            }
        }
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn tile<const R: usize, const N: usize>(
        kind: IsaKind,
        assembly: bool,
        w: &Mxfp4Matrix,
        r: usize,
        xs: [*const f32; N],
        groups: std::ops::Range<usize>,
        table: &[[f32; 16]; 256],
        acc: &mut Lanes<R, N>,
    ) {
        let tile = Tile::<R, N> {
            packed: std::array::from_fn(|i| w.row_bytes(r + i).0.as_ptr()),
            scales: std::array::from_fn(|i| w.row_bytes(r + i).1.as_ptr()),
            xs,
            groups,
            table,
            ahead: (R * w.cols / 2, R * w.cols / 32),
        };
        // SAFETY: `kind` comes from an `Isa` (made only after feature detection); every row and
        // input holds `w.cols` columns (checked by `matmul_mxfp4`), which cover `groups`.
        unsafe {
            match kind {
                IsaKind::Avx512 => tile_avx512(&tile, acc),
                _ => tile_avx2(&tile, acc, assembly),
            }
        }
    }
}
