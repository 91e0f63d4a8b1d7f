//! `Mat`: a row-major F32 activation matrix, one row per token.
//!
//! Activations are small (tokens x hidden) and always F32, so a plain `Vec<f32>` with a row
//! stride is all the engine needs; weights never live here.

use rayon::prelude::*;

/// Rows from which [`Mat::for_each_row`] hands rows to every core: a prompt's many rows, not
/// decode's few (waking a thread costs more than a decode row's work).
const PAR_ROWS: usize = 32;

/// A row-major `[rows, cols]` F32 matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct Mat {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Mat {
    /// All zeros.
    pub fn zeros(rows: usize, cols: usize) -> Mat {
        Mat { rows, cols, data: vec![0.0; rows * cols] }
    }
    /// Wraps a vector of `rows * cols` values.
    pub fn from_vec(rows: usize, cols: usize, data: Vec<f32>) -> Mat {
        assert_eq!(data.len(), rows * cols, "Mat::from_vec: wrong length");
        Mat { rows, cols, data }
    }
    /// Row `r`.
    #[inline]
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
    /// Row `r`, mutable.
    #[inline]
    pub fn row_mut(&mut self, r: usize) -> &mut [f32] {
        &mut self.data[r * self.cols..(r + 1) * self.cols]
    }
    /// `f(r, row r)` for every row: on every core from [`PAR_ROWS`] rows, else on this thread.
    /// Each row is its own work, so the result does not depend on which core ran it.
    pub fn for_each_row(&mut self, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
        // `max(1)`: chunks need a nonzero size even for a matrix without columns.
        let cols = self.cols.max(1);
        if self.rows >= PAR_ROWS {
            self.data.par_chunks_mut(cols).enumerate().for_each(|(r, row)| f(r, row));
        } else {
            self.data.chunks_mut(cols).enumerate().for_each(|(r, row)| f(r, row));
        }
    }
    /// The rows `[start, start + n)` as a new matrix.
    pub fn rows_range(&self, start: usize, n: usize) -> Mat {
        Mat::from_vec(n, self.cols, self.data[start * self.cols..(start + n) * self.cols].to_vec())
    }
    /// Selected rows, in the given order.
    pub fn gather(&self, rows: &[usize]) -> Mat {
        let mut data = Vec::with_capacity(rows.len() * self.cols);
        for &r in rows {
            data.extend_from_slice(self.row(r));
        }
        Mat::from_vec(rows.len(), self.cols, data)
    }
    /// Appends the rows of `other` (same width).
    pub fn append(&mut self, other: &Mat) {
        assert_eq!(self.cols, other.cols);
        self.data.extend_from_slice(&other.data);
        self.rows += other.rows;
    }
    /// Element-wise `self += other`.
    pub fn add_assign(&mut self, other: &Mat) {
        assert_eq!(self.data.len(), other.data.len());
        for (a, b) in self.data.iter_mut().zip(&other.data) {
            *a += b;
        }
    }
}
