//! Tokenizer: the fixture's cases, and the real o200k rank file against tiktoken-rs.

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
