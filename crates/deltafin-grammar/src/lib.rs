//! Structured output: a JSON schema (or "any JSON object") turned into a [`Constraint`] the engine
//! masks K3's exact logits with, through llguidance (the constrained-decoding library llama.cpp
//! and vLLM use).
//!
//! The reply it shapes is K3's assistant turn with its `response` element already open (the
//! prompt gives an empty `think`): the JSON value, compact (no free whitespace, which a small
//! model can repeat forever), then the element and message closed and `<|end_of_msg|>`, each
//! forced one token at a time. What this crate never does: choose tokens (the engine does, among
//! those allowed) or see logits.

use std::sync::Arc;

use deltafin_core::Tokenizer;
use deltafin_sched::{Constraint, TokenConstraint};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};
use serde_json::Value;

/// Why a schema or a vocabulary cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The schema is not one llguidance can compile (the message names the part).
    #[error("{0}")]
    Schema(String),
    /// The tokenizer lacks K3's chat specials.
    #[error("{0}")]
    Vocabulary(String),
}

/// K3's tokenizer as llguidance sees it: every id's bytes (specials marked with 0xFF and their
/// spelling, as its token trie expects) and our own BPE for text it asks to tokenize.
struct K3TokEnv {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
}

impl TokenizerEnv for K3TokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match std::str::from_utf8(s) {
            Ok(text) => self.tok.encode_ordinary(text),
            // Not UTF-8 (a prefix cut inside a character): one single-byte token per byte, which
            // byte-level BPE always has.
            Err(_) => s.iter().filter_map(|b| self.tok.bpe_id(&[*b])).collect(),
        }
    }
}

/// The compiled vocabulary, made once per model (a trie of every token; about a second for K3's
/// 163,840 ids) and shared by every request's grammar.
pub struct Grammars {
    factory: ParserFactory,
    /// The ids that close the reply after the JSON value: `<|close|>response<|sep|>`,
    /// `<|close|>message<|sep|>`, `<|end_of_msg|>`.
    suffix: Vec<u32>,
    vocab: usize,
}

impl Grammars {
    /// Builds the vocabulary of `tok` (K3's chat specials required).
    pub fn new(tok: Arc<Tokenizer>) -> Result<Grammars, Error> {
        let special = |name: &str| tok.special(name).ok_or_else(|| Error::Vocabulary(format!("the tokenizer has no {name} token")));
        let (close, sep, end) = (special("<|close|>")?, special("<|sep|>")?, special("<|end_of_msg|>")?);
        let vocab = tok.vocab_len();
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| {
                let bytes = tok.id_bytes(id);
                if tok.is_special(id) && !bytes.is_empty() {
                    [&[TokTrie::SPECIAL_TOKEN_MARKER][..], &bytes].concat()
                } else {
                    bytes
                }
            })
            .collect();
        // The JSON ends where the model chooses `<|close|>`: llguidance's end of sequence.
        let info = TokRxInfo::new(vocab as u32, close);
        let trie = TokTrie::from(&info, &words);
        let mut suffix = vec![close];
        suffix.extend(tok.encode_ordinary("response"));
        suffix.extend([sep, close]);
        suffix.extend(tok.encode_ordinary("message"));
        suffix.extend([sep, end]);
        let env: TokEnv = Arc::new(K3TokEnv { trie, tok });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| Error::Vocabulary(e.to_string()))?;
        factory.quiet();
        Ok(Grammars { factory, suffix, vocab })
    }

    /// A constraint for a reply that is one JSON value valid under `schema` (`None`: any JSON
    /// object, as `response_format: json_object` asks).
    pub fn json(&self, schema: Option<&Value>) -> Result<Constraint, Error> {
        let mut schema = match schema {
            None => serde_json::json!({"type": "object"}),
            Some(Value::Object(o)) => Value::Object(o.clone()),
            Some(Value::Bool(true)) => serde_json::json!({}),
            Some(other) => return Err(Error::Schema(format!("a JSON schema must be an object, not {other}"))),
        };
        JsonCompileOptions { whitespace_flexible: false, ..Default::default() }.apply_to(&mut schema);
        let parser = self.factory.create_parser(TopLevelGrammar::from_json_schema(schema)).map_err(|e| Error::Schema(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(Error::Schema(e));
        }
        Ok(Constraint::new(JsonReply { matcher, suffix: self.suffix.clone(), forced: None, vocab: self.vocab }))
    }
}

/// One reply's grammar: the JSON value, then the closing ids in order.
struct JsonReply {
    matcher: Matcher,
    suffix: Vec<u32>,
    /// How many closing ids have been generated (`None`: still inside the JSON).
    forced: Option<usize>,
    vocab: usize,
}

impl TokenConstraint for JsonReply {
    fn allowed(&mut self) -> Result<Vec<u32>, String> {
        let vob = match self.forced {
            None => self.matcher.compute_mask_or_eos().map_err(|e| e.to_string())?,
            Some(i) => {
                let mut v = SimpleVob::alloc(self.vocab);
                if let Some(&id) = self.suffix.get(i) {
                    v.allow_token(id);
                }
                v
            }
        };
        Ok(vob.as_slice().to_vec())
    }

    fn commit(&mut self, id: u32) -> Result<(), String> {
        match self.forced {
            None if id == self.suffix[0] => self.forced = Some(1),
            None => self.matcher.consume_token(id).map_err(|e| e.to_string())?,
            Some(i) if self.suffix.get(i) == Some(&id) => self.forced = Some(i + 1),
            Some(_) => return Err(format!("id {id} is not the reply's closing")),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
