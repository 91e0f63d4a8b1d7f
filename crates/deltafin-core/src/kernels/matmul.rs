//! Row-parallel matrix products: `Y[t, r] = dot(X[t, :], W[r, :])` for every token row `t`.
//!
//! Work is split over output rows only; each output value is one dot in the fixed lane order of
//! [`dot_bf16`] (several token rows share each widened weight row through [`dot_bf16_inputs`];
//! with fewer token rows than that, several weight rows share each input through
//! [`dot_bf16_rows`]; each value still accumulated exactly as alone), so the result is identical
//! for any thread count and any number of token rows. On x86 a prompt's token rows go through
//! K-blocked register tiles (`bf16_x86`): several weight rows by several token rows, each
//! widened weight shared by the token rows and each loaded input by the weight rows.

use rayon::prelude::*;

use super::dot::{dot_bf16_inputs, dot_bf16_rows, Isa};
use crate::tensor::Mat;
use crate::weights::Bf16Matrix;

/// Output rows of the last chunks threads take (the most a core may wait on the other).
const ROWS_PER_TASK: usize = 32;
/// Output rows of the first chunks: a panel chunk reads every token row's inputs once per K
/// block, so long prompts want big ones (the panel still fits L2); and each chunk handed out
/// costs atomics whose cache lines move between the cores, too much for 32 rows of a
/// decode-sized product.
const PANEL_ROWS_PER_TASK: usize = 128;
/// Token rows walked together (32 x 28 KB of F32 inputs at K3's width: in L2).
const TOKEN_TILE: usize = 32;

/// Token rows from which several inputs share each weight row (below: rows share each input).
const SHARE_INPUTS_FROM: usize = 4;

/// Token rows from which a block's weight rows are widened once into an F32 panel that every
/// token row shares (`panel_x86`); below, register tiles widen each weight for a few inputs
/// (hand-timed on K3's shape: panels lost at 8 rows and drew even at 16).
const PANEL_FROM: usize = 32;

/// `X [t, cols] @ W[rows, cols]^T -> [t, rows]`.
pub fn matmul_bf16(x: &Mat, w: &Bf16Matrix) -> Mat {
    matmul_bf16_with(Isa::best(), x, w)
}

/// [`matmul_bf16`] on a chosen instruction set (tests compare them).
pub fn matmul_bf16_with(isa: Isa, x: &Mat, w: &Bf16Matrix) -> Mat {
    product(isa, x, w, PANEL_FROM)
}

/// [`matmul_bf16_with`] with register tiles whatever the number of token rows: the baseline the
/// kernel benchmark measures the panels against, bit-identical to it.
#[doc(hidden)]
pub fn matmul_bf16_without_panels(isa: Isa, x: &Mat, w: &Bf16Matrix) -> Mat {
    product(isa, x, w, usize::MAX)
}

