//! The arithmetic bound of a run: every matrix product the engine computes, timed at the rate
//! this machine's kernels reach for that many rows, measured in the same run.
//!
//! A [`Tally`] backend wraps the CPU kernels and adds, per call, the FLOPs of the product over
//! the rate [`Rates::measure`] found at K3's expert shape for the nearest row counts
//! (interpolated in log rows). Attention scores and KDA steps are not counted: the bound covers
//! the matrix products only, so it is a lower bound of the compute (stricter, never looser).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use deltafin_core::{
    expert_row_chunks, for_row_chunks, matmul_bf16_with, matmul_mxfp4, permute_for_mxfp4_into, Backend, Bf16Matrix, Bytes, Cpu, ExpertId,
    ExpertLayout, K3Config, LinedRows, Mat, MlaHead, Mxfp4Matrix,
};

/// Row counts the rates are measured at.
const ROWS: [usize; 4] = [1, 8, 64, 512];
/// K3's expert up/gate shape (the kernel benchmark's).
const SHAPE: (usize, usize) = (3072, 3584);

/// FLOP/s of the MXFP4 and BF16 products at each of [`ROWS`]: the median repeat (the typical
/// time, as the kernel benchmark's criterion reports it) and the best one.
#[derive(Clone, Debug)]
pub struct Rates {
    pub mxfp4: [f64; 4],
    pub bf16: [f64; 4],
    pub mxfp4_best: [f64; 4],
    pub bf16_best: [f64; 4],
}

impl Rates {
    /// Each kernel at each row count on K3's shape, the engine's split over threads, over
    /// repeats lasting about half a second after a warm-up.
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
        let mut r = Rates { mxfp4: [0.0; 4], bf16: [0.0; 4], mxfp4_best: [0.0; 4], bf16_best: [0.0; 4] };
        for (k, &n) in ROWS.iter().enumerate() {
            let flops = (2 * n * rows * cols) as f64;
            let x = Mat::from_vec(n, cols, (0..n * cols).map(|i| ((i % 97) as f32 - 48.0) / 64.0).collect());
            // Inputs as `expert_forward` lays them: permuted, on cache lines.
            let mut lined = LinedRows::new(n, cols);
            for t in 0..n {
                permute_for_mxfp4_into(x.row(t), lined.row_mut(t));
            }
            let refs = lined.refs();
            // The engine's split: `expert_forward`'s blocks of rows for this many tokens.
            let chunks = expert_row_chunks(isa, rows, n);
            let mxfp4 = || {
                let mut out = vec![0f32; rows * n];
                for_row_chunks(&mut out, n, &chunks, |r, o| matmul_mxfp4(isa, &refs, &w, r, o));
                out
            };
            let (median, best) = repeat_seconds(mxfp4);
            (r.mxfp4[k], r.mxfp4_best[k]) = (flops / median, flops / best);
            let (median, best) = repeat_seconds(|| matmul_bf16_with(isa, &x, &bf16));
            (r.bf16[k], r.bf16_best[k]) = (flops / median, flops / best);
        }
        r
    }

    /// The mean of two measurements (before and after a run), rate by rate.
    pub fn mean(&self, other: &Rates) -> Rates {
        let m = |a: [f64; 4], b: [f64; 4]| std::array::from_fn(|i| (a[i] + b[i]) / 2.0);
        Rates {
            mxfp4: m(self.mxfp4, other.mxfp4),
            bf16: m(self.bf16, other.bf16),
            mxfp4_best: m(self.mxfp4_best, other.mxfp4_best),
            bf16_best: m(self.bf16_best, other.bf16_best),
        }
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

/// Median and best wall time of `f` over at least 5 repeats lasting about half a second in all.
///
/// The bound takes the median: this VM's speed moves by up to 1.4x within seconds, and a run of
/// the engine lasting seconds meets its typical speed, not its best moment.
fn repeat_seconds<T>(mut f: impl FnMut() -> T) -> (f64, f64) {
    std::hint::black_box(f());
    let start = Instant::now();
    let mut times = Vec::new();
    while start.elapsed().as_secs_f64() < 0.5 || times.len() < 5 {
        let t = Instant::now();
        std::hint::black_box(f());
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], times[0])
}

