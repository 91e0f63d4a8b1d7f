//! Structured output: a JSON schema (or "any JSON object") turned into a [`Constraint`] the engine
//! masks K3's exact logits with, through llguidance (the constrained-decoding library llama.cpp
//! and vLLM use).
//!
//! Each grammar is a Lark grammar over the rest of K3's assistant turn: for `response_format`, the
//! prompt opened the `response` element (after an empty `think`) and the grammar is the JSON
//! value, compact (no free whitespace, which a small model can repeat forever), then
//! `<|close|>response<|sep|><|close|>message<|sep|>`; for a required tool call, the prompt opened
//! the `tool_call` tag and the grammar is a declared tool's name, its arguments as its
//! `parameters` schema allows, and the call and message closed. `<|end_of_msg|>` is then the one
//! id allowed, and ends the reply. What this crate never does: choose tokens (the engine does,
//! among those allowed) or see logits.

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
}

/// A tool a required call may name, with its arguments' schema (`parameters`).
pub struct Tool<'a> {
    pub name: &'a str,
    pub parameters: Option<&'a Value>,
}

impl Grammars {
    /// Builds the vocabulary of `tok` (K3's chat specials required).
    pub fn new(tok: Arc<Tokenizer>) -> Result<Grammars, Error> {
        for name in ["<|open|>", "<|close|>", "<|sep|>"] {
            tok.special(name).ok_or_else(|| Error::Vocabulary(format!("the tokenizer has no {name} token")))?;
        }
        let end = tok.special("<|end_of_msg|>").ok_or_else(|| Error::Vocabulary("the tokenizer has no <|end_of_msg|> token".into()))?;
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
        // Every grammar here ends the assistant message; `<|end_of_msg|>` then ends the reply.
        let info = TokRxInfo::new(vocab as u32, end);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(K3TokEnv { trie, tok });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| Error::Vocabulary(e.to_string()))?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// A reply that is one JSON value valid under `schema` (`None`: any JSON object, as
    /// `response_format: json_object` asks), then the `response` element and the message closed.
    pub fn json(&self, schema: Option<&Value>) -> Result<Constraint, Error> {
        let json = compact(schema)?;
        self.compile(format!("start: %json {json} <|close|> \"response\" <|sep|> <|close|> \"message\" <|sep|>\n"))
    }

    /// A required tool call whose arguments `parameters` accepts: the prompt ends inside the
    /// opened `tool_call` tag (after `name="NAME"` when `named`); the model names one of
    /// `tools` (unless named), writes the arguments, and closes the call and the message.
    pub fn tool_call(&self, tools: &[Tool<'_>], named: Option<&str>) -> Result<Constraint, Error> {
        let tail = "<|close|> \"tool_call\" <|sep|> <|close|> \"message\" <|sep|>";
        let (mut names, mut rules) = (vec![], vec![]);
        for (i, t) in tools.iter().enumerate() {
            let head = match named {
                Some(n) if n == t.name => String::new(),
                Some(_) => continue,
                None => lark_string(&format!(" name=\"{}\"", deltafin_core::attr_value(t.name))),
            };
            rules.push(format!("call{i}: {head} <|sep|> %json {} {tail}", compact(t.parameters)?));
            names.push(format!("call{i}"));
        }
        if rules.is_empty() {
            return Err(Error::Schema("no declared tool matches the required call".into()));
        }
        self.compile(format!("start: {}\n{}\n", names.join(" | "), rules.join("\n")))
    }

    /// A free turn with `tools` declared (`tool_choice: auto`; the prompt opened `think`): any
    /// reasoning and reply text, then any number of calls, each naming a declared tool with
    /// arguments its `parameters` schema accepts, then the message closed.
    pub fn tool_turn(&self, tools: &[Tool<'_>]) -> Result<Constraint, Error> {
        let tail = "<|close|> \"tool_call\" <|sep|>";
        let mut rules = vec![];
        for (i, t) in tools.iter().enumerate() {
            let head = lark_string(&format!("tool_call name=\"{}\"", deltafin_core::attr_value(t.name)));
            rules.push(format!("call{i}: <|open|> {head} <|sep|> %json {} {tail}", compact(t.parameters)?));
        }
        if rules.is_empty() {
            return Err(Error::Schema("no tool is declared".into()));
        }
        let calls: Vec<String> = (0..rules.len()).map(|i| format!("call{i}")).collect();
        self.compile(format!(
            "start: TEXT <|close|> \"think\" <|sep|> <|open|> \"response\" <|sep|> TEXT <|close|> \"response\" <|sep|> call* <|close|> \"message\" <|sep|>\ncall: {}\n{}\nTEXT: /(.|\\n)*/\n",
            calls.join(" | "),
            rules.join("\n")
        ))
    }

    fn compile(&self, lark: String) -> Result<Constraint, Error> {
        let parser = self.factory.create_parser(TopLevelGrammar::from_lark(lark)).map_err(|e| Error::Schema(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(Error::Schema(e));
        }
        Ok(Constraint::new(Reply(matcher)))
    }
}

/// `schema` (`None`: any object) as JSON text, with compact output asked of llguidance (free
/// whitespace is a loop a small model can fall into).
fn compact(schema: Option<&Value>) -> Result<String, Error> {
    let mut schema = match schema {
        None => serde_json::json!({"type": "object"}),
        Some(Value::Object(o)) => Value::Object(o.clone()),
        Some(Value::Bool(true)) => serde_json::json!({}),
        Some(other) => return Err(Error::Schema(format!("a JSON schema must be an object, not {other}"))),
    };
    JsonCompileOptions { whitespace_flexible: false, ..Default::default() }.apply_to(&mut schema);
    Ok(schema.to_string())
}

/// A Lark string literal of `text` (JSON's escapes are Lark's).
fn lark_string(text: &str) -> String {
    Value::from(text).to_string()
}

/// One reply's grammar state.
struct Reply(Matcher);

impl TokenConstraint for Reply {
    fn allowed(&mut self) -> Result<Vec<u32>, String> {
        let vob: SimpleVob = self.0.compute_mask_or_eos().map_err(|e| e.to_string())?;
        Ok(vob.as_slice().to_vec())
    }

    fn commit(&mut self, id: u32) -> Result<(), String> {
        // Once the grammar is complete only `<|end_of_msg|>` was allowed: nothing to move past.
        if self.0.is_stopped() {
            return Ok(());
        }
        self.0.consume_token(id).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests;
