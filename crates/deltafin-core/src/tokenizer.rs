//! K3's tokenizer: byte-level BPE from a tiktoken rank file (`base64(bytes) rank` per line), the
//! 256 reserved ids after the ranks, and the Unicode split pattern; plus a `tokenizer.json`
//! loader (through the `tokenizers` crate) for draft models.
//!
//! Ordinary encoding never produces a special id, whatever the text contains: control tokens
//! enter a prompt only through [`crate::ChatFormat`], which inserts them by id.

use std::collections::HashMap;

use base64::Engine as _;

use crate::error::{Error, Result};

/// K3's pre-tokenizer split pattern (the o200k family, with Han runs split out).
pub const K3_PATTERN: &str = r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// K3's named reserved tokens, by offset after the BPE ranks.
const K3_SPECIALS: &[(usize, &str)] = &[
    (0, "[BOS]"),
    (1, "[EOS]"),
    (2, "<|end_of_msg|>"),
    (3, "<|open|>"),
    (4, "<|close|>"),
    (5, "<|sep|>"),
    (6, "[start_header_id]"),
    (7, "[end_header_id]"),
    (9, "[EOT]"),
    (254, "[UNK]"),
    (255, "[PAD]"),
];

/// The spelling of reserved id `bpe_ranks + offset` in K3's tokenizer.
pub fn reserved_token_name(offset: usize, bpe_ranks: usize) -> String {
    K3_SPECIALS
        .iter()
        .find(|(o, _)| *o == offset)
        .map(|(_, s)| s.to_string())
        .unwrap_or_else(|| format!("<|reserved_token_{}|>", bpe_ranks + offset))
}

/// Number of reserved ids after the BPE ranks.
pub const RESERVED: usize = 256;

/// A tiktoken-format byte-level BPE tokenizer with named special tokens.
pub struct Tokenizer {
    ranks: HashMap<Vec<u8>, u32>,
    /// Bytes of every BPE id.
    bytes_of: Vec<Vec<u8>>,
    specials: HashMap<String, u32>,
    special_names: HashMap<u32, String>,
    split: fancy_regex::Regex,
}

