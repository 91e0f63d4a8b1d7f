//! Tokenizer: the fixture's cases, the real o200k rank file against tiktoken-rs, the linear
//! splitter and heap merge against the backtracking pattern and the rescanning merge, and texts
//! that once never returned.

use super::*;

const RANKS: &str = include_str!("../../../../tests/fixtures/tiny-k3-dev/checkpoint/tiktoken.model");
const TOKCFG: &str = include_str!("../../../../tests/fixtures/tiny-k3-dev/checkpoint/tokenizer_config.json");
const REFERENCE: &str = include_str!("../../../../tests/fixtures/tiny-k3-dev/reference.json");

#[test]
fn fixture_tokenizer_cases_match() {
    let tok = Tokenizer::from_tiktoken(RANKS, Some(TOKCFG), K3_PATTERN).unwrap();
    let r: serde_json::Value = serde_json::from_str(REFERENCE).unwrap();
    let cases = r["tokenizer"]["cases"].as_array().unwrap();
    assert!(cases.len() >= 5);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want: Vec<u32> = c["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let got = match c["mode"].as_str().unwrap() {
            "ordinary" => tok.encode_ordinary(text),
            _ => tok.encode_with_specials(text),
        };
        assert_eq!(got, want, "{text:?}");
        assert_eq!(tok.decode(&got), text);
    }
    let prompt = r["prompt_text"].as_str().unwrap();
    let ids: Vec<u32> = r["prompt_token_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    assert_eq!(tok.encode_ordinary(prompt), ids);
    assert_eq!(tok.special("<|end_of_msg|>"), Some(1002));
    assert_eq!(tok.special("[PAD]"), Some(1255));
    // Without tokenizer_config.json, K3's default spellings land at the same offsets.
    let bare = Tokenizer::from_tiktoken(RANKS, None, K3_PATTERN).unwrap();
    for name in ["[BOS]", "<|open|>", "<|sep|>", "[EOT]", "[UNK]", "[PAD]"] {
        assert_eq!(bare.special(name), tok.special(name), "{name}");
    }
}

#[test]
fn rank_file_errors_are_clear() {
    let e = Tokenizer::from_tiktoken("AA== 0\nAQ== 5\n", None, K3_PATTERN).err().unwrap().to_string();
    assert!(e.contains("line 2") && e.contains("consecutive"), "{e}");
    let e = Tokenizer::from_tiktoken("!!! 0\n", None, K3_PATTERN).err().unwrap().to_string();
    assert!(e.contains("base64"), "{e}");
    let e = Tokenizer::from_tiktoken("AA== 0\n", None, K3_PATTERN).err().unwrap().to_string();
    assert!(e.contains("0x01"), "{e}");
}

#[test]
fn streaming_decoder_holds_partial_utf8() {
    let tok = Tokenizer::from_tiktoken(RANKS, Some(TOKCFG), K3_PATTERN).unwrap();
    let ids = tok.encode_ordinary("café 🙂 ok");
    let mut s = tok.stream();
    let mut text = String::new();
    for id in ids {
        let piece = s.push(id);
        assert!(!piece.contains('\u{fffd}'));
        text.push_str(&piece);
    }
    text.push_str(&s.finish());
    assert_eq!(text, "café 🙂 ok");
}

#[test]
fn reserved_and_control_tokens_never_appear_in_text() {
    let tok = Tokenizer::from_tiktoken(RANKS, Some(TOKCFG), K3_PATTERN).unwrap();
    let mut ids = tok.encode_ordinary("ab");
    let specials: Vec<u32> = (tok.bpe_len()..tok.vocab_len()).map(|i| i as u32).filter(|&i| tok.is_special(i)).collect();
    assert!(specials.len() > 2);
    ids.splice(1..1, specials.iter().copied());
    let mut s = tok.stream();
    let text: String = ids.iter().map(|&i| s.push(i)).collect::<String>() + &s.finish();
    assert_eq!(text, "ab");
    let mut split = crate::reply::ReplySplitter::new(&tok, false, vec![]);
    let mut text = String::new();
    for &i in &ids {
        text.extend(split.push(&tok, i).into_iter().map(|(_, t)| t));
    }
    text.extend(split.finish().into_iter().map(|(_, t)| t));
    assert_eq!(text, "ab", "completions text carries no reserved token");
}

/// The o200k rank file shipped inside the `tiktoken-rs` crate, found through `cargo metadata`.
fn o200k_file() -> std::path::PathBuf {
    let out = std::process::Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--manifest-path", concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")])
        .output()
        .expect("cargo metadata");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let pkg = v["packages"].as_array().unwrap().iter().find(|p| p["name"] == "tiktoken-rs").expect("tiktoken-rs in the dependency graph");
    let manifest = std::path::PathBuf::from(pkg["manifest_path"].as_str().unwrap());
    manifest.parent().unwrap().join("assets/o200k_base.tiktoken")
}

