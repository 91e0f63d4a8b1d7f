//! The arithmetic bound of a run: every matrix product the engine computes, timed at the rate
//! this machine's kernels reach for that many rows, measured in the same run.
//!
//! A [`Tally`] backend wraps the CPU kernels and adds, per call, the FLOPs of the product over
//! the rate [`Rates::measure`] found at K3's expert shape for the nearest row counts
//! (interpolated in log rows). Attention scores and KDA steps are not counted: the bound covers
//! the matrix products only, so it is a lower bound of the compute (stricter, never looser).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use deltafin_core::{
    matmul_bf16_with, matmul_mxfp4, permute_for_mxfp4, Backend, Bf16Matrix, Bytes, Cpu, ExpertLayout, K3Config, Mat, MlaHead, Mxfp4Matrix,
};
use rayon::prelude::*;

/// Row counts the rates are measured at.
const ROWS: [usize; 4] = [1, 8, 64, 512];
/// K3's expert up/gate shape (the kernel benchmark's).
const SHAPE: (usize, usize) = (3072, 3584);

/// FLOP/s of the MXFP4 and BF16 products at each of [`ROWS`].
#[derive(Clone, Debug)]
pub struct Rates {
    pub mxfp4: [f64; 4],
    pub bf16: [f64; 4],
}

impl Rates {
    /// Each kernel at each row count on K3's shape, the engine's split over threads, best of
    /// a few repeats after a warm-up.
    pub fn measure(cpu: Cpu) -> Rates {
        let isa = cpu.isa();
        let (rows, cols) = SHAPE;
        let packed: Vec<u8> = (0..rows * cols / 2).map(|i| (i.wrapping_mul(2654435761) >> 7) as u8).collect();
        let scales: Vec<u8> = (0..rows * cols / 32).map(|i| 110 + (i % 30) as u8).collect();
        let w = Mxfp4Matrix::new(rows, cols, &packed, &scales).expect("benchmark matrix");
        let bf16 = Bf16Matrix::from_bytes(
            Bytes::from_vec((0..rows * cols * 2).map(|i| if i % 2 == 1 { 0x3c } else { i as u8 }).collect()),
            rows,
            cols,
        );
        let mut r = Rates { mxfp4: [0.0; 4], bf16: [0.0; 4] };
        for (k, &n) in ROWS.iter().enumerate() {
            let flops = (2 * n * rows * cols) as f64;
            let x = Mat::from_vec(n, cols, (0..n * cols).map(|i| ((i % 97) as f32 - 48.0) / 64.0).collect());
            let xs: Vec<Vec<f32>> = (0..n).map(|t| permute_for_mxfp4(x.row(t))).collect();
            let refs: Vec<&[f32]> = xs.iter().map(|v| &v[..]).collect();
            let mxfp4 = || {
                let mut out = vec![0f32; rows * n];
                out.par_chunks_mut(32 * n).enumerate().for_each(|(b, o)| matmul_mxfp4(isa, &refs, &w, 32 * b..32 * b + 32, o));
                out
            };
            r.mxfp4[k] = flops / best_seconds(mxfp4);
            r.bf16[k] = flops / best_seconds(|| matmul_bf16_with(isa, &x, &bf16));
        }
        r
    }

    /// The rate for `n` rows, interpolated in log2(rows) between the measured counts.
    fn at(table: &[f64; 4], n: usize) -> f64 {
        let l = (n.max(1) as f64).log2();
        let pts: Vec<f64> = ROWS.iter().map(|&r| (r as f64).log2()).collect();
        if l >= pts[3] {
            return table[3];
        }
        let i = pts.iter().rposition(|&p| p <= l).unwrap_or(0);
        let f = (l - pts[i]) / (pts[i + 1] - pts[i]);
        table[i] + f * (table[i + 1] - table[i])
    }
}

/// Best wall time of `f` over repeats lasting about half a second in all.
fn best_seconds<T>(mut f: impl FnMut() -> T) -> f64 {
    std::hint::black_box(f());
    let start = Instant::now();
    let mut best = f64::MAX;
    while start.elapsed().as_secs_f64() < 0.5 || best == f64::MAX {
        let t = Instant::now();
        std::hint::black_box(f());
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

/// The CPU backend, tallying each matrix product's FLOPs and its time at the measured rates.
#[derive(Debug)]
pub struct Tally {
    cpu: Cpu,
    rates: Rates,
    flops: AtomicU64,
    ideal_ps: AtomicU64,
}

impl Tally {
    pub fn new(cpu: Cpu, rates: Rates) -> Tally {
        Tally { cpu, rates, flops: AtomicU64::new(0), ideal_ps: AtomicU64::new(0) }
    }
    /// FLOPs counted so far.
    pub fn flops(&self) -> u64 {
        self.flops.load(Ordering::Relaxed)
    }
    /// Seconds the counted products take at the measured rates.
    pub fn ideal_s(&self) -> f64 {
        self.ideal_ps.load(Ordering::Relaxed) as f64 * 1e-12
    }
    /// Starts a new count.
    pub fn reset(&self) {
        self.flops.store(0, Ordering::Relaxed);
        self.ideal_ps.store(0, Ordering::Relaxed);
    }
    fn add(&self, flops: usize, rate: f64) {
        self.flops.fetch_add(flops as u64, Ordering::Relaxed);
        self.ideal_ps.fetch_add((flops as f64 / rate * 1e12) as u64, Ordering::Relaxed);
    }
}

impl Backend for Tally {
    fn name(&self) -> String {
        format!("{} (tallied)", self.cpu.name())
    }
    fn matmul_bf16(&self, x: &Mat, w: &Bf16Matrix) -> Mat {
        self.add(2 * x.rows * w.rows * w.cols, Rates::at(&self.rates.bf16, x.rows));
        self.cpu.matmul_bf16(x, w)
    }
    fn dot_bf16(&self, x: &[f32], w: &[u8]) -> f32 {
        self.cpu.dot_bf16(x, w)
    }
    fn dot_f32(&self, a: &[f32], b: &[f32]) -> f32 {
        self.cpu.dot_f32(a, b)
    }
    fn expert_forward(&self, cfg: &K3Config, layout: &ExpertLayout, bytes: &[u8], z: &Mat) -> deltafin_core::Result<Mat> {
        let s = layout.shape;
        self.add(2 * 3 * z.rows * s.inter * s.latent, Rates::at(&self.rates.mxfp4, z.rows));
        self.cpu.expert_forward(cfg, layout, bytes, z)
    }
    fn mla_attend(&self, head: MlaHead<'_>, w_v: &Bf16Matrix, values: std::ops::Range<usize>) -> Vec<f32> {
        self.cpu.mla_attend(head, w_v, values)
    }
    fn kda_step(&self, s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], decay: &[f32], beta: f32, o: &mut [f32]) {
        self.cpu.kda_step(s, q, k, v, decay, beta, o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_interpolate_in_log_rows_and_clamp() {
        let t = [1.0, 4.0, 7.0, 10.0];
        assert_eq!(Rates::at(&t, 1), 1.0);
        assert_eq!(Rates::at(&t, 8), 4.0);
        assert!((Rates::at(&t, 2) - 2.0).abs() < 1e-9);
        assert!((Rates::at(&t, 128) - 8.0).abs() < 1e-9);
        assert_eq!(Rates::at(&t, 4096), 10.0);
    }
}
