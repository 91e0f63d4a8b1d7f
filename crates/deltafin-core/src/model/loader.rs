//! Fetching typed spine tensors by their release names, with shape checks that name the tensor.

use crate::error::Result;
use crate::weights::{Bf16Matrix, DType, TensorSource};

/// A tensor source plus the name prefix of one module (`language_model.model.layers.3.`).
pub(crate) struct Loader<'a> {
    pub src: &'a dyn TensorSource,
    pub prefix: String,
}

impl<'a> Loader<'a> {
    pub fn new(src: &'a dyn TensorSource, prefix: impl Into<String>) -> Self {
        Loader { src, prefix: prefix.into() }
    }
    pub fn sub(&self, part: &str) -> Loader<'a> {
        Loader { src: self.src, prefix: format!("{}{part}", self.prefix) }
    }
    /// A BF16 `[rows, cols]` matrix.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Bf16Matrix> {
        Bf16Matrix::from_tensor(self.src.tensor(&format!("{}{name}", self.prefix))?, rows, cols)
    }
    /// A BF16 vector widened to F32 (norm weights: small).
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        Ok(self.src.tensor(&format!("{}{name}", self.prefix))?.expect(DType::Bf16, &[len])?.to_f32_vec())
    }
    /// A vector stored as BF16 or F32, widened to F32 (a dtype the release has not been seen to
    /// fix: K3.1's indexer norm).
    pub fn vector_bf16_or_f32(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let t = self.src.tensor(&format!("{}{name}", self.prefix))?;
        let dtype = if t.dtype == DType::F32 { DType::F32 } else { DType::Bf16 };
        Ok(t.expect(dtype, &[len])?.to_f32_vec())
    }
    /// An F32 tensor of exactly this shape.
    pub fn f32_tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        Ok(self.src.tensor(&format!("{}{name}", self.prefix))?.expect(DType::F32, shape)?.to_f32_vec())
    }
    /// An F32 tensor with at least `min` elements in any shape (A_log is stored padded).
    pub fn f32_at_least(&self, name: &str, min: usize) -> Result<Vec<f32>> {
        let t = self.src.tensor(&format!("{}{name}", self.prefix))?;
        let numel: usize = t.shape.iter().product();
        if t.dtype != DType::F32 || numel < min {
            return Err(crate::Error::BadTensor {
                name: t.name,
                file: t.file,
                expected: format!("F32 with at least {min} elements"),
                found: format!("{:?} {:?}", t.dtype, t.shape),
            });
        }
        Ok(t.to_f32_vec())
    }
    /// `w_norm * w_proj` of an Attention-Residual mix (`{norm}` [hidden] and `{proj}` [1, hidden]).
    pub fn res_mix(&self, base: &str, hidden: usize) -> Result<Vec<f32>> {
        let norm = self.vector(&format!("{base}_norm.weight"), hidden)?;
        let proj = self.matrix(&format!("{base}_proj.weight"), 1, hidden)?.row_f32(0);
        Ok(norm.iter().zip(&proj).map(|(a, b)| a * b).collect())
    }
}
