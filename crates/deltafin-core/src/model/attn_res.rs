//! Block Attention-Residuals: the anchors of block starts plus a running partial sum.
//!
//! `mix` scores each candidate by `dot(rmsnorm_noweight(v), w_norm * w_proj)`, softmaxes over
//! candidates and returns the weighted sum of the *raw* candidates, in F32, anchors first in block
//! order, then the partial sum: one fixed order.

use crate::backend::Backend;
use crate::math::softmax_in_place;
use crate::tensor::Mat;

/// The residual stream of one forward pass over some token rows.
#[derive(Clone, Debug)]
pub struct Residual {
    /// The layer input at each block start seen so far, oldest first.
    pub anchors: Vec<Mat>,
    /// The running partial sum of the current block.
    pub partial: Mat,
}

impl Residual {
    /// Starts from the token embeddings.
    pub fn new(embeddings: Mat) -> Residual {
        Residual { anchors: Vec::new(), partial: embeddings }
    }
    /// Number of token rows.
    pub fn rows(&self) -> usize {
        self.partial.rows
    }
}

/// Mix `anchors + [partial]` per row with the effective weight `w_eff`.
pub(crate) fn mix(be: &dyn Backend, anchors: &[Mat], partial: &Mat, w_eff: &[f32], eps: f32) -> Mat {
    if anchors.is_empty() {
        return partial.clone();
    }
    let mut out = Mat::zeros(partial.rows, partial.cols);
    let mut logits = vec![0f32; anchors.len() + 1];
    for t in 0..partial.rows {
        for (k, a) in anchors.iter().enumerate() {
            let v = a.row(t);
            logits[k] = be.dot_f32(v, w_eff) * be.inv_rms(v, eps);
        }
        let p = partial.row(t);
        logits[anchors.len()] = be.dot_f32(p, w_eff) * be.inv_rms(p, eps);
        softmax_in_place(&mut logits);
        let o = out.row_mut(t);
        for (k, a) in anchors.iter().enumerate() {
            let w = logits[k];
            for (oi, vi) in o.iter_mut().zip(a.row(t)) {
                *oi += w * vi;
            }
        }
        let w = logits[anchors.len()];
        for (oi, vi) in o.iter_mut().zip(p) {
            *oi += w * vi;
        }
    }
    out
}
