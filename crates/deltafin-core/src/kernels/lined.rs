//! Token rows laid on cache lines, for the prompt kernels to read in place.
//!
//! A prompt's panel tiles stream several inputs side by side. Rows that each start on a 64-byte
//! line and sit an odd number of lines apart fall in distinct L1 sets (64 of them), so the panel
//! kernels read them where they are instead of copying each K block onto lines first, which
//! they would do once per task, for every task of the product.

use rayon::prelude::*;

use super::LANES;

/// One cache line of floats.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
pub(crate) struct Line(pub(crate) [f32; LANES]);

impl Line {
    /// The lines as floats.
    pub(crate) fn floats(v: &mut [Line]) -> &mut [f32] {
        // SAFETY: a `Line` is 16 floats with no padding (64 bytes, aligned to 64).
        unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut f32, v.len() * LANES) }
    }
}

/// `rows` rows of `cols` floats, each starting on a line, an odd number of lines apart.
pub struct LinedRows {
    lines: Vec<Line>,
    rows: usize,
    cols: usize,
    /// Floats from one row to the next.
    stride: usize,
}

impl LinedRows {
    /// Zeroed rows.
    pub fn new(rows: usize, cols: usize) -> LinedRows {
        let lines_per_row = cols.div_ceil(LANES) | 1;
        LinedRows { lines: vec![Line::default(); rows * lines_per_row], rows, cols, stride: lines_per_row * LANES }
    }

    /// How many rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        assert!(i < self.rows, "row {i} of {}", self.rows);
        // SAFETY: as `Line::floats`, shared.
        let all = unsafe { std::slice::from_raw_parts(self.lines.as_ptr() as *const f32, self.lines.len() * LANES) };
        &all[i * self.stride..i * self.stride + self.cols]
    }

    /// Row `i`, mutable.
    pub fn row_mut(&mut self, i: usize) -> &mut [f32] {
        assert!(i < self.rows, "row {i} of {}", self.rows);
        let (stride, cols) = (self.stride, self.cols);
        &mut Line::floats(&mut self.lines)[i * stride..i * stride + cols]
    }

    /// Every row, in order.
    pub fn refs(&self) -> Vec<&[f32]> {
        (0..self.rows).map(|i| self.row(i)).collect()
    }

    /// Every row, mutable, for threads to fill.
    pub fn par_rows_mut(&mut self) -> impl IndexedParallelIterator<Item = &mut [f32]> {
        let (stride, cols) = (self.stride, self.cols);
        // `max(1)`: rayon's chunks need a nonzero size even when there are no rows.
        Line::floats(&mut self.lines).par_chunks_mut(stride.max(1)).map(move |r| &mut r[..cols])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_start_on_lines_in_distinct_sets() {
        for cols in [1, 16, 1024, 3072, 3584, 7168] {
            let mut m = LinedRows::new(70, cols);
            m.par_rows_mut().enumerate().for_each(|(i, r)| r.fill(i as f32));
            let sets: std::collections::HashSet<usize> = (0..64).map(|i| (m.row(i).as_ptr() as usize >> 6) % 64).collect();
            assert_eq!(sets.len(), 64, "{cols} columns");
            for i in 0..70 {
                assert_eq!(m.row(i).as_ptr() as usize % 64, 0);
                assert!(m.row(i).iter().all(|&v| v == i as f32), "row {i} of {cols} columns");
            }
        }
        assert!(LinedRows::new(0, 8).refs().is_empty());
    }
}