/// The CPU backend, tallying each matrix product's FLOPs by kind and row count, and the wall
/// time spent inside the products; [`Tally::bound_s`] prices the FLOPs at any [`Rates`], so a
/// run can be priced at rates measured right before and after it.
#[derive(Debug)]
pub struct Tally {
    cpu: Cpu,
    /// FLOPs per `(kind, rows)`, kind 0 = MXFP4 experts, 1 = BF16.
    flops: Mutex<BTreeMap<(usize, usize), u64>>,
    /// Wall time inside the products, `[MXFP4, BF16]` (the engine calls them one at a time;
    /// each runs on every core).
    spent_ps: [AtomicU64; 2],
}

impl Tally {
    pub fn new(cpu: Cpu) -> Tally {
        Tally { cpu, flops: Default::default(), spent_ps: Default::default() }
    }
    /// FLOPs counted so far.
    pub fn flops(&self) -> u64 {
        self.flops.lock().expect("tally").values().sum()
    }
    /// Seconds the counted products take at `rates`, `[MXFP4, BF16]`; `best` picks the best
    /// repeats' rates instead of the median ones.
    pub fn bound_s(&self, rates: &Rates, best: bool) -> [f64; 2] {
        let mut s = [0.0; 2];
        for (&(kind, rows), &flops) in self.flops.lock().expect("tally").iter() {
            let table = match (kind, best) {
                (0, false) => &rates.mxfp4,
                (0, true) => &rates.mxfp4_best,
                (_, false) => &rates.bf16,
                (_, true) => &rates.bf16_best,
            };
            s[kind] += flops as f64 / Rates::at(table, rows);
        }
        s
    }
    /// Seconds spent in the MXFP4 and BF16 products.
    pub fn spent_s(&self) -> [f64; 2] {
        std::array::from_fn(|k| self.spent_ps[k].load(Ordering::Relaxed) as f64 * 1e-12)
    }
    /// A copy of the count so far, which later runs through `self` leave as it is.
    pub fn snapshot(&self) -> Tally {
        Tally {
            cpu: self.cpu,
            flops: Mutex::new(self.flops.lock().expect("tally").clone()),
            spent_ps: std::array::from_fn(|k| AtomicU64::new(self.spent_ps[k].load(Ordering::Relaxed))),
        }
    }
    /// Starts a new count.
    pub fn reset(&self) {
        self.flops.lock().expect("tally").clear();
        for k in 0..2 {
            self.spent_ps[k].store(0, Ordering::Relaxed);
        }
    }
    /// Counts one product of kind `k` (0 MXFP4, 1 BF16) over `rows` token rows and times `run`.
    fn add<T>(&self, k: usize, flops: usize, rows: usize, run: impl FnOnce() -> T) -> T {
        *self.flops.lock().expect("tally").entry((k, rows)).or_default() += flops as u64;
        let start = Instant::now();
        let out = run();
        self.spent_ps[k].fetch_add((start.elapsed().as_secs_f64() * 1e12) as u64, Ordering::Relaxed);
        out
    }
}

impl Backend for Tally {
    fn name(&self) -> String {
        format!("{} (tallied)", self.cpu.name())
    }
    fn matmul_bf16(&self, x: &Mat, w: &Bf16Matrix) -> Mat {
        self.add(1, 2 * x.rows * w.rows * w.cols, x.rows, || self.cpu.matmul_bf16(x, w))
    }
    fn dot_bf16(&self, x: &[f32], w: &[u8]) -> f32 {
        self.cpu.dot_bf16(x, w)
    }
    fn dot_f32(&self, a: &[f32], b: &[f32]) -> f32 {
        self.cpu.dot_f32(a, b)
    }
    fn expert_forward(&self, cfg: &K3Config, id: ExpertId, layout: &ExpertLayout, bytes: &[u8], z: &Mat) -> deltafin_core::Result<Mat> {
        let s = layout.shape;
        self.add(0, 2 * 3 * z.rows * s.inter * s.latent, z.rows, || self.cpu.expert_forward(cfg, id, layout, bytes, z))
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
