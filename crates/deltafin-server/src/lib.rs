//! The OpenAI-compatible HTTP server over the Deltafin engine: `/v1/models`,
//! `/v1/completions`, `/v1/chat/completions` (SSE streaming in OpenAI's exact shape), `/health`
//! and `/metrics`. The only crate that knows HTTP or OpenAI JSON.
//!
//! Honest semantics: output is greedy and reproducible; every accepted field is honored exactly
//! and anything else is a 400 naming the field (see `request`). One generation runs at a time;
//! others wait in a bounded queue or get 429 with `Retry-After`. A client that disconnects stops
//! its generation at once (checked between layers), and a follow-up whose rendered prompt extends
//! the previous one resumes from the kept state (`usage.prompt_tokens_details.cached_tokens`).

mod batch;
mod metrics;
mod output;
mod request;
mod turn;
mod worker;

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use deltafin::Tokenizer;
use deltafin::{Cancel, LoadedModel, Stats};
use serde_json::{json, Value};
use tokio::sync::mpsc::unbounded_channel;

pub use crate::batch::{run_batch, BatchConfig, BatchError, BatchProgress, BatchSummary};
use crate::metrics::Metrics;
use crate::output::{chat_logprob, Part};
pub use crate::request::{parse as parse_request, ApiError};
use crate::request::{Prompt, Request};
use crate::turn::{Item, TurnEvents};
use crate::worker::{Event, Job, Queue};

/// Server errors (binding, serving).
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error("server stopped: {0}")]
    Serve(std::io::Error),
}

/// How to serve.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    pub api_key: Option<String>,
    pub max_queue: usize,
    pub max_body_bytes: usize,
    pub default_max_tokens: usize,
    /// The id `/v1/models` lists.
    pub model_name: String,
    /// Seconds between SSE keep-alive comments while a prompt is processed.
    pub keep_alive_s: u64,
    /// Verify up to this many drafts per step when the model was opened with a drafter (0: plain
    /// decoding; the output is the same either way).
    pub draft_max: usize,
    /// Let the live cost gate choose each step's draft length (else always `draft_max`).
    pub draft_gate: bool,
    /// Requests generated together in lockstep (the model needs as many sequence slots); 1: one
    /// at a time, with drafting and the kept-state cache.
    pub max_batch: usize,
}

struct Ready {
    model: Arc<LoadedModel>,
    queue: Queue,
}

struct AppState {
    cfg: ServerConfig,
    ready: OnceLock<Ready>,
    load_error: OnceLock<String>,
    metrics: Arc<Metrics>,
    counter: AtomicU64,
}

type Shared = Arc<AppState>;

impl AppState {
    /// A server's state before its model is ready.
    fn new(cfg: ServerConfig) -> Shared {
        Arc::new(AppState { cfg, ready: OnceLock::new(), load_error: OnceLock::new(), metrics: Arc::default(), counter: AtomicU64::new(0) })
    }
}

/// Serves until the process ends. `load` runs on a blocking thread; until it returns, `/health`
/// answers 503 and API calls answer 503 with a message.
pub async fn serve(cfg: ServerConfig, load: impl FnOnce() -> Result<LoadedModel, String> + Send + 'static) -> Result<(), ServerError> {
    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|source| ServerError::Bind { addr: addr.clone(), source })?;
    let state = AppState::new(cfg.clone());
    let s = state.clone();
    tokio::task::spawn_blocking(move || match load() {
        Ok(model) => {
            let model = Arc::new(model);
            let queue = worker::start(model.clone(), s.cfg.max_queue, s.cfg.max_batch, s.metrics.clone());
            let _ = s.ready.set(Ready { model, queue });
            eprintln!("deltafin: model ready");
        }
        Err(e) => {
            eprintln!("deltafin: loading the model failed: {e}");
            let _ = s.load_error.set(e);
        }
    });
    eprintln!("deltafin: listening on http://{addr}/v1");
    axum::serve(listener, router(state)).await.map_err(ServerError::Serve)
}

