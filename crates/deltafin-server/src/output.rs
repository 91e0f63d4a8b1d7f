//! From generated ids to what the client sees: the reply split by the core's `ReplySplitter`
//! (K3's `think` part becomes `reasoning_content`, the `response` part `content`, stop strings
//! cut exactly), and logprobs in OpenAI's shape.

use std::sync::Arc;

pub use deltafin::ReplyPart as Part;
use deltafin::{LoadedModel, ReplySplitter, Tokenizer};
use serde_json::{json, Value};

/// [`ReplySplitter`] over a loaded model's tokenizer.
pub struct Splitter {
    model: Arc<LoadedModel>,
    inner: ReplySplitter,
}

impl Splitter {
    /// `chat`: the prompt opened the assistant's `think` element.
    pub fn new(model: Arc<LoadedModel>, chat: bool, stops: Vec<String>) -> Splitter {
        let inner = ReplySplitter::new(model.tokenizer(), chat, stops);
        Splitter { model, inner }
    }
    /// Adds one id; returns the text pieces that became final.
    pub fn push(&mut self, id: u32) -> Vec<(Part, String)> {
        self.inner.push(self.model.tokenizer(), id)
    }
    /// Flushes held text at the end of the generation.
    pub fn finish(&mut self) -> Vec<(Part, String)> {
        self.inner.finish()
    }
    /// A stop string was found: nothing more is emitted.
    pub fn stopped(&self) -> bool {
        self.inner.stopped
    }
}

/// One token's chat logprobs entry.
pub fn chat_logprob(tok: &Tokenizer, id: u32, lp: f32, top: &[(u32, f32)]) -> Value {
    let entry = |id: u32, lp: f32| {
        let bytes = tok.id_bytes(id);
        json!({"token": String::from_utf8_lossy(&bytes), "logprob": lp, "bytes": bytes})
    };
    let mut e = entry(id, lp);
    e["top_logprobs"] = Value::Array(top.iter().map(|&(i, l)| entry(i, l)).collect());
    e
}
