//! What comes in with a request, before the engine sees it: the body, read under the size and
//! time limits with the right status for each way it can fail, and the prompt, tokenized (on a
//! blocking thread: up to a second per megabyte) and settled against the context.

use std::time::Duration;

use axum::body::Bytes;
use axum::http::{header, HeaderMap};
use deltafin::LoadedModel;

use crate::request::{ApiError, Prompt, Request};
use crate::{api_error, AppState};

/// Reads a request body up to the configured size, within the configured time. A declared
/// `Content-Length` over the limit is refused before any of the body is read (so a client that
/// sent `Expect: 100-continue` gets the 413, not `100 Continue`); a body that breaks off or is
/// malformed is a 400 saying so, never a 413.
pub(crate) async fn read_body(s: &AppState, headers: &HeaderMap, body: axum::body::Body) -> Result<Bytes, ApiError> {
    let max = s.cfg.max_body_bytes;
    let too_large = || api_error(413, "invalid_request_error", format!("the request body is larger than {max} bytes (serve --max-body)"));
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    let limit = Duration::from_secs(s.cfg.body_timeout_s.max(1));
    let limited = http_body_util::Limited::new(body, max);
    match tokio::time::timeout(limit, http_body_util::BodyExt::collect(limited)).await {
        Err(_) => Err(api_error(408, "invalid_request_error", format!("the request body did not arrive within {} s", limit.as_secs()))),
        Ok(Err(e)) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => Err(too_large()),
        Ok(Err(e)) => Err(api_error(400, "invalid_request_error", format!("the request body could not be read: {e}"))),
        Ok(Ok(b)) => Ok(b.to_bytes()),
    }
}

/// Text from a client made safe for one log line: control characters escaped (a newline in a
/// field name cannot forge a line) and the length capped.
pub(crate) fn loggable(text: &str) -> String {
    crate::request::escaped_capped(text, 300)
}

/// The grammar a request's reply must follow, compiled (the model's vocabulary is compiled once,
/// on the first such request): a `response_format`'s JSON, or, with tools declared, every call's
/// arguments as its tool's `parameters` schema allows (a required call at once; with `auto`,
/// after the model's own reasoning and reply text). A schema llguidance cannot handle is a 400 naming the
/// field and the part.
pub(crate) fn constraint(
    model: &LoadedModel,
    grammars: &std::sync::OnceLock<Result<deltafin::Grammars, String>>,
    req: &Request,
) -> Result<Option<deltafin::Constraint>, ApiError> {
    let tools = match &req.prompt {
        Prompt::Chat { tools: Some(t), .. } => Some(t),
        _ => None,
    };
    if req.response_format.is_none() && tools.is_none() {
        return Ok(None);
    }
    let g = grammars
        .get_or_init(|| deltafin::Grammars::new(model.shared_tokenizer()).map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| api_error(400, "invalid_request_error", format!("structured output needs K3's chat tokens: {e}")))?;
    if let Some(format) = &req.response_format {
        return match g.json(format.schema()) {
            Ok(c) => Ok(Some(c)),
            Err(e) => Err(ApiError::bad("response_format", format!("the schema cannot be used for structured output: {e}"))),
        };
    }
    let Some(tools) = tools else { return Ok(None) };
    let declared: Vec<serde_json::Value> = serde_json::from_str(&tools.declared).unwrap_or_default();
    let list: Vec<deltafin::GrammarTool<'_>> = declared
        .iter()
        .filter_map(|t| {
            let f = t.get("function")?;
            Some(deltafin::GrammarTool { name: f.get("name")?.as_str()?, parameters: f.get("parameters") })
        })
        .collect();
    let compiled = match &tools.choice {
        deltafin::ToolTurn::Named(n) => g.tool_call(&list, Some(n)),
        deltafin::ToolTurn::Required => g.tool_call(&list, None),
        _ => g.tool_turn(&list),
    };
    compiled.map(Some).map_err(|e| ApiError::bad("tools", format!("a tool's `parameters` cannot be used to constrain its arguments: {e}")))
}