/// [`serve`] on its own runtime, for callers without one (the CLI).
pub fn serve_blocking(cfg: ServerConfig, load: impl FnOnce() -> Result<LoadedModel, String> + Send + 'static) -> Result<(), ServerError> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(ServerError::Serve)?;
    rt.block_on(serve(cfg, load))
}

fn router(state: Shared) -> Router {
    let max_body = state.cfg.max_body_bytes;
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(state)
}

fn error(state: &AppState, e: ApiError) -> Response {
    state.metrics.status(e.status);
    let mut r = (StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST), Json(e.body())).into_response();
    if e.status == 429 {
        r.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from_static("5"));
    }
    r
}

fn api_error(status: u16, kind: &'static str, message: impl Into<String>) -> ApiError {
    ApiError { status, message: message.into(), param: None, kind }
}

fn authorize(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &state.cfg.api_key else { return Ok(()) };
    let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    if given == Some(key.as_str()) {
        Ok(())
    } else {
        Err(api_error(401, "authentication_error", "missing or wrong API key (send `Authorization: Bearer KEY`)"))
    }
}

async fn health(State(s): State<Shared>) -> Response {
    if s.ready.get().is_some() {
        (StatusCode::OK, Json(json!({"status": "ok"}))).into_response()
    } else if let Some(e) = s.load_error.get() {
        (StatusCode::INTERNAL_SERVER_ERROR, Json(json!({"status": "error", "error": e}))).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "loading"}))).into_response()
    }
}

async fn metrics_text(State(s): State<Shared>) -> Response {
    let depth = s.ready.get().map_or(0, |r| r.queue.depth.load(Ordering::Acquire));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], s.metrics.render(depth, s.ready.get().is_some())).into_response()
}

async fn models(State(s): State<Shared>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&s, &headers) {
        return error(&s, e);
    }
    s.metrics.status(200);
    Json(json!({"object": "list", "data": [{"id": s.cfg.model_name, "object": "model", "created": 0, "owned_by": "deltafin"}]}))
        .into_response()
}

async fn completions(State(s): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    handle(s, headers, body, false).await
}

async fn chat_completions(State(s): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    handle(s, headers, body, true).await
}

/// Cancels its generation when dropped (the client went away or the response ended).
struct CancelOnDrop(Cancel);
impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// Everything one response needs while events arrive.
struct Turn {
    id: String,
    created: u64,
    model: String,
    chat: bool,
    req: Request,
    prompt_len: usize,
}

