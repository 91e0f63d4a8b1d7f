//! Parsing and validating OpenAI request bodies: everything the engine honors exactly is
//! accepted; anything it cannot (n > 1, tools, penalties, logit_bias, images, unknown fields) is
//! refused with a 400 naming the field, never silently ignored.

use serde_json::{Map, Value};

use deltafin::{Message, Role};

/// An OpenAI-shaped client error.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub param: Option<String>,
    pub kind: &'static str,
}

/// Client text made safe to echo or log: control characters escaped (a newline cannot forge a
/// log line) and at most `max` characters kept.
pub(crate) fn escaped_capped(text: &str, max: usize) -> String {
    let mut out: String = text.chars().take(max).flat_map(char::escape_debug).collect();
    if text.chars().nth(max).is_some() {
        out.push_str("...");
    }
    out
}

/// A client's field name as an error echoes it (an error should not carry a megabyte of it).
fn echoed_name(name: &str) -> String {
    escaped_capped(name, 64)
}

impl ApiError {
    pub fn bad(param: &str, message: impl Into<String>) -> ApiError {
        let mut message = message.into();
        if !message.contains(param) {
            message = format!("`{param}`: {message}");
        }
        ApiError { status: 400, message, param: Some(param.into()), kind: "invalid_request_error" }
    }
    pub fn body(&self) -> Value {
        serde_json::json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": null}})
    }
}

/// What a request asks the engine for.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Chat {
        messages: Vec<Message>,
        reasoning_effort: Option<String>,
        /// Declared tools (none when `tool_choice` is `none` or no tool was declared).
        tools: Option<Tools>,
    },
    Text(String),
    /// A completions prompt given as token ids.
    Ids(Vec<u32>),
}

/// Tools declared by a chat request, and how the model must use them.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// The declarations as JSON text (the `tool-declare` system message).
    pub declared: String,
    pub choice: deltafin::ToolTurn,
}

/// A validated request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub prompt: Prompt,
    pub max_tokens: usize,
    /// Whether the client set `max_tokens` (else the default, clamped to what the context has
    /// left, as vLLM and llama.cpp do).
    pub max_tokens_given: bool,
    pub stop: Vec<String>,
    pub logprobs: bool,
    pub top_logprobs: usize,
    pub stream: bool,
    pub include_usage: bool,
    /// Completions: the prompt comes back before the completion, with its tokens' logprobs if
    /// `logprobs` is set (prompt scoring; `max_tokens` may then be 0).
    pub echo: bool,
    /// How tokens are chosen: `None` is greedy (no `temperature`, or 0). A sampled request
    /// without a `seed` gets one drawn here, which the response returns.
    pub sampling: Option<deltafin::Sampling>,
    /// Chat: the reply must be JSON (any object, or what a schema accepts).
    pub response_format: Option<crate::response_format::ResponseFormat>,
}

const COMMON: &[&str] = &[
    "model",
    "max_tokens",
    "stop",
    "stream",
    "stream_options",
    "user",
    "metadata",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "logprobs",
];
const CHAT_ONLY: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "reasoning_effort",
    "store",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
];
const COMPLETION_ONLY: &[&str] = &["prompt", "echo", "suffix", "best_of"];
/// Fields the engine cannot honor exactly, with the reason given to the client.
const REFUSED: &[(&str, &str)] = &[
    ("functions", "the legacy `functions` field is not supported: declare them in `tools`"),
    ("function_call", "the legacy `function_call` field is not supported: use `tool_choice`"),
    ("logit_bias", "logit_bias would change K3's greedy choice; it is not supported"),
    ("presence_penalty", "penalties would change K3's greedy choice; they are not supported"),
    ("frequency_penalty", "penalties would change K3's greedy choice; they are not supported"),
    ("modalities", "only text is supported"),
    ("audio", "only text is supported"),
    ("prediction", "predicted outputs are not supported"),
    ("service_tier", "service tiers do not exist here"),
    ("web_search_options", "web search is not supported"),
];