/// The product, with panels from `panel_from` token rows.
fn product(isa: Isa, x: &Mat, w: &Bf16Matrix, panel_from: usize) -> Mat {
    assert_eq!(x.cols, w.cols, "matmul_bf16: inner dimensions differ");
    let t = x.rows;
    let mut out = Mat::zeros(t, w.rows);
    // Each task fills a [t, chunk] block in row-chunk order, then blocks are scattered.
    // A prompt's inputs laid on cache lines once, which every panel task reads in place (a
    // `Mat` row is `cols` floats from the next: at K3's widths, a multiple of 4 KB or half of
    // one, which puts the rows a tile streams side by side in one or two L1 sets).
    #[cfg(target_arch = "x86_64")]
    let lined = (t >= panel_from && matches!(isa.kind(), super::dot::IsaKind::Avx2 | super::dot::IsaKind::Avx512)).then(|| {
        let mut l = super::LinedRows::new(t, x.cols);
        l.par_rows_mut().enumerate().for_each(|(i, r)| r.copy_from_slice(x.row(i)));
        l
    });
    // Chunks shrink toward the end and go to whichever thread is free (`chunks`).
    let chunks = super::row_chunks(w.rows, PANEL_ROWS_PER_TASK, ROWS_PER_TASK, rayon::current_num_threads());
    let blocks: Vec<(usize, Vec<f32>)> = super::first_come(chunks, |rows| {
        let (r0, r1) = (rows.start, rows.end);
        let mut block = vec![0f32; t * (r1 - r0)];
        let ws: Vec<&[u8]> = (r0..r1).map(|r| w.row(r)).collect();
        #[cfg(target_arch = "x86_64")]
        if let (kind @ (super::dot::IsaKind::Avx2 | super::dot::IsaKind::Avx512), true) = (isa.kind(), t >= panel_from) {
            let (avx512, simd) = (kind == super::dot::IsaKind::Avx512, x.cols / super::LANES * super::LANES);
            let xs: Vec<&[f32]> = lined.as_ref().map_or_else(|| (0..t).map(|ti| x.row(ti)).collect(), |l| l.refs());
            let nrows = r1 - r0;
            let mut tails;
            let finish = if simd == x.cols {
                super::panel_x86::Finish::Sums { out: &mut block, row: 1, input: nrows }
            } else {
                // Each value's tail columns (past the last 16) and lane reduction, as alone.
                tails = |r: usize, ti: usize, lanes: &[f32; super::LANES]| {
                    block[ti * nrows + r] = super::dot::dot_bf16_scalar(xs[ti], ws[r], simd, *lanes)
                };
                super::panel_x86::Finish::Lanes(&mut tails)
            };
            // SAFETY: `isa` was made after feature detection; every row holds `2 * x.cols`
            // bytes and every input `x.cols` floats (checked above).
            unsafe {
                super::panel_x86::lanes(
                    avx512,
                    &xs,
                    nrows,
                    simd,
                    |r, k, dst| super::panel_x86::widen_bf16(avx512, &ws[r][2 * k.start..2 * k.end], dst),
                    finish,
                )
            };
            return (r0, block);
        }
        // Token rows a tile at a time: the tile's inputs stay in cache while the block's
        // weight rows pass over them (each value is still one dot).
        let mut vals = [0f32; TOKEN_TILE];
        for tile in (0..t).step_by(TOKEN_TILE) {
            let end = (tile + TOKEN_TILE).min(t);
            let xs: Vec<&[f32]> = (tile..end).map(|ti| x.row(ti)).collect();
            if xs.len() < SHARE_INPUTS_FROM {
                // Decode-sized: too few token rows to share a weight row, so weight rows
                // share each input instead (independent chains either way).
                for (ti, xr) in (tile..end).zip(&xs) {
                    dot_bf16_rows(isa, xr, &ws, &mut block[ti * (r1 - r0)..(ti + 1) * (r1 - r0)]);
                }
                continue;
            }
            #[cfg(target_arch = "x86_64")]
            if let kind @ (super::dot::IsaKind::Avx2 | super::dot::IsaKind::Avx512) = isa.kind() {
                // SAFETY: `isa` was made after feature detection; every row holds
                // `2 * x.cols` bytes (a `Bf16Matrix` of `x.cols` columns, checked above).
                unsafe { super::bf16_x86::block(kind == super::dot::IsaKind::Avx512, &xs, &ws, x.cols, &mut block[tile * (r1 - r0)..]) };
                continue;
            }
            for (r, wr) in (r0..r1).zip(&ws) {
                dot_bf16_inputs(isa, &xs, wr, &mut vals[..end - tile]);
                for (ti, v) in (tile..end).zip(vals) {
                    block[ti * (r1 - r0) + (r - r0)] = v;
                }
            }
        }
        (r0, block)
    });
    for (r0, block) in blocks {
        let width = block.len() / t.max(1);
        for ti in 0..t {
            out.row_mut(ti)[r0..r0 + width].copy_from_slice(&block[ti * width..(ti + 1) * width]);
        }
    }
    out
}