async fn handle(s: Shared, headers: HeaderMap, body: Bytes, chat: bool) -> Response {
    if let Err(e) = authorize(&s, &headers) {
        return error(&s, e);
    }
    let Some(ready) = s.ready.get() else {
        let msg = s
            .load_error
            .get()
            .map_or("the model is still loading; retry when /health answers 200".to_string(), |e| format!("the model failed to load: {e}"));
        return error(&s, api_error(503, "server_error", msg));
    };
    let req = match request::parse(&body, chat, s.cfg.default_max_tokens) {
        Ok(r) => r,
        Err(e) => return error(&s, e),
    };
    let model = ready.model.clone();
    let (prompt, stop_ids) = match &req.prompt {
        Prompt::Chat { messages, reasoning_effort } => {
            let fmt = match model.chat() {
                Ok(f) => f,
                Err(e) => return error(&s, api_error(500, "server_error", e.to_string())),
            };
            match fmt.render(messages, reasoning_effort.as_deref()) {
                Ok(ids) => (ids, fmt.stop_ids()),
                Err(e) => return error(&s, ApiError::bad("messages", e.to_string())),
            }
        }
        Prompt::Text(t) => (model.tokenizer().encode_ordinary(t), model.tokenizer().special("[EOS]").into_iter().collect()),
    };
    let limit = model.new_sequence().context_limit();
    if prompt.len() + req.max_tokens > limit {
        return error(
            &s,
            ApiError::bad(
                "messages",
                format!("prompt ({} tokens) + max_tokens ({}) exceed the context limit of {limit} tokens", prompt.len(), req.max_tokens),
            ),
        );
    }
    let (tx, rx) = unbounded_channel();
    let cancel = Cancel::new();
    let job = Job {
        prompt: prompt.clone(),
        max_tokens: req.max_tokens,
        stop_ids,
        logprobs: req.logprobs.then_some(req.top_logprobs),
        prompt_logprobs: (req.echo && req.logprobs).then_some(req.top_logprobs),
        events: tx,
        cancel: cancel.clone(),
        draft_max: s.cfg.draft_max,
        draft_gate: s.cfg.draft_gate,
    };
    if ready.queue.submit(job).is_err() {
        return error(
            &s,
            api_error(429, "rate_limit_error", format!("the engine is busy and {} requests already wait; retry later", s.cfg.max_queue)),
        );
    }
    let n = s.counter.fetch_add(1, Ordering::Relaxed);
    let turn = Turn {
        id: format!("{}-{n:08x}", if chat { "chatcmpl" } else { "cmpl" }),
        created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        model: s.cfg.model_name.clone(),
        chat,
        req,
        prompt_len: prompt.len(),
    };
    let guard = CancelOnDrop(cancel);
    s.metrics.status(200);
    if turn.req.stream {
        stream_response(s, model, turn, rx, guard)
    } else {
        whole_response(s, model, turn, rx, guard).await
    }
}

fn usage(turn: &Turn, generated: usize, cached: usize) -> Value {
    json!({"prompt_tokens": turn.prompt_len, "completion_tokens": generated, "total_tokens": turn.prompt_len + generated, "prompt_tokens_details": {"cached_tokens": cached}})
}

fn timings(stats: &Stats, cached: usize) -> Value {
    let predicted_ms = (stats.total_s - stats.ttft_s).max(0.0) * 1000.0;
    json!({
        "prompt_n": stats.prompt_tokens, "cached_n": cached, "prompt_ms": stats.ttft_s * 1000.0,
        "predicted_n": stats.generated_tokens, "predicted_ms": predicted_ms, "predicted_per_second": stats.decode_tok_s,
        "ttft_ms": stats.ttft_s * 1000.0, "expert_bytes_read": stats.expert_bytes_read, "cache_hit_rate": stats.cache_hit_rate,
        "drafted_n": stats.drafted, "accepted_n": stats.accepted, "verifies_n": stats.verifies,
        "acceptance_rate": stats.acceptance_rate(), "tokens_per_verify": stats.tokens_per_verify(),
        "verify_union_bytes": stats.verify_union_bytes_mean(), "expert_bytes_per_token": stats.bytes_per_token
    })
}

/// One token with its logprob (none for an echoed prompt's first token) and the top alternatives.
type TokenLogprob = (u32, Option<f32>, Vec<(u32, f32)>);