/// Parses a `/v1/chat/completions` (chat = true) or `/v1/completions` body.
pub fn parse(body: &[u8], chat: bool, default_max: usize) -> Result<Request, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| ApiError::bad("body", format!("request body is not valid JSON: {e}")))?;
    let obj = v.as_object().ok_or_else(|| ApiError::bad("body", "request body must be a JSON object"))?;
    for (k, val) in obj {
        if let Some((_, why)) = REFUSED.iter().find(|(f, _)| f == k) {
            // Neutral values (0 penalties, empty bias, null, plain text, no tool call) are the
            // same as absent.
            let neutral = val.is_null()
                || val.as_f64() == Some(0.0)
                || val.as_object().is_some_and(Map::is_empty)
                || val.as_array().is_some_and(Vec::is_empty)
                || (k == "tool_choice" && val.as_str() == Some("none"));
            if !neutral {
                return Err(ApiError::bad(k, format!("`{k}`: {why}")));
            }
            continue;
        }
        if !chat && ["tools", "tool_choice", "parallel_tool_calls", "response_format"].contains(&k.as_str()) {
            return Err(ApiError::bad(k, format!("`{k}` applies to /v1/chat/completions")));
        }
        let known =
            COMMON.contains(&k.as_str()) || if chat { CHAT_ONLY.contains(&k.as_str()) } else { COMPLETION_ONLY.contains(&k.as_str()) };
        if !known {
            let name = echoed_name(k);
            return Err(ApiError::bad(&name, format!("unknown field `{name}`: this server refuses what it cannot honor exactly")));
        }
    }
    let num = |k: &str| obj.get(k).filter(|v| !v.is_null());
    if let Some(n) = num("n") {
        if n.as_u64() != Some(1) {
            return Err(ApiError::bad("n", "`n` must be 1: one choice per request (send several, with different seeds, for more)"));
        }
    }
    if let Some(b) = num("best_of") {
        if b.as_u64() != Some(1) {
            return Err(ApiError::bad("best_of", "`best_of` must be 1"));
        }
    }
    let echo = match num("echo") {
        None => false,
        Some(v) => v.as_bool().ok_or_else(|| ApiError::bad("echo", "`echo` must be a boolean"))?,
    };
    if num("suffix").is_some() {
        return Err(ApiError::bad("suffix", "`suffix` (insertion) is not supported"));
    }
    let temperature = match num("temperature") {
        None => 0.0,
        Some(t) => match t.as_f64() {
            Some(x) if (0.0..=2.0).contains(&x) => x as f32,
            _ => return Err(ApiError::bad("temperature", "`temperature` must be a number in [0, 2] (0, the default, is greedy)")),
        },
    };
    let top_p = match num("top_p") {
        None => 1.0,
        Some(t) => match t.as_f64() {
            Some(x) if x > 0.0 && x <= 1.0 => x as f32,
            _ => return Err(ApiError::bad("top_p", "`top_p` must be a number in (0, 1]")),
        },
    };
    let top_k = match num("top_k") {
        None => 0,
        // -1 and 0 mean "off", as in vLLM and llama.cpp.
        Some(t) => match t.as_i64() {
            Some(k) if k >= -1 => k.max(0) as usize,
            _ => return Err(ApiError::bad("top_k", "`top_k` must be an integer >= -1 (-1 and 0: off)")),
        },
    };
    let min_p = match num("min_p") {
        None => 0.0,
        Some(t) => match t.as_f64() {
            Some(x) if (0.0..=1.0).contains(&x) => x as f32,
            _ => return Err(ApiError::bad("min_p", "`min_p` must be a number in [0, 1]")),
        },
    };
    let seed = match num("seed") {
        None => None,
        Some(s) => {
            Some(s.as_u64().or_else(|| s.as_i64().map(|v| v as u64)).ok_or_else(|| ApiError::bad("seed", "`seed` must be an integer"))?)
        }
    };
    // Greedy unless a temperature above 0 asks otherwise: the engine's guarantee stays the default.
    let sampling = (temperature > 0.0).then(|| deltafin::Sampling {
        temperature,
        top_k,
        top_p,
        min_p,
        seed: seed.unwrap_or_else(deltafin::fresh_seed),
    });
    if let Some(u) = num("user") {
        if !u.is_string() {
            return Err(ApiError::bad("user", "`user` must be a string"));
        }
    }
    if let Some(m) = num("metadata") {
        if !m.as_object().is_some_and(|o| o.values().all(Value::is_string)) {
            return Err(ApiError::bad("metadata", "`metadata` must be an object of strings"));
        }
    }
    let max_key = if chat && num("max_completion_tokens").is_some() { "max_completion_tokens" } else { "max_tokens" };
    let max_tokens_given = num(max_key).is_some();
    let max_tokens = match num(max_key) {
        None => default_max,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 || echo => n as usize,
            _ => return Err(ApiError::bad(max_key, format!("`{max_key}` must be a positive integer (0 only with `echo`: scoring)"))),
        },
    };
    let stop = match num("stop") {
        None => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_str().map(str::to_string).ok_or_else(|| ApiError::bad("stop", "`stop` must be a string or a list of strings")))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(ApiError::bad("stop", "`stop` must be a string or a list of strings")),
    };
    if stop.len() > 4 || stop.iter().any(String::is_empty) {
        return Err(ApiError::bad("stop", "`stop` takes up to 4 non-empty strings"));
    }
    let stream = match num("stream") {
        None => false,
        Some(v) => v.as_bool().ok_or_else(|| ApiError::bad("stream", "`stream` must be a boolean"))?,
    };
    let include_usage = match num("stream_options") {
        None => false,
        Some(o) => {
            let o = o.as_object().ok_or_else(|| ApiError::bad("stream_options", "`stream_options` must be an object"))?;
            if let Some(k) = o.keys().find(|k| *k != "include_usage") {
                return Err(ApiError::bad("stream_options", format!("unknown field `stream_options.{}`", echoed_name(k))));
            }
            if !stream {
                return Err(ApiError::bad("stream_options", "`stream_options` needs `stream: true`"));
            }
            o.get("include_usage").and_then(Value::as_bool).unwrap_or(false)
        }
    };
    let (logprobs, top_logprobs) = if chat {
        let lp = match num("logprobs") {
            None => false,
            Some(v) => v.as_bool().ok_or_else(|| ApiError::bad("logprobs", "`logprobs` must be a boolean"))?,
        };
        let top = match num("top_logprobs") {
            None => 0,
            Some(v) => match v.as_u64() {
                Some(n) if n <= 20 => n as usize,
                _ => return Err(ApiError::bad("top_logprobs", "`top_logprobs` must be an integer in [0, 20]")),
            },
        };
        if top > 0 && !lp {
            return Err(ApiError::bad("top_logprobs", "`top_logprobs` needs `logprobs: true`"));
        }
        (lp, top)
    } else {
        match num("logprobs") {
            None => (false, 0),
            Some(v) => match v.as_u64() {
                Some(n) if n <= 5 => (true, n as usize),
                _ => return Err(ApiError::bad("logprobs", "`logprobs` must be an integer in [0, 5]")),
            },
        }
    };
    if echo && stream {
        return Err(ApiError::bad("echo", "`echo` cannot be streamed; leave out `stream`"));
    }
    let prompt = if chat { parse_chat(obj, parse_tools(obj)?)? } else { parse_text(obj)? };
    let response_format = crate::response_format::parse(obj.get("response_format"))?;
    if let (Some(_), Prompt::Chat { tools: Some(t), .. }) = (&response_format, &prompt) {
        if t.choice != deltafin::ToolTurn::Free {
            return Err(ApiError::bad("response_format", "`response_format` JSON and a required tool call cannot both shape one reply"));
        }
    }
    Ok(Request {
        prompt,
        max_tokens,
        max_tokens_given,
        stop,
        logprobs,
        top_logprobs,
        stream,
        include_usage,
        echo,
        sampling,
        response_format,
    })
}

