//! K3's tokenizer: byte-level BPE from a tiktoken rank file (`base64(bytes) rank` per line), the
//! 256 reserved ids after the ranks, and the Unicode split pattern; plus a `tokenizer.json`
//! loader (through the `tokenizers` crate) for draft models.
//!
//! Ordinary encoding never produces a special id, whatever the text contains: control tokens
//! enter a prompt only through [`crate::ChatFormat`], which inserts them by id.

mod split;
mod vocab;

use std::collections::HashMap;

use base64::Engine as _;

use crate::error::{Error, Result};
use split::Splitter;
use vocab::Vocab;

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
    /// Every BPE id's bytes and the id of each token's bytes (looked up once or twice per merge).
    ranks: Vocab,
    specials: HashMap<String, u32>,
    special_names: HashMap<u32, String>,
    split: Splitter,
    /// The longest BPE token in bytes: no longer span can have a rank.
    max_token_len: usize,
}

impl Tokenizer {
    /// Builds from the text of a `tiktoken.model` file, the optional text of
    /// `tokenizer_config.json` (whose `added_tokens_decoder` names the reserved ids; K3's
    /// defaults are used without it) and a split pattern.
    pub fn from_tiktoken(ranks_text: &str, tokenizer_config: Option<&str>, pattern: &str) -> Result<Tokenizer> {
        let mut ranks = Vocab::new();
        for (lineno, line) in ranks_text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let bad = |why: &str| Error::Tokenizer(format!("rank file line {}: {why}: {line:?}", lineno + 1));
            let (b64, rank) = line.split_once(' ').ok_or_else(|| bad("expected `base64 rank`"))?;
            let bytes = base64::engine::general_purpose::STANDARD.decode(b64).map_err(|_| bad("bad base64"))?;
            let rank: u32 = rank.trim().parse().map_err(|_| bad("bad rank"))?;
            if rank as usize != ranks.len() {
                return Err(bad(&format!("ranks must be consecutive from 0 (expected {})", ranks.len())));
            }
            if !ranks.push(&bytes) {
                return Err(bad("duplicate token bytes"));
            }
        }
        ranks.shrink();
        if ranks.len() == 0 {
            return Err(Error::Tokenizer("rank file is empty".into()));
        }
        for b in 0..=255u8 {
            if ranks.get(&[b]).is_none() {
                return Err(Error::Tokenizer(format!("rank file lacks the single byte 0x{b:02x}; byte-level BPE needs all 256")));
            }
        }
        let n = ranks.len();
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
        let split = Splitter::new(pattern)?;
        let max_token_len = ranks.max_len();
        Ok(Tokenizer { ranks, specials, special_names, split, max_token_len })
    }

    /// Number of BPE ranks.
    pub fn bpe_len(&self) -> usize {
        self.ranks.len()
    }

    /// The longest token's bytes: a text of n bytes has at least n / this many tokens.
    pub fn max_token_len(&self) -> usize {
        self.max_token_len.max(1)
    }

    /// Heap bytes the tokenizer holds (its vocabulary and specials; the split pattern's automaton
    /// is not counted): what a RAM budget charges for it.
    pub fn heap_bytes(&self) -> usize {
        let specials: usize = self.specials.keys().map(|k| 2 * (k.len() + 48)).sum();
        self.ranks.heap_bytes() + specials
    }

    /// BPE ranks plus specials.
    pub fn vocab_len(&self) -> usize {
        self.ranks.len().max(self.special_names.keys().map(|&k| k as usize + 1).max().unwrap_or(0))
    }

    /// The id of a special token by its spelling (`<|open|>`).
    pub fn special(&self, name: &str) -> Option<u32> {
        self.specials.get(name).copied()
    }

    /// Encodes text with no special tokens: `<|open|>` in the text is just characters. Linear in
    /// the text's length whatever it holds (a splitter without backtracking, a heap-driven merge).
    pub fn encode_ordinary(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        self.split.for_each_piece(text, &mut |piece| {
            self.encode_piece(piece.as_bytes(), &mut out);
            true
        });
        out
    }

    /// [`Tokenizer::encode_ordinary`] that gives up as soon as the text has more than `max_tokens`
    /// tokens (`None`), so text too long for a context costs no more than the context's worth of
    /// work. `Some` holds exactly `encode_ordinary`'s ids.
    pub fn encode_ordinary_within(&self, text: &str, max_tokens: usize) -> Option<Vec<u32>> {
        self.encode_ordinary_until(text, max_tokens, &|| false).ok().flatten()
    }

    /// [`Tokenizer::encode_ordinary_within`] that also gives up, with [`Error::Stopped`], once
    /// `stop()` is true (asked between pieces: a request that goes away mid-text stops its
    /// tokenizing within a piece's work).
    pub fn encode_ordinary_until(&self, text: &str, max_tokens: usize, stop: &dyn Fn() -> bool) -> Result<Option<Vec<u32>>> {
        let mut out = Vec::new();
        // A text with fewer bytes than tokens does not exist: skip the work when even the
        // longest tokens could not fit it.
        if text.len() / self.max_token_len.max(1) > max_tokens {
            return Ok(None);
        }
        let mut stopped = false;
        let complete = self.split.for_each_piece(text, &mut |piece| {
            if stop() {
                stopped = true;
                return false;
            }
            self.encode_piece(piece.as_bytes(), &mut out);
            out.len() <= max_tokens
        });
        if stopped {
            return Err(Error::Stopped);
        }
        Ok((complete && out.len() <= max_tokens).then_some(out))
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
        if let Some(r) = self.ranks.get(piece) {
            out.push(r);
            return;
        }
        let parts = bpe_merge(piece, self.max_token_len, |span| self.ranks.get(span));
        out.extend(parts.windows(2).map(|w| self.ranks.get(&piece[w[0]..w[1]]).expect("a merged part is a token")));
    }

    /// The bytes of one id (a special's spelling for reserved ids; empty if unknown).
    pub fn id_bytes(&self, id: u32) -> Vec<u8> {
        match self.ranks.bytes(id) {
            Some(b) => b.to_vec(),
            None => self.special_names.get(&id).map(|s| s.as_bytes().to_vec()).unwrap_or_default(),
        }
    }

    /// The BPE id whose bytes are `bytes`, if one is.
    pub fn bpe_id(&self, bytes: &[u8]) -> Option<u32> {
        self.ranks.get(bytes)
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

/// Byte-pair merging of one piece: repeatedly joins the adjacent pair of parts whose joined bytes
/// have the lowest rank, the leftmost of equal ranks, until no pair has a rank. Returns the parts'
/// boundaries (`0`, ..., `piece.len()`).
///
/// A heap holds every adjacent pair with a rank; a popped pair whose parts have since changed is
/// stale and skipped. Each merge pushes at most two pairs, so a piece of n bytes costs
/// O(n log n), where rescanning all pairs after each merge cost O(n^2) (a 30,000-space piece
/// took seconds). The merge order, and so the result, is exactly the rescanning loop's: the heap's
/// minimum by (rank, start) is that loop's choice.
fn bpe_merge(piece: &[u8], max_token_len: usize, rank: impl Fn(&[u8]) -> Option<u32>) -> Vec<usize> {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    // Positions as u32 (a piece is at most a request body, far below 4 GiB): a heap entry of 16
    // bytes, where a megabyte-long piece's heap outgrows the caches and each pop misses them.
    assert!(piece.len() < u32::MAX as usize, "a piece of {} bytes", piece.len());
    let n = piece.len() as u32;
    // Parts are named by their first byte; `end[i]` is where part i ends (0 for a merged-away
    // part), `prev[i]` the part before it.
    let mut end: Vec<u32> = (1..=n).collect();
    let mut prev: Vec<u32> = (0..n).map(|i| i.wrapping_sub(1)).collect();
    let pair_rank = |a: u32, c: u32| if (c - a) as usize > max_token_len { None } else { rank(&piece[a as usize..c as usize]) };
    // (rank, left part, where the left part ends, where the right part ends)
    let mut heap: BinaryHeap<Reverse<(u32, u32, u32, u32)>> =
        (0..n.saturating_sub(1)).filter_map(|i| pair_rank(i, i + 2).map(|r| Reverse((r, i, i + 1, i + 2)))).collect();
    while let Some(Reverse((_, i, mid, right_end))) = heap.pop() {
        // Stale unless part i still ends at `mid` and the part after it still ends at
        // `right_end` (parts only grow, so equal ends mean equal bytes).
        if end[i as usize] != mid || end[mid as usize] != right_end {
            continue;
        }
        end[i as usize] = right_end;
        end[mid as usize] = 0;
        if right_end < n {
            prev[right_end as usize] = i;
            let after = end[right_end as usize];
            if let Some(r) = pair_rank(i, after) {
                heap.push(Reverse((r, i, right_end, after)));
            }
        }
        if i > 0 {
            let p = prev[i as usize];
            if let Some(r) = pair_rank(p, right_end) {
                heap.push(Reverse((r, p, i, right_end)));
            }
        }
    }
    let mut bounds = vec![0];
    let mut at = 0;
    while at < n {
        at = end[at as usize];
        bounds.push(at as usize);
    }
    bounds
}

#[cfg(test)]
mod tests;
