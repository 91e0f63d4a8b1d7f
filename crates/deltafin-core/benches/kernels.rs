//! The compute kernels on K3's real shapes beside the machine's own limits, measured here:
//! FMA peak (independent fused multiply-adds on every core, the ISA's widest vectors) and DRAM
//! read bandwidth (a 1 GiB sum on every core); then an MXFP4 expert matrix (w1: 3072 x 3584)
//! and a BF16 matrix of the same shape at n = 1, 8, 64, 512 token rows on the engine's
//! row-parallel split (at n = 512 also the split before token tiling, as a baseline in the same
//! run), and from DRAM (working sets past the last-level cache): a 7168 x 7168 BF16 GEMV, a
//! short-row one (16384 x 1024) and the expert matrix at n = 1. On AVX2 the n = 1 expert cases
//! also run with the compiler's tile in place of the one written in assembly, in the same run.
//! Throughput is in elements =
//! FLOPs (bytes for the bandwidth case), so criterion's `thrpt` reads as GFLOP/s.
//!
//! Each K3-shape case is also set beside the limit measured right before and right after it
//! (the FMA peak on the case's instruction set, or the DRAM read for a bandwidth case): the
//! machines here are shared VMs whose speed moves by up to 1.5x from one minute to the next, so a
//! fraction of a peak measured minutes earlier says as much about the minute as about the
//! kernel. It also measures each case slice by slice: 11 pairs of 0.3 s of the case and 0.3 s of
//! its limit, the median of the pairs' ratios, which holds still where the brackets (seconds
//! apart) meet two speeds. The bench prints those fractions and writes them as a table to
//! `target/criterion/kernels-of-peak.md`, which docs/bench/kernels.md quotes.
//!
//! `cargo bench -p deltafin-core --bench kernels`

use std::hint::black_box;

mod common;

use common::bytes;
use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, Bencher, BenchmarkGroup, BenchmarkId, Criterion, Throughput};
use deltafin_core::{
    dot_bf16, dot_bf16_rows_side_by_side, dot_f32, expert_row_chunks, for_row_chunks, matmul_bf16_with, matmul_bf16_without_panels,
    matmul_mxfp4, matmul_mxfp4_without_assembly, permute_for_mxfp4, permute_for_mxfp4_into, row_chunks, Bf16Matrix, Bytes, Isa, IsaKind,
    LinedRows, Mat, Mxfp4Matrix, PromptKernel,
};
use rayon::prelude::*;

const ROWS: usize = 3072;
const COLS: usize = 3584;

fn floats(n: usize, seed: u64) -> Vec<f32> {
    bytes(n, seed, 0, 200).iter().map(|&b| b as f32 / 100.0 - 1.0).collect()
}

/// FMAs in flight per thread: enough independent chains to cover the FMA latency on two ports.
const CHAINS: usize = 12;
const FMA_ITERS: usize = 1 << 20;