fn parse_text(obj: &Map<String, Value>) -> Result<Prompt, ApiError> {
    match obj.get("prompt") {
        Some(Value::String(s)) if !s.is_empty() => Ok(Prompt::Text(s.clone())),
        Some(Value::String(_)) => Err(ApiError::bad("prompt", "`prompt` is empty")),
        Some(Value::Array(a)) if a.len() == 1 && a[0].as_str().is_some_and(|s| !s.is_empty()) => {
            Ok(Prompt::Text(a[0].as_str().unwrap_or_default().to_string()))
        }
        // Token ids, or a list holding one list of them.
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_array() => parse_text_ids(a[0].as_array().expect("an array")),
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_number) => parse_text_ids(a),
        Some(Value::Array(a)) if a.len() > 1 => Err(ApiError::bad(
            "prompt",
            "`prompt` holds several prompts; this server answers one prompt per request: send one request for each",
        )),
        Some(_) => Err(ApiError::bad("prompt", "`prompt` must be a non-empty string or a list of token ids")),
        None => Err(ApiError::bad("prompt", "`prompt` is required")),
    }
}

fn parse_text_ids(a: &[Value]) -> Result<Prompt, ApiError> {
    let ids: Option<Vec<u32>> = a.iter().map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok())).collect();
    match ids {
        Some(ids) if !ids.is_empty() => Ok(Prompt::Ids(ids)),
        _ => Err(ApiError::bad("prompt", "`prompt` as token ids must be a non-empty list of non-negative integers")),
    }
}

