//! The expert hot path on one expert's worth of MXFP4 rows (K3's size: 2 x 3072 gate rows and
//! 3584 down rows, about 17.5 MB): one dot per input against `dot_mxfp4_inputs` (each group
//! dequantized once for all inputs), for one token (decode) and eight, on the engine's
//! row-parallel split.
//!
//! `cargo bench -p deltafin-core --bench expert_kernel`

mod common;

use common::bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use deltafin_core::{dot_mxfp4, dot_mxfp4_inputs, permute_for_mxfp4, Isa};
use rayon::prelude::*;

const ROWS: usize = 2 * 3072 + 3584;
const COLS: usize = 3584;

fn bench(c: &mut Criterion) {
    let packed = bytes(ROWS * COLS / 2, 3, 0, 256);
    let scales = bytes(ROWS * COLS / 32, 5, 110, 30);
    let isa = Isa::best();
    let mut g = c.benchmark_group("expert-sized MXFP4 rows");
    g.throughput(Throughput::Bytes((packed.len() + scales.len()) as u64));
    g.sample_size(20);
    for tokens in [1usize, 8] {
        let xs: Vec<Vec<f32>> = (0..tokens)
            .map(|t| permute_for_mxfp4(&bytes(COLS, 11 + t as u64, 0, 200).iter().map(|&b| b as f32 / 100.0 - 1.0).collect::<Vec<_>>()))
            .collect();
        let row = |r: usize| (&packed[r * COLS / 2..(r + 1) * COLS / 2], &scales[r * COLS / 32..(r + 1) * COLS / 32]);
        // Every row on the engine's row-parallel split, summed so nothing is optimised away.
        let all_rows = |f: &(dyn Fn(&[u8], &[u8]) -> f32 + Sync)| {
            (0..ROWS).into_par_iter().with_min_len(32).map(|r| f(row(r).0, row(r).1)).sum::<f32>()
        };
        g.bench_function(BenchmarkId::new("one dot at a time", tokens), |b| {
            b.iter(|| all_rows(&|p, s| xs.iter().map(|x| dot_mxfp4(isa, x, p, s)).sum::<f32>()))
        });
        g.bench_function(BenchmarkId::new("dot_mxfp4_inputs", tokens), |b| {
            let refs: Vec<&[f32]> = xs.iter().map(|x| &x[..]).collect();
            b.iter(|| {
                all_rows(&|p, s| {
                    let mut out = [0f32; 8];
                    dot_mxfp4_inputs(isa, &refs, p, s, &mut out[..tokens]);
                    out.iter().sum::<f32>()
                })
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
