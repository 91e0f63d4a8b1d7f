//! Tokenizing 1 MB of the texts that once hung or crawled (one letter repeated, `é` repeated, `ab`
//! repeated, spaces then `x`, random bytes) and of ordinary English, with the committed trained
//! K3's tokenizer (K3's split pattern). Each must take well under a second: the server tokenizes
//! requests of up to its body limit (4 MB).
//!
//! `cargo bench -p deltafin-core --bench tokenizer`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use deltafin_core::{Tokenizer, K3_PATTERN};

const RANKS: &str = include_str!("../../../training/models/k3/tiktoken.model");
const TOKCFG: &str = include_str!("../../../training/models/k3/tokenizer_config.json");
const MB: usize = 1 << 20;

fn texts() -> Vec<(&'static str, String)> {
    let mut x = 0x9e3779b97f4a7c15u64;
    let random: Vec<u8> = (0..MB)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let english = "The engine reads each expert once per layer, checks its bytes, and computes. ";
    vec![
        ("a repeated", "a".repeat(MB)),
        ("é repeated", "é".repeat(MB / 2)),
        ("ab repeated", "ab".repeat(MB / 2)),
        ("spaces then x", " ".repeat(MB - 1) + "x"),
        ("random bytes", String::from_utf8_lossy(&random).into_owned()),
        ("english", english.repeat(MB / english.len())),
    ]
}

fn bench(c: &mut Criterion) {
    let tok = Tokenizer::from_tiktoken(RANKS, Some(TOKCFG), K3_PATTERN).expect("the trained tokenizer loads");
    let mut g = c.benchmark_group("tokenize 1 MB");
    g.sample_size(10);
    for (name, text) in texts() {
        g.throughput(Throughput::Bytes(text.len() as u64));
        g.bench_function(BenchmarkId::from_parameter(name), |b| b.iter(|| tok.encode_ordinary(&text).len()));
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