impl Tokenizer {
    /// Builds from the text of a `tiktoken.model` file, the optional text of
    /// `tokenizer_config.json` (whose `added_tokens_decoder` names the reserved ids; K3's
    /// defaults are used without it) and a split pattern.
    pub fn from_tiktoken(ranks_text: &str, tokenizer_config: Option<&str>, pattern: &str) -> Result<Tokenizer> {
        let mut ranks = HashMap::new();
        let mut bytes_of: Vec<Vec<u8>> = Vec::new();
        for (lineno, line) in ranks_text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let bad = |why: &str| Error::Tokenizer(format!("rank file line {}: {why}: {line:?}", lineno + 1));
            let (b64, rank) = line.split_once(' ').ok_or_else(|| bad("expected `base64 rank`"))?;
            let bytes = base64::engine::general_purpose::STANDARD.decode(b64).map_err(|_| bad("bad base64"))?;
            let rank: u32 = rank.trim().parse().map_err(|_| bad("bad rank"))?;
            if rank as usize != bytes_of.len() {
                return Err(bad(&format!("ranks must be consecutive from 0 (expected {})", bytes_of.len())));
            }
            if ranks.insert(bytes.clone(), rank).is_some() {
                return Err(bad("duplicate token bytes"));
            }
            bytes_of.push(bytes);
        }
        if bytes_of.is_empty() {
            return Err(Error::Tokenizer("rank file is empty".into()));
        }
        for b in 0..=255u8 {
            if !ranks.contains_key(&vec![b]) {
                return Err(Error::Tokenizer(format!("rank file lacks the single byte 0x{b:02x}; byte-level BPE needs all 256")));
            }
        }
        let n = bytes_of.len();
        let mut specials: HashMap<String, u32> = HashMap::new();
        if let Some(text) = tokenizer_config {
            let v: serde_json::Value = serde_json::from_str(text).map_err(|e| Error::Tokenizer(format!("tokenizer_config.json: {e}")))?;
            if let Some(map) = v.get("added_tokens_decoder").and_then(|m| m.as_object()) {
                for (id, tok) in map {
                    let id: u32 = id.parse().map_err(|_| Error::Tokenizer(format!("tokenizer_config.json: id {id:?} is not a number")))?;
                    let content = tok
                        .get("content")
                        .and_then(|c| c.as_str())
                        .ok_or_else(|| Error::Tokenizer(format!("tokenizer_config.json: id {id} has no content")))?;
                    specials.insert(content.to_string(), id);
                }
            }
        }
        if specials.is_empty() {
            for off in 0..RESERVED {
                let name = reserved_token_name(off, n);
                specials.insert(name, (n + off) as u32);
            }
        }
        let special_names = specials.iter().map(|(k, v)| (*v, k.clone())).collect();
        let split = fancy_regex::Regex::new(pattern).map_err(|e| Error::Tokenizer(format!("split pattern: {e}")))?;
        Ok(Tokenizer { ranks, bytes_of, specials, special_names, split })
    }

    /// Number of BPE ranks.
    pub fn bpe_len(&self) -> usize {
        self.bytes_of.len()
    }

    /// BPE ranks plus specials.
    pub fn vocab_len(&self) -> usize {
        self.bytes_of.len().max(self.special_names.keys().map(|&k| k as usize + 1).max().unwrap_or(0))
    }

    /// The id of a special token by its spelling (`<|open|>`).
    pub fn special(&self, name: &str) -> Option<u32> {
        self.specials.get(name).copied()
    }

    /// Encodes text with no special tokens: `<|open|>` in the text is just characters.
    pub fn encode_ordinary(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        for m in self.split.find_iter(text) {
            // The pattern has no construct that can fail at runtime on valid UTF-8 except
            // backtracking limits; fall back to the whole remaining text as one piece.
            let piece = match m {
                Ok(m) => m.as_str(),
                Err(_) => text,
            };
            self.encode_piece(piece.as_bytes(), &mut out);
        }
        out
    }

    /// Encodes text where special spellings (`<|open|>`, `[EOS]`, ...) become their ids. Only for
    /// trusted text (tests, templates); user text goes through [`Tokenizer::encode_ordinary`].
    pub fn encode_with_specials(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let next = self
                .specials
                .keys()
                .filter_map(|s| rest.find(s.as_str()).map(|i| (i, s)))
                .min_by_key(|(i, s)| (*i, std::cmp::Reverse(s.len())));
            match next {
                Some((i, s)) => {
                    out.extend(self.encode_ordinary(&rest[..i]));
                    out.push(self.specials[s]);
                    rest = &rest[i + s.len()..];
                }
                None => {
                    out.extend(self.encode_ordinary(rest));
                    break;
                }
            }
        }
        out
    }

    fn encode_piece(&self, piece: &[u8], out: &mut Vec<u32>) {
        if let Some(&r) = self.ranks.get(piece) {
            out.push(r);
            return;
        }
        // Byte-pair merge: repeatedly join the adjacent pair with the lowest rank.
        let mut parts: Vec<(usize, usize)> = (0..piece.len()).map(|i| (i, i + 1)).collect();
        loop {
            let mut best: Option<(u32, usize)> = None;
            for i in 0..parts.len().saturating_sub(1) {
                if let Some(&r) = self.ranks.get(&piece[parts[i].0..parts[i + 1].1]) {
                    if best.is_none_or(|(br, _)| r < br) {
                        best = Some((r, i));
                    }
                }
            }
            match best {
                Some((_, i)) => {
                    parts[i].1 = parts[i + 1].1;
                    parts.remove(i + 1);
                }
                None => break,
            }
        }
        out.extend(parts.iter().map(|&(a, b)| self.ranks[&piece[a..b]]));
    }

    /// The bytes of one id (a special's spelling for reserved ids; empty if unknown).
    pub fn id_bytes(&self, id: u32) -> Vec<u8> {
        match self.bytes_of.get(id as usize) {
            Some(b) => b.clone(),
            None => self.special_names.get(&id).map(|s| s.as_bytes().to_vec()).unwrap_or_default(),
        }
    }

    /// Whether `id` is a special (reserved) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.special_names.contains_key(&id)
    }

    /// Decodes ids to text (invalid UTF-8 replaced).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().flat_map(|&i| self.id_bytes(i)).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// A streaming decoder that emits text only once its UTF-8 is complete.
    pub fn stream(&self) -> StreamDecoder<'_> {
        StreamDecoder { tok: self, pending: Vec::new() }
    }
}

