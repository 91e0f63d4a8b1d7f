//! The compute kernels on K3's real shapes beside the machine's own limits, measured here:
//! FMA peak (independent fused multiply-adds on every core, the ISA's widest vectors) and DRAM
//! read bandwidth (a 1 GiB sum on every core); then an MXFP4 expert matrix (w1: 3072 x 3584)
//! and a BF16 matrix of the same shape at n = 1, 8, 64, 512 token rows on the engine's
//! row-parallel split (at n = 512 also the split before token tiling, as a baseline in the same
//! run), and from DRAM (working sets past the last-level cache): a 7168 x 7168 BF16 GEMV, a
//! short-row one (16384 x 1024) and the expert matrix at n = 1. Throughput is in elements =
//! FLOPs (bytes for the bandwidth case), so criterion's `thrpt` reads as GFLOP/s;
//! docs/bench/kernels.md gives them as fractions of the measured peaks.
//!
//! `cargo bench -p deltafin-core --bench kernels`

use std::hint::black_box;

mod common;

use common::bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use deltafin_core::{
    dot_bf16, dot_bf16_rows_side_by_side, dot_f32, expert_row_chunks, for_row_chunks, matmul_bf16_with, matmul_bf16_without_panels,
    matmul_mxfp4, permute_for_mxfp4, permute_for_mxfp4_into, row_chunks, Bf16Matrix, Bytes, Isa, IsaKind, LinedRows, Mat, Mxfp4Matrix,
    PromptKernel,
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
    let threads = rayon::current_num_threads();
    let mut g = c.benchmark_group("limits");
    g.sample_size(10);
    for isa in isas() {
        let flops = fma_loop(isa) * threads as f64;
        g.throughput(Throughput::Elements(flops as u64));
        g.bench_function(BenchmarkId::new("fma peak", format!("{:?}", isa.kind())), |b| {
            b.iter(|| (0..threads).into_par_iter().map(|_| fma_loop(isa)).sum::<f64>())
        });
    }
    // A dot of a 1 GiB array with itself on the widest vectors: each byte is read once, and
    // the FMAs are far from the compute limit, so the loop is bound by the reads.
    let big: Vec<f32> = floats(1 << 28, 7);
    let isa = Isa::best();
    g.throughput(Throughput::Bytes((big.len() * 4) as u64));
    g.bench_function("dram read", |b| b.iter(|| big.par_chunks(1 << 16).map(|c| dot_f32(isa, c, c)).sum::<f32>()));
    drop(big);
    g.finish();

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
            let expert = |isa: Isa| {
                let chunks = expert_row_chunks(isa, ROWS, n);
                let mut out = vec![0f32; ROWS * n];
                for_row_chunks(&mut out, n, &chunks, |rows, o| matmul_mxfp4(isa, &refs, &w, rows, o));
                out
            };
            g.bench_function(BenchmarkId::new(format!("mxfp4 {name}"), n), |b| b.iter(|| expert(isa)));
            if n >= 64 {
                // The prompt kernel this CPU does not pick, in the same run, through the same
                // split and dispatch.
                let (other, label) = other_prompt_kernel(isa);
                g.bench_function(BenchmarkId::new(format!("mxfp4 {label} {name}"), n), |b| b.iter(|| expert(other)));
            }
            if n == 1 || n == 512 {
                // The baseline, in the same run: the same blocks one weight row at a time
                // (tiles of one row: no input shared by several rows' FMA chains).
                g.bench_function(BenchmarkId::new(format!("mxfp4 row by row {name}"), n), |b| {
                    b.iter(|| {
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
                    })
                });
            }
            let x = Mat::from_vec(n, COLS, floats(n * COLS, 13));
            g.bench_function(BenchmarkId::new(format!("bf16 {name}"), n), |b| b.iter(|| matmul_bf16_with(isa, &x, &bf16)));
            if n >= 64 {
                g.bench_function(BenchmarkId::new(format!("bf16 register tiles {name}"), n), |b| {
                    b.iter(|| matmul_bf16_without_panels(isa, &x, &bf16))
                });
            }
            if n == 512 {
                // The previous kernel, in the same run: the same tiles, each value its own dot
                // (no weight row shared by several token rows' FMA chains).
                g.bench_function(BenchmarkId::new(format!("bf16 lone dots {name}"), n), |b| {
                    b.iter(|| {
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
                    })
                });
                g.bench_function(BenchmarkId::new(format!("bf16 untiled {name}"), n), |b| {
                    b.iter(|| {
                        let mut out = vec![0f32; ROWS * n];
                        out.par_chunks_mut(n).with_min_len(32).enumerate().for_each(|(r, o)| {
                            for (t, o) in o.iter_mut().enumerate() {
                                *o = dot_bf16(isa, x.row(t), bf16.row(r));
                            }
                        });
                        out
                    })
                });
            }
        }
        // A GEMV from DRAM: each iteration takes the next of several 103 MB matrices, together
        // well past any last-level cache (one matrix alone fits some machines' L3).
        let d = 7168;
        let x = Mat::from_vec(1, d, floats(d, 19));
        let mut next = 0;
        g.throughput(Throughput::Bytes((d * d * 2) as u64));
        g.bench_function(BenchmarkId::new(format!("bf16 gemv 7168 {name}"), 1), |b| {
            b.iter(|| {
                next = (next + 1) % gemvs.len();
                matmul_bf16_with(isa, &x, &gemvs[next])
            })
        });
        // The previous GEMV, in the same run: one lone dot per weight row.
        g.bench_function(BenchmarkId::new(format!("bf16 gemv 7168 lone dots {name}"), 1), |b| {
            b.iter(|| {
                next = (next + 1) % gemvs.len();
                let gemv = &gemvs[next];
                let mut out = vec![0f32; d];
                out.par_chunks_mut(32).enumerate().for_each(|(blk, o)| {
                    for (i, o) in o.iter_mut().enumerate() {
                        *o = dot_bf16(isa, x.row(0), gemv.row(32 * blk + i));
                    }
                });
                out
            })
        });
        // Short rows from DRAM (K3's kv_b and q_b, `small`'s whole spine: 512 to 2048 columns):
        // below 4096 columns decode-sized rows run one after another; side by side, in the same
        // run on the same split.
        let (rows, cols) = (16384, 1024);
        let xs = floats(cols, 23);
        let xm = Mat::from_vec(1, cols, xs.clone());
        g.throughput(Throughput::Bytes((rows * cols * 2) as u64));
        g.bench_function(BenchmarkId::new(format!("bf16 gemv 1024 {name}"), 1), |b| {
            b.iter(|| {
                next = (next + 1) % shorts.len();
                matmul_bf16_with(isa, &xm, &shorts[next])
            })
        });
        let split = row_chunks(rows, 128, 32, rayon::current_num_threads());
        g.bench_function(BenchmarkId::new(format!("bf16 gemv 1024 side by side {name}"), 1), |b| {
            b.iter(|| {
                next = (next + 1) % shorts.len();
                let m = &shorts[next];
                let mut out = vec![0f32; rows];
                for_row_chunks(&mut out, 1, &split, |r, o| {
                    let ws: Vec<&[u8]> = r.map(|i| m.row(i)).collect();
                    dot_bf16_rows_side_by_side(isa, &xs, &ws, o);
                });
                out
            })
        });
        // A decode-sized expert matrix from DRAM, as the engine meets one (just read from a
        // drive, or cached long ago): each iteration takes the next of many w1-sized matrices.
        let x1 = [permute_for_mxfp4(&floats(COLS, 11))];
        let x1: Vec<&[f32]> = x1.iter().map(|x| &x[..]).collect();
        g.throughput(Throughput::Elements((2 * ROWS * COLS) as u64));
        g.bench_function(BenchmarkId::new(format!("mxfp4 from dram {name}"), 1), |b| {
            b.iter(|| {
                next = (next + 1) % cold.len();
                let (p, s) = &cold[next];
                let w = Mxfp4Matrix::new(ROWS, COLS, p, s).expect("w1 shape");
                let mut out = vec![0f32; ROWS];
                out.par_chunks_mut(32).enumerate().for_each(|(b, o)| matmul_mxfp4(isa, &x1, &w, 32 * b..32 * b + 32, o));
                out
            })
        });
    }
    g.finish();
}

/// BF16 bytes of small finite values.
fn bf16_bytes(n: usize, seed: u64) -> Vec<u8> {
    floats(n, seed).iter().flat_map(|f| ((f.to_bits() >> 16) as u16).to_le_bytes()).collect()
}

criterion_group!(benches, bench);
criterion_main!(benches);