/// `tools`, `tool_choice` and `parallel_tool_calls`: `None` when no tool may be called.
fn parse_tools(obj: &Map<String, Value>) -> Result<Option<Tools>, ApiError> {
    let tools = match obj.get("tools") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err(ApiError::bad("tools", "`tools` must be a list of {\"type\": \"function\", \"function\": {...}}")),
    };
    let mut names = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        let p = format!("tools[{i}]");
        let f = t.get("function").filter(|_| t.get("type").and_then(Value::as_str) == Some("function"));
        let name = f.and_then(|f| f.get("name")).and_then(Value::as_str).filter(|n| !n.is_empty());
        match name {
            Some(n) => names.push(n.to_string()),
            None => return Err(ApiError::bad(&p, format!("`{p}` must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"))),
        }
    }
    if let Some(v) = obj.get("parallel_tool_calls").filter(|v| !v.is_null()) {
        match v.as_bool() {
            Some(true) => {}
            Some(false) => {
                return Err(ApiError::bad(
                    "parallel_tool_calls",
                    "`parallel_tool_calls: false` is not supported: the model may call several tools in one turn",
                ))
            }
            None => return Err(ApiError::bad("parallel_tool_calls", "`parallel_tool_calls` must be a boolean")),
        }
    }
    let choice = match obj.get("tool_choice") {
        None | Some(Value::Null) => "auto".to_string(),
        Some(Value::String(s)) if ["auto", "none", "required"].contains(&s.as_str()) => s.clone(),
        Some(v) => match v.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
            Some(n) if v.get("type").and_then(Value::as_str) == Some("function") => format!("function:{n}"),
            _ => {
                return Err(ApiError::bad(
                    "tool_choice",
                    "`tool_choice` must be auto, none, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ))
            }
        },
    };
    if choice == "none" || (tools.is_empty() && choice == "auto") {
        return Ok(None);
    }
    if tools.is_empty() {
        return Err(ApiError::bad("tool_choice", format!("`tool_choice` {choice:?} needs `tools`")));
    }
    let turn = match choice.strip_prefix("function:") {
        Some(n) if names.iter().any(|x| x == n) => deltafin::ToolTurn::Named(n.to_string()),
        Some(n) => return Err(ApiError::bad("tool_choice", format!("`tool_choice` names {n:?}, which `tools` does not declare"))),
        None if choice == "required" => deltafin::ToolTurn::Required,
        None => deltafin::ToolTurn::Free,
    };
    let declared = serde_json::to_string(&tools).unwrap_or_default();
    Ok(Some(Tools { declared, choice: turn }))
}

/// An assistant message's `tool_calls`.
fn parse_tool_calls(p: &str, v: &Value) -> Result<Vec<deltafin::ToolCall>, ApiError> {
    let bad = || {
        ApiError::bad(
            &format!("{p}.tool_calls"),
            format!("`{p}.tool_calls` must be a list of {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}"),
        )
    };
    let Some(a) = v.as_array() else { return Err(bad()) };
    a.iter()
        .map(|c| {
            let f = c.get("function").ok_or_else(bad)?;
            let args = match f.get("arguments") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Null) | None => String::new(),
                Some(other) => other.to_string(),
            };
            Ok(deltafin::ToolCall {
                id: c.get("id").and_then(Value::as_str).unwrap_or_default().to_string(),
                name: f.get("name").and_then(Value::as_str).ok_or_else(bad)?.to_string(),
                arguments: args,
            })
        })
        .collect()
}