fn completion_logprobs(tok: &Tokenizer, items: &[TokenLogprob]) -> Value {
    let text = |id: u32| String::from_utf8_lossy(&tok.id_bytes(id)).into_owned();
    let mut offset = 0;
    let mut offsets = vec![];
    for (id, _, _) in items {
        offsets.push(offset);
        offset += text(*id).len();
    }
    json!({
        "tokens": items.iter().map(|(id, _, _)| text(*id)).collect::<Vec<_>>(),
        "token_logprobs": items.iter().map(|(_, lp, _)| *lp).collect::<Vec<_>>(),
        "top_logprobs": items.iter().map(|(_, lp, top)| match lp {
            None => Value::Null,
            Some(_) => Value::Object(top.iter().map(|(i, l)| (text(*i), json!(l))).collect()),
        }).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

async fn whole_response(
    s: Shared,
    model: Arc<LoadedModel>,
    turn: Turn,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    guard: CancelOnDrop,
) -> Response {
    let tok = model.tokenizer();
    let mut events = TurnEvents::new(model.clone(), turn.chat, turn.req.stop.clone(), guard.0.clone());
    let (mut content, mut reasoning) = (String::new(), String::new());
    let mut lps: Vec<TokenLogprob> = vec![];
    let mut prompt_lps: Vec<TokenLogprob> = vec![];
    let add = |parts: Vec<(Part, String)>, content: &mut String, reasoning: &mut String| {
        for (p, t) in parts {
            match p {
                Part::Content => content.push_str(&t),
                Part::Reasoning => reasoning.push_str(&t),
            }
        }
    };
    let mut finish = "stop";
    // `done` stays None when a stop string cancelled the worker mid-step (no stats come).
    let mut done: Option<Box<Stats>> = None;
    while !events.done {
        let ev = rx.recv().await;
        for item in events.on_event(ev) {
            match item {
                Item::Started => {}
                Item::Token { id, logprob, parts } => {
                    if let Some((lp, top)) = logprob {
                        lps.push((id, Some(lp), top));
                    }
                    add(parts, &mut content, &mut reasoning);
                }
                Item::Prompt(items) => prompt_lps.extend(items),
                Item::Text(parts) => add(parts, &mut content, &mut reasoning),
                Item::Finished { reason, stats } => {
                    finish = reason;
                    done = stats;
                }
                Item::Failed(msg) => return error(&s, api_error(500, "server_error", msg)),
            }
        }
    }
    let (generated, cached) = (events.generated, events.cached);
    let mut body = if turn.chat {
        let mut msg = json!({"role": "assistant", "content": content});
        if !reasoning.is_empty() {
            msg["reasoning_content"] = json!(reasoning);
        }
        let logprobs = if turn.req.logprobs {
            json!({"content": lps.iter().map(|(i, l, t)| chat_logprob(tok, *i, l.unwrap_or(0.0), t)).collect::<Vec<_>>()})
        } else {
            Value::Null
        };
        json!({"id": turn.id, "object": "chat.completion", "created": turn.created, "model": turn.model,
            "choices": [{"index": 0, "message": msg, "logprobs": logprobs, "finish_reason": finish}]})
    } else {
        // `echo`: the prompt comes first, in the text and in the logprobs.
        if turn.req.echo {
            if let Prompt::Text(p) = &turn.req.prompt {
                content.insert_str(0, p);
            }
            prompt_lps.append(&mut lps);
            lps = prompt_lps;
        }
        let logprobs = if turn.req.logprobs { completion_logprobs(tok, &lps) } else { Value::Null };
        json!({"id": turn.id, "object": "text_completion", "created": turn.created, "model": turn.model,
            "choices": [{"index": 0, "text": content, "logprobs": logprobs, "finish_reason": finish}]})
    };
    body["usage"] = usage(&turn, generated, cached);
    if let Some(stats) = &done {
        body["timings"] = timings(stats, cached);
    }
    Json(body).into_response()
}

fn stream_response(
    s: Shared,
    model: Arc<LoadedModel>,
    turn: Turn,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    guard: CancelOnDrop,
) -> Response {
    let keep_alive = KeepAlive::new().interval(Duration::from_secs(s.cfg.keep_alive_s.max(1))).text("keep-alive");
    let stream = async_stream(model, turn, rx, guard);
    Sse::new(stream).keep_alive(keep_alive).into_response()
}

fn chunk(turn: &Turn, delta_or_text: Value, logprobs: Value, finish: Option<&str>) -> Value {
    let mut c = if turn.chat {
        json!({"id": turn.id, "object": "chat.completion.chunk", "created": turn.created, "model": turn.model,
            "choices": [{"index": 0, "delta": delta_or_text, "logprobs": logprobs, "finish_reason": finish}]})
    } else {
        json!({"id": turn.id, "object": "text_completion", "created": turn.created, "model": turn.model,
            "choices": [{"index": 0, "text": delta_or_text, "logprobs": logprobs, "finish_reason": finish}]})
    };
    if turn.req.include_usage {
        c["usage"] = Value::Null;
    }
    c
}

fn delta(turn: &Turn, part: Part, text: String) -> Value {
    match (turn.chat, part) {
        (false, _) => json!(text),
        (true, Part::Reasoning) => json!({"reasoning_content": text}),
        (true, Part::Content) => json!({"content": text}),
    }
}

fn usage_chunk(turn: &Turn, generated: usize, cached: usize) -> Value {
    let object = if turn.chat { "chat.completion.chunk" } else { "text_completion" };
    json!({"id": turn.id, "object": object, "created": turn.created, "model": turn.model, "choices": [], "usage": usage(turn, generated, cached)})
}

fn empty_delta(turn: &Turn) -> Value {
    if turn.chat {
        json!({})
    } else {
        json!("")
    }
}

/// State of one SSE response between events.
struct StreamState {
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    _guard: CancelOnDrop,
    turn: Turn,
    model: Arc<LoadedModel>,
    events: TurnEvents,
    queue: std::collections::VecDeque<Value>,
}

impl StreamState {
    /// Turns one worker event into chunks.
    fn on_event(&mut self, ev: Option<Event>) {
        let tok = self.model.tokenizer();
        let turn = &self.turn;
        for item in self.events.on_event(ev) {
            match item {
                Item::Started => {
                    if turn.chat {
                        self.queue.push_back(chunk(turn, json!({"role": "assistant", "content": ""}), Value::Null, None));
                    }
                }
                Item::Token { id, logprob, parts } => {
                    let mut lp = match logprob {
                        Some((l, top)) if turn.chat => json!({"content": [chat_logprob(tok, id, l, &top)]}),
                        Some((l, top)) => completion_logprobs(tok, &[(id, Some(l), top)]),
                        None => Value::Null,
                    };
                    for (p, t) in parts {
                        self.queue.push_back(chunk(turn, delta(turn, p, t), std::mem::take(&mut lp), None));
                    }
                }
                Item::Text(parts) => {
                    for (p, t) in parts {
                        self.queue.push_back(chunk(turn, delta(turn, p, t), Value::Null, None));
                    }
                }
                // `echo` is refused with `stream`: no prompt logprobs reach a stream.
                Item::Prompt(_) => {}
                Item::Finished { reason, stats } => {
                    let mut last = chunk(turn, empty_delta(turn), Value::Null, Some(reason));
                    if let Some(stats) = &stats {
                        last["timings"] = timings(stats, self.events.cached);
                    }
                    self.queue.push_back(last);
                    if turn.req.include_usage {
                        self.queue.push_back(usage_chunk(turn, self.events.generated, self.events.cached));
                    }
                }
                Item::Failed(msg) => {
                    self.queue.push_back(json!({"error": {"message": msg, "type": "server_error", "param": null, "code": null}}));
                }
            }
        }
    }
}

fn async_stream(
    model: Arc<LoadedModel>,
    turn: Turn,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    guard: CancelOnDrop,
) -> impl futures_util::Stream<Item = Result<SseEvent, Infallible>> {
    let events = TurnEvents::new(model.clone(), turn.chat, turn.req.stop.clone(), guard.0.clone());
    let state = StreamState { rx, _guard: guard, turn, model, events, queue: Default::default() };
    futures_util::stream::unfold((state, false), |(mut st, finished)| async move {
        loop {
            if let Some(v) = st.queue.pop_front() {
                return Some((Ok(SseEvent::default().data(v.to_string())), (st, finished)));
            }
            if finished {
                return None;
            }
            if st.events.done {
                return Some((Ok(SseEvent::default().data("[DONE]")), (st, true)));
            }
            let ev = st.rx.recv().await;
            st.on_event(ev);
        }
    })
}
