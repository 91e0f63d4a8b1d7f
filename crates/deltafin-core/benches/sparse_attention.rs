//! One decode token's attention in one MLA layer at K3's shape (96 heads, latent 512, rope 64),
//! over a long context: K3's dense attention against Kimi K3.1's sparse one (the indexer, 32 heads
//! of 128, scoring every cached key, then the 2048 best keys attended). The engine's own pieces:
//! `index_score` in parallel over keys, `top_keys`, and `Backend::mla_attend` per head in
//! parallel, dense with every key or sparse with the chosen ones. The value projection is left
//! out of both (one 128-row BF16 product per head, the same either way).
//!
//! `cargo bench -p deltafin-core --bench sparse_attention`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use deltafin_core::{index_score, prepare_index_query, top_keys, Backend, Bf16Matrix, Bytes, Cpu, IndexerRounding, MlaHead};
use rayon::prelude::*;

const HEADS: usize = 96;
const LORA: usize = 512;
const ROPE: usize = 64;
const INDEX_HEADS: usize = 32;
const INDEX_DIM: usize = 128;
const TOPK: usize = 2048;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let be = Cpu::best();
    // No value rows: `values` is empty, so each head returns after its latent output.
    let w_v = Bf16Matrix::from_bytes(Bytes::from_vec(vec![0u8; 2 * LORA]), 1, LORA);
    let q_lat = values(HEADS * LORA, 1);
    let q_pe = values(HEADS * ROPE, 2);
    let mut g = c.benchmark_group("one decode token's MLA attention, K3 shape");
    g.sample_size(10);
    for context in [4096usize, 16384, 65536] {
        let latent = values(context * LORA, 3);
        let k_pe = values(context * ROPE, 4);
        let keys = values(context * INDEX_DIM, 5);
        let attend = |sel: Option<&[u32]>| {
            (0..HEADS)
                .into_par_iter()
                .map(|h| {
                    let head = MlaHead {
                        q_lat: &q_lat[h * LORA..(h + 1) * LORA],
                        q_pe: &q_pe[h * ROPE..(h + 1) * ROPE],
                        latent: &latent,
                        k_pe: &k_pe,
                        keys: sel,
                        scale: 0.07,
                    };
                    be.mla_attend(head, &w_v, 0..0).len()
                })
                .sum::<usize>()
        };
        g.bench_function(BenchmarkId::new("K3 dense", context), |b| b.iter(|| attend(None)));
        g.bench_function(BenchmarkId::new("K3.1 indexer + 2048 keys", context), |b| {
            b.iter(|| {
                let mut q = values(INDEX_HEADS * INDEX_DIM, 6);
                let mut w = values(INDEX_HEADS, 7);
                prepare_index_query(IndexerRounding::F32, INDEX_DIM, &mut q, &mut w);
                let scores: Vec<f32> = (0..context)
                    .into_par_iter()
                    .map_init(
                        || vec![0f32; INDEX_HEADS],
                        |relu, s| index_score(&be, INDEX_DIM, &q, &w, &keys[s * INDEX_DIM..(s + 1) * INDEX_DIM], None, relu),
                    )
                    .collect();
                let sel = top_keys(&scores, TOPK);
                attend(Some(&sel))
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
