//! What structured output costs at K3's vocabulary size (163,584 BPE ranks, the first of the real
//! o200k file, plus K3's 256 reserved ids): compiling the vocabulary once per model, compiling a
//! schema per request, and the per-token work (the allowed-id mask, then the commit) while a
//! reply of valid JSON is fed through the grammar.
//!
//! `cargo bench -p deltafin-grammar --bench mask`

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use deltafin_core::{Tokenizer, K3_PATTERN};
use deltafin_grammar::Grammars;
use deltafin_sched::GenerateOptions;

const RANKS: u32 = 163_584;

fn k3_sized_tokenizer() -> Arc<Tokenizer> {
    use base64::Engine as _;
    let bpe = tiktoken_rs::o200k_base_singleton();
    let text: String = (0..RANKS)
        .map(|r| format!("{} {r}\n", base64::engine::general_purpose::STANDARD.encode(bpe.decode_bytes(&[r]).expect("an o200k rank"))))
        .collect();
    Arc::new(Tokenizer::from_tiktoken(&text, None, K3_PATTERN).expect("the ranks load"))
}

fn bench(c: &mut Criterion) {
    let tok = k3_sized_tokenizer();
    let schema = serde_json::json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "items": {"type": "integer"}}}, "required": ["city", "unit", "days"], "additionalProperties": false});
    let reply = r#"{"city":"Paris and its suburbs","unit":"celsius","days":[1,2,3,4,5,6,7,8,9,10,11,12]}"#;
    let ids = tok.encode_ordinary(reply);
    let mut g = c.benchmark_group("structured output, K3-sized vocabulary");
    g.sample_size(10);
    g.bench_function("compile the vocabulary (once per model)", |b| b.iter(|| Grammars::new(tok.clone()).expect("compiles")));
    let grammars = Grammars::new(tok.clone()).expect("compiles");
    g.bench_function("compile a schema (once per request)", |b| b.iter(|| grammars.json(Some(&schema)).expect("compiles")));
    // Logits that put each reply token first: the choice is the token, through mask and commit.
    let vocab = tok.vocab_len();
    let rows: Vec<Vec<f32>> = ids.iter().map(|&id| (0..vocab).map(|i| if i == id as usize { 1.0 } else { 0.0 }).collect()).collect();
    g.bench_function(format!("mask + commit, per token ({} tokens of JSON)", ids.len()), |b| {
        b.iter_custom(|iters| {
            let mut total = std::time::Duration::ZERO;
            for _ in 0..iters {
                let opts = GenerateOptions::new(ids.len()).constraint(Some(grammars.json(Some(&schema)).expect("compiles")));
                let t = std::time::Instant::now();
                for (p, (row, &id)) in rows.iter().zip(&ids).enumerate() {
                    assert_eq!(opts.next_token(row, p).expect("allowed"), id);
                }
                total += t.elapsed() / ids.len() as u32;
            }
            total
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