#[test]
fn real_o200k_rank_file_matches_tiktoken_rs() {
    let text = std::fs::read_to_string(o200k_file()).unwrap();
    let pat = tiktoken_rs::O200K_BASE_PAT_STR.to_string();
    let ours = Tokenizer::from_tiktoken(&text, None, &pat).unwrap();
    assert_eq!(ours.bpe_len(), 199998);
    let theirs = tiktoken_rs::o200k_base().unwrap();
    for s in [
        "Hello, world! This is Deltafin streaming Kimi K3 experts from SSDs.",
        "  multiple   spaces\n\nand newlines\r\n end",
        "CJK 日本語の文章 中文字符 and emoji 🙂🚀 café naïve",
        "don't won't I'm you'll THEY'RE 1234567 3.14159",
        "fn main() {\n    println!(\"{}\", x + 1);\n}\n",
    ] {
        let want: Vec<u32> = theirs.encode_ordinary(s).into_iter().collect();
        assert_eq!(ours.encode_ordinary(s), want, "{s:?}");
        assert_eq!(ours.decode(&want), s);
    }
}

#[test]
fn hf_tokenizer_json_loads() {
    let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,
      "pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
      "model":{"type":"WordLevel","vocab":{"hello":0,"world":1,"[UNK]":2},"unk_token":"[UNK]"}}"#;
    let t = HfTokenizer::from_json_bytes(json.as_bytes()).unwrap();
    assert_eq!(t.encode("hello world").unwrap(), vec![0, 1]);
    assert_eq!(t.vocab_len(), 3);
    assert!(HfTokenizer::from_json_bytes(b"{}").is_err());
}

/// The merge as it was first written (rescan every pair after each merge): the heap-driven
/// [`bpe_merge`] must give the same parts.
fn rescanning_merge(piece: &[u8], rank: impl Fn(&[u8]) -> Option<u32>) -> Vec<usize> {
    let mut parts: Vec<(usize, usize)> = (0..piece.len()).map(|i| (i, i + 1)).collect();
    loop {
        let mut best: Option<(u32, usize)> = None;
        for i in 0..parts.len().saturating_sub(1) {
            if let Some(r) = rank(&piece[parts[i].0..parts[i + 1].1]) {
                if best.is_none_or(|(br, _)| r < br) {
                    best = Some((r, i));
                }
            }
        }
        let Some((_, i)) = best else { break };
        parts[i].1 = parts[i + 1].1;
        parts.remove(i + 1);
    }
    std::iter::once(0).chain(parts.iter().map(|p| p.1)).collect()
}

/// A small deterministic generator for the random cases (no dependency for it).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Characters that exercise every alternative of the split patterns: spaces of several kinds and
/// line breaks (the lookahead), letters of every case class, marks, Han, digits, apostrophes.
const TRICKY: &[char] = &[
    ' ', ' ', ' ', '\t', '\n', '\r', '\u{a0}', '\u{3000}', 'a', 'b', 's', 'T', 'X', 'é', 'Ǆ', 'ǅ', '\u{301}', '日', '本', '1', '2', '3',
    '.', ',', '\'', '/', '(', '🙂', 'ß', 'Ω',
];

fn random_text(rng: &mut Lcg, len: usize) -> String {
    (0..len).map(|_| TRICKY[rng.below(TRICKY.len())]).collect()
}

#[test]
fn heap_merge_equals_the_rescanning_merge() {
    let tok = Tokenizer::from_tiktoken(RANKS, Some(TOKCFG), K3_PATTERN).unwrap();
    let rank = |s: &[u8]| tok.ranks.get(s);
    let mut rng = Lcg(7);
    let words = ["the", "ing", "  ", "ab", "é", "tion", " a", "aaaa", "\n\n"];
    for case in 0..400 {
        let piece: String = (0..1 + rng.below(40)).map(|_| words[rng.below(words.len())]).collect();
        let piece = if case % 3 == 0 {
            {
                let n = 1 + rng.below(30);
                random_text(&mut rng, n)
            }
        } else {
            piece
        };
        let p = piece.as_bytes();
        assert_eq!(bpe_merge(p, tok.max_token_len, rank), rescanning_merge(p, rank), "{piece:?}");
    }
}

