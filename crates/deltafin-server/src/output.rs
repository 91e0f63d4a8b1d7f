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
    /// `chat`: the prompt opened the assistant's `think` element; `tools`: tools were declared
    /// (`tool_call` elements are parsed), and the text of a `tool_call` tag the prompt opened.
    /// `structured`: the prompt opened the `response` element (a `response_format` reply).
    pub fn new(model: Arc<LoadedModel>, chat: bool, stops: Vec<String>, tools: Option<Option<Vec<u32>>>, structured: bool) -> Splitter {
        let mut inner = ReplySplitter::new(model.tokenizer(), chat, stops);
        if structured {
            inner = inner.in_response();
        }
        if let Some(prefill) = tools {
            inner = inner.with_tools();
            if let Some(ids) = prefill {
                inner = inner.in_open_tag(ids);
            }
        }
        Splitter { model, inner }
    }
    /// Tool-call events since the last call.
    pub fn take_tool_events(&mut self) -> Vec<deltafin::ToolEvent> {
        self.inner.take_tool_events()
    }
    /// Whether the reply called a tool.
    pub fn called_tools(&self) -> bool {
        self.inner.tool_calls() > 0
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

/// The tool calls of a reply, in OpenAI's shape: each with its id (the model's, or one made from
/// the response id), function name and arguments text.
pub struct ToolCalls {
    prefix: String,
    calls: Vec<(String, String, String)>,
}

impl ToolCalls {
    /// Calls of the response `response_id`.
    pub fn new(response_id: &str) -> ToolCalls {
        let tail = response_id.rsplit('-').next().unwrap_or(response_id);
        ToolCalls { prefix: format!("call_{tail}"), calls: vec![] }
    }

    /// Adds one event.
    pub fn apply(&mut self, e: &deltafin::ToolEvent) {
        match e {
            deltafin::ToolEvent::Start { index, id, name } => {
                let id = id.clone().filter(|i| !i.is_empty()).unwrap_or_else(|| format!("{}_{index}", self.prefix));
                self.calls.push((id, name.clone(), String::new()));
            }
            deltafin::ToolEvent::Args { index, text } => {
                if let Some(c) = self.calls.get_mut(*index) {
                    c.2.push_str(text);
                }
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// `message.tool_calls`.
    pub fn to_json(&self) -> Value {
        Value::Array(
            self.calls
                .iter()
                .map(|(id, name, args)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}))
                .collect(),
        )
    }

    /// The stream delta of one event (the call opens with its id and name, then its arguments
    /// arrive in pieces), recording it.
    pub fn delta(&mut self, e: &deltafin::ToolEvent) -> Value {
        self.apply(e);
        match e {
            deltafin::ToolEvent::Start { index, .. } => {
                let (id, name, _) = &self.calls[*index];
                json!({"tool_calls": [{"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]})
            }
            deltafin::ToolEvent::Args { index, text } => json!({"tool_calls": [{"index": index, "function": {"arguments": text}}]}),
        }
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