/// A request's prompt ids, stop ids and tool-turn state, with `max_tokens` settled against the
/// context; a prompt that cannot fit is refused before more than a context's worth of text is
/// tokenized.
#[allow(clippy::type_complexity)]
pub(crate) fn build_prompt(
    model: &LoadedModel,
    req: Request,
    chat: bool,
    cancel: &deltafin::Cancel,
) -> Result<(Request, Vec<u32>, Vec<u32>, Option<Option<Vec<u32>>>), ApiError> {
    // A client that goes away (its request's `cancel` set) stops its tokenizing between pieces.
    let gone = || cancel.is_cancelled();
    let stopped = |e: deltafin::CoreError| match e {
        deltafin::CoreError::Stopped => api_error(499, "invalid_request_error", "the client went away"),
        e => ApiError::bad(if chat { "messages" } else { "prompt" }, e.to_string()),
    };
    let limit = model.new_sequence().context_limit();
    let prompt_param = if chat { "messages" } else { "prompt" };
    let too_long = || ApiError::bad(prompt_param, format!("the prompt is longer than the context limit of {limit} tokens"));
    let tok = model.tokenizer();
    let mut tool_turn: Option<Option<Vec<u32>>> = None;
    let (prompt, stop_ids) = match &req.prompt {
        Prompt::Chat { messages, reasoning_effort, tools } => {
            // Every token holds at most `max_token_len` bytes of text: a conversation with more
            // text than the context could hold even so is refused without tokenizing it.
            let text: usize = messages
                .iter()
                .map(|m| {
                    m.content.len()
                        + m.reasoning.as_ref().map_or(0, String::len)
                        + m.tool_calls.iter().map(|c| c.arguments.len()).sum::<usize>()
                })
                .sum::<usize>()
                + tools.as_ref().map_or(0, |t| t.declared.len());
            if text / tok.max_token_len() > limit {
                return Err(too_long());
            }
            let fmt = model.chat().map_err(|e| api_error(500, "server_error", e.to_string()))?.stop_when(&gone);
            let turn_kind = match (&req.response_format, tools) {
                (Some(_), _) => deltafin::ToolTurn::Response,
                (None, Some(t)) => t.choice.clone(),
                (None, None) => deltafin::ToolTurn::Free,
            };
            let declared = tools.as_ref().map(|t| t.declared.as_str());
            let ids = fmt.render_with_tools(messages, reasoning_effort.as_deref(), declared, &turn_kind).map_err(stopped)?;
            if tools.is_some() {
                // A required or named call: the prompt ends inside the opened `tool_call`
                // tag, whose text so far the reply parser must know.
                let open = tok.special("<|open|>");
                let prefill = matches!(turn_kind, deltafin::ToolTurn::Required | deltafin::ToolTurn::Named(_))
                    .then(|| ids.iter().rposition(|&i| Some(i) == open).map(|at| ids[at + 1..].to_vec()).unwrap_or_default());
                tool_turn = Some(prefill);
            }
            (ids, fmt.stop_ids())
        }
        Prompt::Text(t) => {
            (tok.encode_ordinary_until(t, limit, &gone).map_err(stopped)?.ok_or_else(too_long)?, tok.special("[EOS]").into_iter().collect())
        }
        Prompt::Ids(ids) => {
            let vocab = tok.vocab_len();
            if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
                return Err(ApiError::bad("prompt", format!("token id {bad} is outside the vocabulary (0..{vocab})")));
            }
            (ids.clone(), tok.special("[EOS]").into_iter().collect())
        }
    };
    let mut req = req;
    if !req.max_tokens_given {
        // No max_tokens sent: the default, clamped to what the context has left.
        req.max_tokens = req.max_tokens.min(limit.saturating_sub(prompt.len()));
        if req.max_tokens == 0 && !req.echo {
            return Err(ApiError::bad(
                prompt_param,
                format!("the prompt ({} tokens) fills the context limit of {limit} tokens", prompt.len()),
            ));
        }
    } else if prompt.len() + req.max_tokens > limit {
        return Err(ApiError::bad(
            prompt_param,
            format!("prompt ({} tokens) + max_tokens ({}) exceed the context limit of {limit} tokens", prompt.len(), req.max_tokens),
        ));
    }
    Ok((req, prompt, stop_ids, tool_turn))
}