#[test]
fn linear_splitter_cuts_where_the_backtracking_pattern_does() {
    for pattern in [K3_PATTERN, tiktoken_rs::O200K_BASE_PAT_STR] {
        let linear = split::Splitter::new(pattern).unwrap();
        assert!(matches!(linear, split::Splitter::Linear(_)), "tiktoken's patterns take the linear splitter");
        let backtracking = split::Splitter::Backtracking(fancy_regex::Regex::new(pattern).unwrap());
        let pieces = |s: &split::Splitter, text: &str| {
            let mut v = Vec::new();
            assert!(s.for_each_piece(text, &mut |p| {
                v.push(p.to_string());
                true
            }));
            v
        };
        let mut rng = Lcg(11);
        for _ in 0..3000 {
            let n = rng.below(48);
            let text = random_text(&mut rng, n);
            assert_eq!(pieces(&linear, &text), pieces(&backtracking, &text), "{text:?}");
        }
    }
}

#[test]
fn random_text_matches_tiktoken_rs() {
    let text = std::fs::read_to_string(o200k_file()).unwrap();
    let ours = Tokenizer::from_tiktoken(&text, None, tiktoken_rs::O200K_BASE_PAT_STR).unwrap();
    let theirs = tiktoken_rs::o200k_base().unwrap();
    let mut rng = Lcg(3);
    for _ in 0..1500 {
        let n = rng.below(64);
        let s = random_text(&mut rng, n);
        let want: Vec<u32> = theirs.encode_ordinary(&s).into_iter().collect();
        assert_eq!(ours.encode_ordinary(&s), want, "{s:?}");
    }
}

/// Texts that once never returned (1 MB of one letter: the splitter's backtrack limit, then the
/// same error forever) or took seconds to hours (one long piece merged by rescanning). Each must
/// come back and round-trip; the time is the tokenizer bench's, and the deadline here only turns
/// a hang into a failure.
#[test]
fn pathological_texts_encode_and_round_trip() {
    let mut rng = Lcg(5);
    let random_bytes: Vec<u8> = (0..1_000_000).map(|_| rng.next() as u8).collect();
    let texts = vec![
        "a".repeat(1_000_000),
        "é".repeat(500_000),
        "ab".repeat(500_000),
        " ".repeat(30_001) + "x",
        " ".repeat(1_000_000) + "x",
        String::from_utf8_lossy(&random_bytes).into_owned(),
    ];
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let tok = Tokenizer::from_tiktoken(RANKS, Some(TOKCFG), K3_PATTERN).unwrap();
        for t in texts {
            let ids = tok.encode_ordinary(&t);
            let _ = tx.send((tok.decode(&ids) == t, ids.len(), t.len()));
        }
    });
    for _ in 0..6 {
        let (same, ids, bytes) = rx.recv_timeout(std::time::Duration::from_secs(120)).expect("tokenizing a 1 MB text did not return");
        assert!(same, "a text of {bytes} bytes did not round-trip");
        assert!(ids > 0 && ids <= bytes);
    }
}

#[test]
fn encoding_within_a_limit_stops_past_it() {
    let tok = Tokenizer::from_tiktoken(RANKS, Some(TOKCFG), K3_PATTERN).unwrap();
    let text = "the quick brown fox jumps over the lazy dog ".repeat(50);
    let all = tok.encode_ordinary(&text);
    assert_eq!(tok.encode_ordinary_within(&text, all.len()), Some(all.clone()));
    assert_eq!(tok.encode_ordinary_within(&text, all.len() - 1), None);
    // Far too long for the limit: refused before any merge runs.
    assert_eq!(tok.encode_ordinary_within(&"x".repeat(10_000_000), 100), None);
}

/// A caller's stop flag ends tokenizing between pieces, in plain encoding and in a chat render;
/// unset, the ids are `encode_ordinary`'s.
#[test]
fn a_stop_flag_ends_tokenizing_and_an_unset_one_changes_nothing() {
    let tok = Tokenizer::from_tiktoken(RANKS, Some(TOKCFG), K3_PATTERN).unwrap();
    let text = "numbers and boats ".repeat(2000);
    let go: &dyn Fn() -> bool = &|| false;
    // Stops partway: after a few pieces.
    let asked = std::cell::Cell::new(0);
    let stop: &dyn Fn() -> bool = &|| {
        asked.set(asked.get() + 1);
        asked.get() > 10
    };
    assert_eq!(tok.encode_ordinary_until(&text, usize::MAX, go).unwrap(), Some(tok.encode_ordinary(&text)));
    assert!(matches!(tok.encode_ordinary_until(&text, usize::MAX, stop), Err(Error::Stopped)));
    let stop: &dyn Fn() -> bool = &|| true;
    let chat = crate::ChatFormat::new(&tok).unwrap();
    let msgs = [crate::Message::new(crate::Role::User, text.clone())];
    let want = chat.render(&msgs, None).unwrap();
    assert_eq!(crate::ChatFormat::new(&tok).unwrap().stop_when(go).render(&msgs, None).unwrap(), want);
    assert!(matches!(crate::ChatFormat::new(&tok).unwrap().stop_when(stop).render(&msgs, None), Err(Error::Stopped)));
}
