//! From generated ids to the reply a reader sees: K3's `think` part as reasoning, the `response`
//! part as content, stop strings cut exactly (text that might begin a stop string is held back
//! until it cannot), and UTF-8 split across tokens joined before it is shown.

use crate::tokenizer::Tokenizer;

/// Which field a piece of text belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Reasoning,
    Content,
}

/// A tool call as it is generated: its `tool_call` element opens (`id` if the model gave one,
/// and `name`), then its arguments arrive as text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolEvent {
    Start { index: usize, id: Option<String>, name: String },
    Args { index: usize, text: String },
}

/// Splits a generation into reasoning and content, and applies stop strings.
pub struct ReplySplitter {
    ctl: Option<(u32, u32, u32)>,
    section: Part,
    tag: Option<(bool, Vec<u32>)>,
    pending: Vec<u8>,
    held: [String; 2],
    stops: Vec<String>,
    /// A stop string was found: nothing more is emitted.
    pub stopped: bool,
    /// Whether `tool_call` elements are parsed (tools were declared).
    tools: bool,
    /// The tool call being generated (its index) and its incomplete UTF-8.
    tool: Option<(usize, Vec<u8>)>,
    calls: usize,
    /// Tool-call events since the caller last took them ([`ReplySplitter::take_tool_events`]).
    tool_events: Vec<ToolEvent>,
}

impl ReplySplitter {
    /// `chat`: the prompt opened the assistant's `think` element; `stops`: strings that end the
    /// reply (not included in it).
    pub fn new(tok: &Tokenizer, chat: bool, stops: Vec<String>) -> ReplySplitter {
        let ctl = match (tok.special("<|open|>"), tok.special("<|close|>"), tok.special("<|sep|>")) {
            (Some(o), Some(c), Some(s)) if chat => Some((o, c, s)),
            _ => None,
        };
        ReplySplitter {
            ctl,
            section: if chat { Part::Reasoning } else { Part::Content },
            tag: None,
            pending: vec![],
            held: [String::new(), String::new()],
            stops,
            stopped: false,
            tools: false,
            tool: None,
            calls: 0,
            tool_events: vec![],
        }
    }

    /// Parses `tool_call` elements into [`ToolEvent`]s (tools were declared).
    pub fn with_tools(mut self) -> ReplySplitter {
        self.tools = true;
        self
    }

    /// The prompt ended inside an open tag whose text so far is `ids` (a turn opened with a
    /// `tool_call` element the model must finish).
    pub fn in_open_tag(mut self, ids: Vec<u32>) -> ReplySplitter {
        self.tag = Some((true, ids));
        self.section = Part::Content;
        self
    }

    /// The prompt opened the `response` element (structured output): text is content at once.
    pub fn in_response(mut self) -> ReplySplitter {
        self.section = Part::Content;
        self
    }

    /// Tool calls started and argument text generated since the last call.
    pub fn take_tool_events(&mut self) -> Vec<ToolEvent> {
        std::mem::take(&mut self.tool_events)
    }

    /// How many tool calls were opened.
    pub fn tool_calls(&self) -> usize {
        self.calls
    }

    /// Adds one id (decoded with `tok`, the tokenizer it was made with); returns the text pieces
    /// that became final.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Vec<(Part, String)> {
        if self.stopped {
            return vec![];
        }
        if let Some((open, close, sep)) = self.ctl {
            if id == open || id == close {
                self.tag = Some((id == open, vec![]));
                return vec![];
            }
            if let Some((is_open, ids)) = &mut self.tag {
                if id != sep {
                    ids.push(id);
                    return vec![];
                }
                let name = tok.decode(ids);
                let is_open = *is_open;
                self.tag = None;
                if self.tools && name.trim_start().starts_with("tool_call") {
                    if is_open {
                        let index = self.calls;
                        self.calls += 1;
                        let id = crate::chat::attr_of(&name, "id");
                        self.tool_events.push(ToolEvent::Start {
                            index,
                            id,
                            name: crate::chat::attr_of(&name, "name").unwrap_or_default(),
                        });
                        self.tool = Some((index, vec![]));
                    } else {
                        self.tool = None;
                    }
                    return vec![];
                }
                if is_open {
                    self.section = if name.trim().starts_with("think") { Part::Reasoning } else { Part::Content };
                } else {
                    self.section = Part::Content;
                }
                return vec![];
            }
        }
        // Special (reserved and control) tokens are never text, in chat or completions.
        if tok.is_special(id) {
            return vec![];
        }
        if let Some((index, pending)) = &mut self.tool {
            pending.extend(tok.id_bytes(id));
            let text = take_utf8(pending);
            if !text.is_empty() {
                self.tool_events.push(ToolEvent::Args { index: *index, text });
            }
            return vec![];
        }
        let bytes = tok.id_bytes(id);
        self.pending.extend(bytes);
        let text = take_utf8(&mut self.pending);
        self.feed(self.section, text)
    }

    fn feed(&mut self, part: Part, text: String) -> Vec<(Part, String)> {
        let slot = part as usize;
        self.held[slot].push_str(&text);
        let held = &self.held[slot];
        if let Some(pos) = self.stops.iter().filter_map(|s| held.find(s.as_str())).min() {
            let out = held[..pos].to_string();
            self.held[slot].clear();
            self.stopped = true;
            return if out.is_empty() { vec![] } else { vec![(part, out)] };
        }
        // Hold back the longest tail that could still grow into a stop string.
        let mut keep = 0;
        for s in &self.stops {
            for k in (1..s.len()).rev() {
                if s.is_char_boundary(k) && held.ends_with(&s[..k]) {
                    keep = keep.max(k);
                    break;
                }
            }
        }
        let cut = held.len() - keep;
        let out = held[..cut].to_string();
        self.held[slot].drain(..cut);
        if out.is_empty() {
            vec![]
        } else {
            vec![(part, out)]
        }
    }

    /// Flushes held text at the end of the generation.
    pub fn finish(&mut self) -> Vec<(Part, String)> {
        if self.stopped {
            return vec![];
        }
        let mut out = vec![];
        if !self.pending.is_empty() {
            let t = String::from_utf8_lossy(&self.pending).into_owned();
            self.pending.clear();
            self.held[self.section as usize].push_str(&t);
        }
        for part in [Part::Reasoning, Part::Content] {
            let t = std::mem::take(&mut self.held[part as usize]);
            if !t.is_empty() {
                out.push((part, t));
            }
        }
        out
    }
}

/// The complete UTF-8 text at the front of `pending` (a sequence cut by a token boundary waits
/// for the rest; one that can never complete is taken lossily).
fn take_utf8(pending: &mut Vec<u8>) -> String {
    match std::str::from_utf8(pending) {
        Ok(s) => {
            let s = s.to_string();
            pending.clear();
            s
        }
        Err(e) if e.error_len().is_none() && pending.len() - e.valid_up_to() <= 3 => {
            let v = e.valid_up_to();
            let s = String::from_utf8_lossy(&pending[..v]).into_owned();
            pending.drain(..v);
            s
        }
        Err(_) => {
            let s = String::from_utf8_lossy(pending).into_owned();
            pending.clear();
            s
        }
    }
}