/// One thread's FMA loop on `isa`'s widest vectors; returns FLOPs done.
fn fma_loop(isa: Isa) -> f64 {
    match isa.kind() {
        #[cfg(target_arch = "x86_64")]
        IsaKind::Avx512 => {
            // SAFETY: AVX-512 was detected (Isa::new checks it).
            unsafe { x86::fma512() }
        }
        #[cfg(target_arch = "x86_64")]
        IsaKind::Avx2 => {
            // SAFETY: AVX2 + FMA were detected.
            unsafe { x86::fma256() }
        }
        _ => {
            let mut acc = [1.0f32; CHAINS];
            for _ in 0..FMA_ITERS {
                for a in acc.iter_mut() {
                    *a = black_box(*a).mul_add(0.999_999, 1e-7);
                }
            }
            black_box(acc);
            (2 * CHAINS * FMA_ITERS) as f64
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{black_box, CHAINS, FMA_ITERS};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma512() -> f64 {
        let (m, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        let mut acc = [_mm512_set1_ps(1.0); CHAINS];
        for _ in 0..FMA_ITERS {
            for a in acc.iter_mut() {
                *a = _mm512_fmadd_ps(*a, m, c);
            }
        }
        black_box(acc);
        (2 * 16 * CHAINS * FMA_ITERS) as f64
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma256() -> f64 {
        let (m, c) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        let mut acc = [_mm256_set1_ps(1.0); CHAINS];
        for _ in 0..FMA_ITERS {
            for a in acc.iter_mut() {
                *a = _mm256_fmadd_ps(*a, m, c);
            }
        }
        black_box(acc);
        (2 * 8 * CHAINS * FMA_ITERS) as f64
    }
}

/// A product of MXFP4 rows and inputs (`matmul_mxfp4` and its variants).
type Matmul = fn(Isa, &[&[f32]], &Mxfp4Matrix, std::ops::Range<usize>, &mut [f32]);

fn isas() -> Vec<Isa> {
    // The best ISA, and AVX2 too where the best is AVX-512 (machines here differ).
    let mut v = vec![Isa::best()];
    if Isa::best().kind() == IsaKind::Avx512 {
        v.extend(Isa::new(IsaKind::Avx2));
    }
    v
}

/// The prompt kernel `isa` does not run, and its name in the results.
fn other_prompt_kernel(isa: Isa) -> (Isa, &'static str) {
    let other = isa.prompt_kernel().other();
    let label = match other {
        PromptKernel::Panels => "panels",
        PromptKernel::RegisterTiles => "register tiles",
    };
    (isa.with_prompt_kernel(other), label)
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("limits");
    g.sample_size(10);
    for isa in isas() {
        let flops = fma_on_every_core(isa);
        g.throughput(Throughput::Elements(flops as u64));
        g.bench_function(BenchmarkId::new("fma peak", format!("{:?}", isa.kind())), |b| b.iter(|| fma_on_every_core(isa)));
    }
    // A dot of a 1 GiB array with itself on the widest vectors: each byte is read once, and
    // the FMAs are far from the compute limit, so the loop is bound by the reads.
    let big: Vec<f32> = floats(1 << 28, 7);
    let isa = Isa::best();
    g.throughput(Throughput::Bytes((big.len() * 4) as u64));
    g.bench_function("dram read", |b| b.iter(|| dram_read(isa, &big)));
    g.finish();
    let mut around = Around::new(&big);

    let packed = bytes(ROWS * COLS / 2, 3, 0, 256);
    let scales = bytes(ROWS * COLS / 32, 5, 110, 30);
    let bf16 = Bf16Matrix::from_bytes(Bytes::from_vec(bf16_bytes(ROWS * COLS, 9)), ROWS, COLS);
    // Working sets past the last-level cache (1 GiB; this bench's machines have up to 300 MB of
    // L3): 10 GEMV matrices, and 192 copies of the expert matrix (each its own bytes).
    let gemvs: Vec<Bf16Matrix> =
        (0..10).map(|k| Bf16Matrix::from_bytes(Bytes::from_vec(bf16_bytes(7168 * 7168, 17 + k)), 7168, 7168)).collect();
    let shorts: Vec<Bf16Matrix> =
        (0..32u64).map(|k| Bf16Matrix::from_bytes(Bytes::from_vec(bf16_bytes(16384 * 1024, 40 + k)), 16384, 1024)).collect();
    let cold: Vec<(Vec<u8>, Vec<u8>)> =
        (0..192u64).map(|k| (bytes(ROWS * COLS / 2, 3 + k, 0, 256), bytes(ROWS * COLS / 32, 5 + k, 110, 30))).collect();
    let mut g = c.benchmark_group("k3 shapes");
    g.sample_size(10);
    for isa in isas() {
        let name = format!("{:?}", isa.kind());
        for n in [1usize, 8, 64, 512] {
            let flops = (2 * n * ROWS * COLS) as u64;
            g.throughput(Throughput::Elements(flops));
            // Inputs as `expert_forward` lays them: permuted, on cache lines.
            let mut lined = LinedRows::new(n, COLS);
            for t in 0..n {
                permute_for_mxfp4_into(&floats(COLS, 11 + t as u64), lined.row_mut(t));
            }
            let refs = lined.refs();
            let w = Mxfp4Matrix::new(ROWS, COLS, &packed, &scales).unwrap();
            // The engine's split (`expert_forward`): blocks of rows in parallel, each one
            // `matmul_mxfp4` over every input.
            let expert_with = |isa: Isa, matmul: Matmul| {
                let chunks = expert_row_chunks(isa, ROWS, n);
                let mut out = vec![0f32; ROWS * n];
                for_row_chunks(&mut out, n, &chunks, |rows, o| matmul(isa, &refs, &w, rows, o));
                out
            };
            let expert = |isa: Isa| expert_with(isa, matmul_mxfp4);
            around.case(&mut g, format!("mxfp4 {name}"), n, Work::Flops(flops, isa), || expert(isa));
            if n == 1 && isa.kind() == IsaKind::Avx2 {
                // The decode's tile as the compiler writes it, in the same run (the same bits).
                around.case(&mut g, format!("mxfp4 compiled tile {name}"), n, Work::Flops(flops, isa), || {
                    expert_with(isa, matmul_mxfp4_without_assembly)
                });
            }
            if n >= 64 {
                // The prompt kernel this CPU does not pick, in the same run, through the same
                // split and dispatch.
                let (other, label) = other_prompt_kernel(isa);
                around.case(&mut g, format!("mxfp4 {label} {name}"), n, Work::Flops(flops, isa), || expert(other));
            }
            if n == 1 || n == 512 {
                // The baseline, in the same run: the same blocks one weight row at a time
                // (tiles of one row: no input shared by several rows' FMA chains).
                around.case(&mut g, format!("mxfp4 row by row {name}"), n, Work::Flops(flops, isa), || {
                    let mut out = vec![0f32; ROWS * n];
                    out.par_chunks_mut(n * 32).enumerate().for_each(|(b, o)| {
                        for (i, o) in o.chunks_mut(n).enumerate() {
                            let r = 32 * b + i;
                            for (x, o) in refs.chunks(8).zip(o.chunks_mut(8)) {
                                matmul_mxfp4(isa, x, &w, r..r + 1, o);
                            }
                        }
                    });
                    out
                });
            }
            let x = Mat::from_vec(n, COLS, floats(n * COLS, 13));
            around.case(&mut g, format!("bf16 {name}"), n, Work::Flops(flops, isa), || matmul_bf16_with(isa, &x, &bf16));
            if n >= 64 {
                around.case(&mut g, format!("bf16 register tiles {name}"), n, Work::Flops(flops, isa), || {
                    matmul_bf16_without_panels(isa, &x, &bf16)
                });
            }
            if n == 512 {
                // The previous kernel, in the same run: the same tiles, each value its own dot
                // (no weight row shared by several token rows' FMA chains).
                around.case(&mut g, format!("bf16 lone dots {name}"), n, Work::Flops(flops, isa), || {
                    let mut out = vec![0f32; ROWS * n];
                    out.par_chunks_mut(n * 32).enumerate().for_each(|(blk, o)| {
                        for tile in (0..n).step_by(32) {
                            for (i, o) in o.chunks_mut(n).enumerate() {
                                let wr = bf16.row(32 * blk + i);
                                for t in tile..(tile + 32).min(n) {
                                    o[t] = dot_bf16(isa, x.row(t), wr);
                                }
                            }
                        }
                    });
                    out
                });
                around.case(&mut g, format!("bf16 untiled {name}"), n, Work::Flops(flops, isa), || {
                    let mut out = vec![0f32; ROWS * n];
                    out.par_chunks_mut(n).with_min_len(32).enumerate().for_each(|(r, o)| {
                        for (t, o) in o.iter_mut().enumerate() {
                            *o = dot_bf16(isa, x.row(t), bf16.row(r));
                        }
                    });
                    out
                });
            }
        }
        // A GEMV from DRAM: each iteration takes the next of several 103 MB matrices, together
        // well past any last-level cache (one matrix alone fits some machines' L3).
        let d = 7168;
        let x = Mat::from_vec(1, d, floats(d, 19));
        let mut next = 0;
        g.throughput(Throughput::Bytes((d * d * 2) as u64));
        around.case(&mut g, format!("bf16 gemv 7168 {name}"), 1, Work::Bytes((d * d * 2) as u64), || {
            next = (next + 1) % gemvs.len();
            matmul_bf16_with(isa, &x, &gemvs[next])
        });
        // The previous GEMV, in the same run: one lone dot per weight row.
        around.case(&mut g, format!("bf16 gemv 7168 lone dots {name}"), 1, Work::Bytes((d * d * 2) as u64), || {
            next = (next + 1) % gemvs.len();
            let gemv = &gemvs[next];
            let mut out = vec![0f32; d];
            out.par_chunks_mut(32).enumerate().for_each(|(blk, o)| {
                for (i, o) in o.iter_mut().enumerate() {
                    *o = dot_bf16(isa, x.row(0), gemv.row(32 * blk + i));
                }
            });
            out
        });
        // Short rows from DRAM (K3's kv_b and q_b, `small`'s whole spine: 512 to 2048 columns):
        // below 4096 columns decode-sized rows run one after another; side by side, in the same
        // run on the same split.
        let (rows, cols) = (16384, 1024);
        let xs = floats(cols, 23);
        let xm = Mat::from_vec(1, cols, xs.clone());
        g.throughput(Throughput::Bytes((rows * cols * 2) as u64));
        around.case(&mut g, format!("bf16 gemv 1024 {name}"), 1, Work::Bytes((rows * cols * 2) as u64), || {
            next = (next + 1) % shorts.len();
            matmul_bf16_with(isa, &xm, &shorts[next])
        });
        let split = row_chunks(rows, 128, 32, rayon::current_num_threads());
        around.case(&mut g, format!("bf16 gemv 1024 side by side {name}"), 1, Work::Bytes((rows * cols * 2) as u64), || {
            next = (next + 1) % shorts.len();
            let m = &shorts[next];
            let mut out = vec![0f32; rows];
            for_row_chunks(&mut out, 1, &split, |r, o| {
                let ws: Vec<&[u8]> = r.map(|i| m.row(i)).collect();
                dot_bf16_rows_side_by_side(isa, &xs, &ws, o);
            });
            out
        });
        // A decode-sized expert matrix from DRAM, as the engine meets one (just read from a
        // drive, or cached long ago): each iteration takes the next of many w1-sized matrices.
        let x1 = [permute_for_mxfp4(&floats(COLS, 11))];
        let x1: Vec<&[f32]> = x1.iter().map(|x| &x[..]).collect();
        g.throughput(Throughput::Elements((2 * ROWS * COLS) as u64));
        let mut from_dram = |matmul: Matmul| {
            next = (next + 1) % cold.len();
            let (p, s) = &cold[next];
            let w = Mxfp4Matrix::new(ROWS, COLS, p, s).expect("w1 shape");
            let mut out = vec![0f32; ROWS];
            out.par_chunks_mut(32).enumerate().for_each(|(b, o)| matmul(isa, &x1, &w, 32 * b..32 * b + 32, o));
            out
        };
        around.case(&mut g, format!("mxfp4 from dram {name}"), 1, Work::Flops((2 * ROWS * COLS) as u64, isa), || from_dram(matmul_mxfp4));
        if isa.kind() == IsaKind::Avx2 {
            around.case(&mut g, format!("mxfp4 from dram compiled tile {name}"), 1, Work::Flops((2 * ROWS * COLS) as u64, isa), || {
                from_dram(matmul_mxfp4_without_assembly)
            });
        }
    }
    g.finish();
    around.finish();
}

/// [`fma_loop`] on every thread of the pool at once; returns FLOPs done.
fn fma_on_every_core(isa: Isa) -> f64 {
    (0..rayon::current_num_threads()).into_par_iter().map(|_| fma_loop(isa)).sum::<f64>()
}

/// A dot of `big` with itself on every core: bound by DRAM reads.
fn dram_read(isa: Isa, big: &[f32]) -> f32 {
    big.par_chunks(1 << 16).map(|c| dot_f32(isa, c, c)).sum::<f32>()
}

/// The median of `reps` rates of `f`, which returns the work it did, in units of 1e9 a second.
fn median_rate(reps: usize, mut f: impl FnMut() -> f64) -> f64 {
    let mut rates: Vec<f64> = (0..reps)
        .map(|_| {
            let t = std::time::Instant::now();
            let work = f();
            work / t.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    rates[reps / 2]
}

/// The K3-shape cases, each beside its limit measured right before and after it.
struct Around<'a> {
    big: &'a [f32],
    /// Criterion's folder of results (its estimates give each case's median).
    dir: std::path::PathBuf,
    /// The table's rows, in the order the cases ran.
    rows: Vec<String>,
}

impl<'a> Around<'a> {
    fn new(big: &'a [f32]) -> Around<'a> {
        let dir = std::env::var_os("CRITERION_HOME").map(std::path::PathBuf::from).unwrap_or_else(|| {
            let target = std::env::var_os("CARGO_TARGET_DIR")
                .map(std::path::PathBuf::from)
                .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"));
            target.join("criterion")
        });
        Around { big, dir, rows: Vec::new() }
    }

    /// The limit for `work` now: the FMA peak in GFLOP/s, or the DRAM read in GiB/s (the
    /// median of 41 short FMA passes, or of 5 reads of 1 GiB).
    fn limit(&self, work: Work) -> f64 {
        let reps = match work {
            Work::Flops(..) => 41,
            Work::Bytes(_) => 5,
        };
        median_rate(reps, || self.limit_once(work))
    }

    /// One pass of the limit's loop: the FMA loop on every core, or the DRAM read; returns its
    /// work in [`Work::amount`]'s units.
    fn limit_once(&self, work: Work) -> f64 {
        match work {
            Work::Flops(_, isa) => fma_on_every_core(isa),
            Work::Bytes(_) => {
                black_box(dram_read(Isa::best(), self.big));
                Work::Bytes((self.big.len() * 4) as u64).amount()
            }
        }
    }

    /// The case's rate as a fraction of its limit's, slice by slice: [`PAIRS`] pairs of about
    /// [`SLICE_S`] of the case then as long of the limit's loop, the median of the pairs'
    /// ratios. Each pair meets one moment of the machine, where the brackets around
    /// criterion's run are seconds apart and can meet two (they have differed by 1.5x).
    fn paired(&self, work: Work, body: &mut impl FnMut()) -> f64 {
        let per = work.amount();
        let mut ratios: Vec<f64> = (0..PAIRS)
            .map(|_| {
                let (mut done, t) = (0.0, std::time::Instant::now());
                while t.elapsed().as_secs_f64() < SLICE_S {
                    body();
                    done += per;
                }
                let case = done / t.elapsed().as_secs_f64();
                let (mut done, t) = (0.0, std::time::Instant::now());
                while t.elapsed().as_secs_f64() < SLICE_S {
                    done += self.limit_once(work);
                }
                case / (done / t.elapsed().as_secs_f64())
            })
            .collect();
        ratios.sort_by(f64::total_cmp);
        ratios[PAIRS / 2]
    }

    /// Runs case `function`/`n` (`body` once per iteration) through criterion between two
    /// measurements of its limit; if the filter ran it, records its median against their mean,
    /// and its [`Around::paired`] fraction.
    fn case<T>(&mut self, g: &mut BenchmarkGroup<'_, WallTime>, function: String, n: usize, work: Work, mut body: impl FnMut() -> T) {
        let estimates = self.dir.join("k3 shapes").join(&function).join(n.to_string()).join("new/estimates.json");
        let modified = || std::fs::metadata(&estimates).and_then(|m| m.modified()).ok();
        let (was, before) = (modified(), self.limit(work));
        g.bench_function(BenchmarkId::new(function.clone(), n), |b: &mut Bencher<'_, WallTime>| b.iter(&mut body));
        if modified() == was {
            return; // filtered out
        }
        let after = self.limit(work);
        let paired = self.paired(work, &mut || {
            black_box(body());
        });
        let median_ns = std::fs::read_to_string(&estimates)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v["median"]["point_estimate"].as_f64())
            .expect("criterion's estimates of the case just run");
        let rate = work.amount() / median_ns;
        let (unit, limit) = match work {
            Work::Flops(..) => ("GFLOP/s", "FMA peak"),
            Work::Bytes(_) => ("GiB/s", "DRAM read"),
        };
        let of = 2.0 * rate / (before + after);
        println!(
            "{function}/{n}: {rate:.1} {unit} = {:.0}% of the {limit} around it ({before:.1} before, {after:.1} after); {:.0}% slice by slice",
            100.0 * of,
            100.0 * paired
        );
        self.rows.push(format!(
            "| {function} | {n} | {rate:.1} {unit} | {limit} {before:.1} / {after:.1} | {:.0}% | {:.0}% |",
            100.0 * of,
            100.0 * paired
        ));
    }

    /// Writes the table (the cases that ran) beside criterion's results.
    fn finish(self) {
        if self.rows.is_empty() {
            return;
        }
        let table = format!(
            "| case | n | median | limit before / after | of their mean | slice by slice |\n|---|---|---|---|---|---|\n{}\n",
            self.rows.join("\n")
        );
        println!("\n{table}");
        let path = self.dir.join("kernels-of-peak.md");
        if let Err(e) = std::fs::create_dir_all(&self.dir).and_then(|()| std::fs::write(&path, &table)) {
            eprintln!("could not write {}: {e}", path.display());
        }
    }
}

/// Pairs of slices in [`Around::paired`].
const PAIRS: usize = 11;
/// Seconds of each slice: long enough for a few iterations of the slowest case, short beside
/// the machine's swings, which last seconds.
const SLICE_S: f64 = 0.3;

/// What a case does per iteration, and so which limit it meets.
#[derive(Clone, Copy)]
enum Work {
    /// FLOPs on an instruction set: against its FMA peak.
    Flops(u64, Isa),
    /// Bytes read from DRAM: against the DRAM read.
    Bytes(u64),
}

impl Work {
    /// The work in units that make a rate per nanosecond read as GFLOP/s or GiB/s: FLOPs, or
    /// bytes / 1.073741824.
    fn amount(self) -> f64 {
        match self {
            Work::Flops(flops, _) => flops as f64,
            Work::Bytes(bytes) => bytes as f64 / 1.073_741_824,
        }
    }
}

/// BF16 bytes of small finite values.
fn bf16_bytes(n: usize, seed: u64) -> Vec<u8> {
    floats(n, seed).iter().flat_map(|f| ((f.to_bits() >> 16) as u16).to_le_bytes()).collect()
}

criterion_group!(benches, bench);
criterion_main!(benches);