/// Turns ids into text incrementally, holding back incomplete UTF-8 sequences.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    pending: Vec<u8>,
}

impl StreamDecoder<'_> {
    /// Adds one id; returns the text that became complete. Special (reserved and control)
    /// tokens are not text: they add nothing.
    pub fn push(&mut self, id: u32) -> String {
        if self.tok.is_special(id) {
            return String::new();
        }
        self.pending.extend(self.tok.id_bytes(id));
        match std::str::from_utf8(&self.pending) {
            Ok(s) => {
                let s = s.to_string();
                self.pending.clear();
                s
            }
            Err(e) => {
                let valid = e.valid_up_to();
                // A sequence that can never complete is emitted lossily rather than held forever.
                if e.error_len().is_some() || self.pending.len() - valid > 3 {
                    let s = String::from_utf8_lossy(&self.pending).into_owned();
                    self.pending.clear();
                    return s;
                }
                let s = String::from_utf8_lossy(&self.pending[..valid]).into_owned();
                self.pending.drain(..valid);
                s
            }
        }
    }
    /// Whatever is left (lossy).
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}

/// A `tokenizer.json` tokenizer (draft models ship these), via the `tokenizers` crate.
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
}

impl HfTokenizer {
    /// Parses the bytes of a `tokenizer.json`.
    pub fn from_json_bytes(bytes: &[u8]) -> Result<HfTokenizer> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| Error::Tokenizer(format!("tokenizer.json: {e}")))?;
        Ok(HfTokenizer { inner })
    }
    /// Encodes text without adding special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.inner.encode(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?.get_ids().to_vec())
    }
    /// Decodes ids.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| Error::Tokenizer(e.to_string()))
    }
    /// Vocabulary size including added tokens.
    pub fn vocab_len(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
    /// The bytes of token `id` in a byte-level BPE vocabulary (tokens spelled with GPT-2's
    /// byte-to-character map, as Qwen's and most BPE `tokenizer.json` files are); `None` for an
    /// unknown id or a token that is not spelled that way.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        self.inner.id_to_token(id)?.chars().map(byte_level_byte).collect()
    }
}

/// GPT-2's byte-level map: printable Latin-1 bytes stand for themselves, the other 68 bytes for
/// the characters from U+0100 on, in byte order. Index: byte; value: its character.
fn byte_level_chars() -> &'static [char; 256] {
    static MAP: std::sync::OnceLock<[char; 256]> = std::sync::OnceLock::new();
    MAP.get_or_init(|| {
        let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let mut map = ['\0'; 256];
        let mut shifted = 256;
        for b in 0..256u32 {
            let c = if printable(b) {
                b
            } else {
                shifted += 1;
                shifted - 1
            };
            map[b as usize] = char::from_u32(c).expect("below U+0200");
        }
        map
    })
}

/// The byte the byte-level map spells as `c` (the map inverted once: its characters all lie below
/// U+0200).
fn byte_level_byte(c: char) -> Option<u8> {
    static INVERSE: std::sync::OnceLock<[Option<u8>; 512]> = std::sync::OnceLock::new();
    let inverse = INVERSE.get_or_init(|| {
        let mut inv = [None; 512];
        for (b, &c) in byte_level_chars().iter().enumerate() {
            inv[c as usize] = Some(b as u8);
        }
        inv
    });
    inverse.get(c as usize).copied().flatten()
}

/// `bytes` spelled with GPT-2's byte-level map (how byte-level BPE `tokenizer.json` files write
/// their vocabulary).
pub fn byte_level_spelling(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| byte_level_chars()[b as usize]).collect()
}

#[cfg(test)]
mod tests;
