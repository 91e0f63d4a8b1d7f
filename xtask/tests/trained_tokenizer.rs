//! The tiny trained K3's tokenizer (`cargo xtask train-tokenizer`, committed under
//! `training/tokenizer`) loads through the engine's own tokenizer path, round-trips text, places
//! K3's special tokens right after its ranks, and compresses English prose and technical text
//! like a trained BPE (a byte-level one would give 1 byte per token).

use std::path::PathBuf;

use deltafin_core::{Tokenizer, K3_PATTERN};

fn load() -> Tokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../training/tokenizer");
    let ranks = std::fs::read_to_string(dir.join("tiktoken.model")).unwrap();
    let cfg = std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap();
    Tokenizer::from_tiktoken(&ranks, Some(&cfg), K3_PATTERN).unwrap()
}

#[test]
fn the_trained_tokenizer_loads_round_trips_and_compresses() {
    let tok = load();
    assert_eq!(tok.bpe_len(), 8192);
    assert_eq!(tok.special("[BOS]"), Some(8192));
    assert_eq!(tok.special("[EOS]"), Some(8193));
    assert!(tok.special("<|open|>").is_some() && tok.special("<|sep|>").is_some());
    let prose = "It was a bright cold day in April, and the clocks were striking thirteen. \"Must be that \
                 Chatterer,\" said Buster Bear to himself, as he went slowly down the hill towards the river.";
    let tech = "The kernel's memory allocator returns NULL when the request cannot be met; callers must \
                check the result. In Python, a list comprehension such as [x * 2 for x in range(10)] builds a new list.";
    for (name, text, min) in [("prose", prose, 3.5), ("tech", tech, 3.2)] {
        let ids = tok.encode_ordinary(text);
        assert_eq!(tok.decode(&ids), text, "{name} round-trips");
        let bytes_per_token = text.len() as f64 / ids.len() as f64;
        eprintln!("{name}: {} bytes in {} tokens, {bytes_per_token:.2} bytes per token", text.len(), ids.len());
        assert!(bytes_per_token > min, "{name}: {bytes_per_token:.2} bytes per token");
        assert!(ids.iter().all(|&i| (i as usize) < tok.bpe_len()), "ordinary text never yields a special id");
    }
}