fn parse_chat(obj: &Map<String, Value>, tools: Option<Tools>) -> Result<Prompt, ApiError> {
    let msgs = obj.get("messages").and_then(Value::as_array).ok_or_else(|| ApiError::bad("messages", "`messages` must be a list"))?;
    if msgs.is_empty() {
        return Err(ApiError::bad("messages", "`messages` is empty"));
    }
    let mut out = Vec::new();
    for (i, m) in msgs.iter().enumerate() {
        let p = format!("messages[{i}]");
        let m = m.as_object().ok_or_else(|| ApiError::bad(&p, format!("`{p}` must be an object")))?;
        for k in m.keys() {
            if !["role", "content", "name", "reasoning_content", "tool_calls", "tool_call_id"].contains(&k.as_str()) {
                return Err(ApiError::bad(&format!("{p}.{k}"), format!("`{p}.{k}` is not supported")));
            }
        }
        let role = match m.get("role").and_then(Value::as_str) {
            Some("system") | Some("developer") => Role::System,
            Some("user") => Role::User,
            Some("assistant") => Role::Assistant,
            Some("tool") => Role::Tool,
            _ => return Err(ApiError::bad(&format!("{p}.role"), format!("`{p}.role` must be system, developer, user, assistant or tool"))),
        };
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (j, part) in parts.iter().enumerate() {
                    match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        (ty, _) => {
                            return Err(ApiError::bad(
                                &format!("{p}.content[{j}]"),
                                format!("content part type {:?} is not supported (text only)", ty.unwrap_or("?")),
                            ))
                        }
                    }
                }
                text
            }
            Some(Value::Null) | None if role == Role::Assistant => String::new(),
            _ => return Err(ApiError::bad(&format!("{p}.content"), format!("`{p}.content` must be a string"))),
        };
        let mut msg = Message::new(role, content);
        msg.reasoning = m.get("reasoning_content").and_then(Value::as_str).map(str::to_string);
        if let Some(calls) = m.get("tool_calls").filter(|v| !v.is_null()) {
            if role != Role::Assistant {
                return Err(ApiError::bad(&format!("{p}.tool_calls"), "only assistant messages carry `tool_calls`"));
            }
            msg.tool_calls = parse_tool_calls(&p, calls)?;
        }
        if role == Role::Tool {
            match m.get("tool_call_id").and_then(Value::as_str) {
                Some(id) => msg.tool_call_id = Some(id.to_string()),
                None => {
                    return Err(ApiError::bad(
                        &format!("{p}.tool_call_id"),
                        format!("`{p}.tool_call_id` names the call a tool message answers"),
                    ))
                }
            }
        }
        out.push(msg);
    }
    let reasoning_effort = match obj.get("reasoning_effort") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => match s.as_str() {
            "low" | "high" | "max" => Some(s.clone()),
            "medium" => Some("high".to_string()),
            _ => return Err(ApiError::bad("reasoning_effort", "`reasoning_effort` must be low, medium, high or max")),
        },
        Some(_) => return Err(ApiError::bad("reasoning_effort", "`reasoning_effort` must be a string")),
    };
    Ok(Prompt::Chat { messages: out, reasoning_effort, tools })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<Request, ApiError> {
        parse(body.as_bytes(), true, 16)
    }

    #[test]
    fn sampling_fields_choose_greedy_or_a_seeded_draw() {
        let r = chat(r#"{"messages":[{"role":"user","content":"hi"}],"top_p":0.5,"seed":3}"#).unwrap();
        assert_eq!(r.sampling, None, "no temperature: greedy, whatever else is sent");
        let r = chat(r#"{"messages":[{"role":"user","content":"hi"}],"temperature":0}"#).unwrap();
        assert_eq!(r.sampling, None);
        let r = chat(r#"{"messages":[{"role":"user","content":"hi"}],"temperature":0.7,"top_p":0.9,"top_k":-1,"min_p":0.05,"seed":42}"#)
            .unwrap();
        let s = r.sampling.unwrap();
        assert_eq!((s.temperature, s.top_p, s.top_k, s.min_p, s.seed), (0.7, 0.9, 0, 0.05, 42));
        let r = chat(r#"{"messages":[{"role":"user","content":"hi"}],"temperature":1,"top_k":40}"#).unwrap();
        let s = r.sampling.unwrap();
        assert!(s.top_k == 40 && s.seed < (1u64 << 53), "a seed is drawn, small enough for JSON clients");
        for (body, param) in [
            (r#"{"messages":[{"role":"user","content":"hi"}],"temperature":1,"min_p":2}"#, "min_p"),
            (r#"{"messages":[{"role":"user","content":"hi"}],"temperature":1,"seed":"x"}"#, "seed"),
        ] {
            assert_eq!(chat(body).unwrap_err().param.as_deref(), Some(param));
        }
    }

    #[test]
    fn accepts_what_it_honors() {
        let r = chat(r#"{"model":"k3","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"stop":["x"],"logprobs":true,"top_logprobs":3,"temperature":0.7,"top_p":0.9,"user":"u","metadata":{"a":"b"},"stream":true,"stream_options":{"include_usage":true},"reasoning_effort":"low","presence_penalty":0}"#).unwrap();
        assert_eq!(r.max_tokens, 5);
        assert_eq!(r.stop, vec!["x"]);
        assert!(r.logprobs && r.top_logprobs == 3 && r.stream && r.include_usage);
        let c = parse(br#"{"prompt":"abc","logprobs":2,"max_tokens":3}"#, false, 16).unwrap();
        assert_eq!((c.logprobs, c.top_logprobs, c.max_tokens), (true, 2, 3));
        assert!(c.max_tokens_given);
    }

    #[test]
    fn accepts_harmless_defaults_and_token_id_prompts() {
        let r = chat(r#"{"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"text"},"tool_choice":"none","top_k":1}"#)
            .unwrap();
        assert_eq!((r.max_tokens, r.max_tokens_given), (16, false));
        for body in [r#"{"prompt":[1,2,3]}"#, r#"{"prompt":[[1,2,3]]}"#] {
            assert_eq!(parse(body.as_bytes(), false, 16).unwrap().prompt, Prompt::Ids(vec![1, 2, 3]), "{body}");
        }
        let e = parse(br#"{"prompt":["a","b"]}"#, false, 16).unwrap_err();
        assert!(e.message.contains("one request for each") && !e.message.contains("n > 1"), "{e:?}");
        let e = parse(br#"{"prompt":[1,-2]}"#, false, 16).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        let r = chat(r#"{"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_object"}}"#).unwrap();
        assert_eq!(r.response_format, Some(crate::response_format::ResponseFormat::JsonObject));
        let e = parse(br#"{"prompt":"hi","response_format":{"type":"json_object"}}"#, false, 16).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("response_format"), "chat only");
        let tools = r#""tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"required""#;
        let e = chat(&format!(r#"{{"messages":[{{"role":"user","content":"hi"}}],"response_format":{{"type":"json_object"}},{tools}}}"#))
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("response_format"), "not with a required call");
        let e = chat(r#"{"messages":[{"role":"user","content":"hi"}],"top_k":-5}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_k"));
    }

    #[test]
    fn refuses_what_it_cannot_honor_naming_the_field() {
        let cases = [
            (r#"{"messages":[{"role":"user","content":"hi"}],"n":2}"#, "n"),
            (r#"{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function"}]}"#, "tools[0]"),
            (r#"{"messages":[{"role":"user","content":"hi"}],"tool_choice":"required"}"#, "tool_choice"),
            (r#"{"messages":[{"role":"tool","content":"18C"}]}"#, "messages[0].tool_call_id"),
            (r#"{"messages":[{"role":"user","content":"hi"}],"frequency_penalty":0.5}"#, "frequency_penalty"),
            (r#"{"messages":[{"role":"user","content":"hi"}],"logit_bias":{"1":5}}"#, "logit_bias"),
            (r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#, "messages[0].content[0]"),
            (r#"{"messages":[{"role":"user","content":"hi"}],"frobnicate":1}"#, "frobnicate"),
            (r#"{"messages":[]}"#, "messages"),
            (r#"{"messages":[{"role":"user","content":"hi"}],"temperature":3}"#, "temperature"),
            (r#"{"messages":[{"role":"user","content":"hi"}],"top_p":0}"#, "top_p"),
            (r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":0}"#, "max_tokens"),
            (r#"{"messages":[{"role":"user","content":"hi"}],"top_logprobs":2}"#, "top_logprobs"),
            (r#"{"messages":[{"role":"wizard","content":"hi"}]}"#, "messages[0].role"),
            (r#"not json"#, "body"),
        ];
        for (body, param) in cases {
            let e = chat(body).unwrap_err();
            assert_eq!(e.status, 400);
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
        }
        let e = parse(br#"{"prompt":""}"#, false, 16).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
    }
}
