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
mod intake;
mod listen;
mod metrics;
mod output;
mod request;
mod response_format;
mod turn;
mod worker;

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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
use crate::intake::{build_prompt, loggable, read_body};
use crate::metrics::Metrics;
use crate::output::{chat_logprob, Part};
pub use crate::request::{parse as parse_request, ApiError};
use crate::request::{Prompt, Request};
use crate::turn::{Item, TurnEvents};
use crate::worker::{Event, Job, Queue};

/// Why a listening socket could not be had, and what to do.
fn bind_hint(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::AddrInUse => {
            "the port is in use (another program, or another `deltafin serve`, listens there): pick a free one with --port".into()
        }
        std::io::ErrorKind::PermissionDenied => "not permitted (ports below 1024 need privileges): use --port 1024 or above".into(),
        std::io::ErrorKind::AddrNotAvailable => "this machine has no such address: check --host".into(),
        _ => e.to_string(),
    }
}

/// Server errors (binding, serving).
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {why}")]
    Bind { addr: String, why: String },
    #[error("server stopped: {0}")]
    Serve(std::io::Error),
    /// The model could not be loaded: the server exits instead of answering 503 forever.
    #[error("{0}")]
    Load(String),
}

/// How to serve.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    pub api_key: Option<String>,
    pub max_queue: usize,
    pub max_body_bytes: usize,
    /// Seconds a client may take to send its request body (a stalled upload is answered 408).
    pub body_timeout_s: u64,
    /// Seconds a client may take to send a request's head (request line and headers); an idle
    /// keep-alive connection is closed after as long.
    pub header_timeout_s: u64,
    /// Open connections at most; one more is answered 503 and closed (the process's file handles
    /// beyond these stay for the store).
    pub max_connections: usize,
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
    /// Put the reasoning in `content` inside `<think>...</think>` (for clients that ignore
    /// `reasoning_content`), instead of in `reasoning_content`.
    pub reasoning_in_content: bool,
}

struct Ready {
    model: Arc<LoadedModel>,
    queue: Queue,
    /// The vocabulary compiled for structured output, on the first request that asks for it.
    grammars: Arc<OnceLock<Result<deltafin::Grammars, String>>>,
}

struct AppState {
    cfg: ServerConfig,
    ready: OnceLock<Ready>,
    load_error: OnceLock<String>,
    metrics: Arc<Metrics>,
    counter: AtomicU64,
    /// Distinguishes this process's response ids from those of earlier runs.
    nonce: u64,
    /// Turns to tokenize a prompt: at most this many blocking threads tokenize at once.
    tokenizing: tokio::sync::Semaphore,
}

type Shared = Arc<AppState>;

impl AppState {
    /// A server's state before its model is ready.
    fn new(cfg: ServerConfig) -> Shared {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        let nonce = twox_hash::XxHash3_64::oneshot(&[now.to_le_bytes(), u64::from(std::process::id()).to_le_bytes()].concat());
        Arc::new(AppState {
            cfg,
            ready: OnceLock::new(),
            load_error: OnceLock::new(),
            metrics: Arc::default(),
            counter: AtomicU64::new(0),
            nonce,
            tokenizing: tokio::sync::Semaphore::new(2),
        })
    }
}

/// Serves until SIGTERM or Ctrl-C (then stops accepting, lets running responses finish, and
/// returns), or until loading the model fails (an error, so service managers see it). `load`
/// runs on a blocking thread; until it returns, `/health` answers 503 and API calls answer 503
/// with a message.
pub async fn serve(cfg: ServerConfig, load: impl FnOnce() -> Result<LoadedModel, String> + Send + 'static) -> Result<(), ServerError> {
    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|e| ServerError::Bind { addr: addr.clone(), why: bind_hint(&e) })?;
    let state = AppState::new(cfg.clone());
    let s = state.clone();
    let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<String>();
    tokio::task::spawn_blocking(move || match load() {
        Ok(model) => {
            let model = Arc::new(model);
            let queue = worker::start(
                model.clone(),
                s.cfg.max_queue,
                s.cfg.max_batch,
                s.cfg.draft_max,
                worker::Reuse::Conversations,
                s.metrics.clone(),
            );
            let _ = s.ready.set(Ready { model, queue, grammars: Arc::default() });
            tracing::info!(model = %s.cfg.model_name, "model ready");
        }
        Err(e) => {
            let _ = s.load_error.set(e.clone());
            let _ = failed_tx.send(e);
        }
    });
    // The address bound (with `--port 0`, the port the system chose): tests and scripts read it.
    let addr = listener.local_addr().map_or(addr, |a| a.to_string());
    tracing::info!(%addr, "listening on http://{addr}/v1");
    let failed = Arc::new(std::sync::Mutex::new(None));
    let f = failed.clone();
    let shutdown = async move {
        tokio::select! {
            _ = shutdown_signal() => tracing::info!("shutting down: finishing running responses"),
            Ok(e) = failed_rx => {
                *f.lock().expect("poisoned") = Some(e);
            }
        }
    };
    let limits = listen::Limits { max_connections: cfg.max_connections, header_timeout: Duration::from_secs(cfg.header_timeout_s.max(1)) };
    listen::serve(listener, router(state), limits, shutdown).await.map_err(ServerError::Serve)?;
    let failed = failed.lock().expect("poisoned").take();
    match failed {
        Some(e) => Err(ServerError::Load(format!("loading the model failed: {e}"))),
        None => Ok(()),
    }
}

/// SIGTERM (service managers) or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

/// [`serve`] on its own runtime, for callers without one (the CLI).
pub fn serve_blocking(cfg: ServerConfig, load: impl FnOnce() -> Result<LoadedModel, String> + Send + 'static) -> Result<(), ServerError> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(ServerError::Serve)?;
    rt.block_on(serve(cfg, load))
}

fn router(state: Shared) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_by_id))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Bodies are read by the handlers (`read_body`): a JSON 413 and a read timeout.
        .layer(DefaultBodyLimit::disable())
        .with_state(state)
}

/// The chat page: one self-contained file (`page.html`), no key needed to load it (its requests
/// to /v1 carry the key, which it asks for when the server wants one).
async fn page(State(s): State<Shared>) -> Response {
    s.metrics.status(200);
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            // Nothing but this server: the page loads no other origin's code.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'",
            ),
        ],
        include_str!("page.html"),
    )
        .into_response()
}

async fn not_found(State(s): State<Shared>, uri: axum::http::Uri) -> Response {
    error(
        &s,
        api_error(
            404,
            "not_found_error",
            format!("no such endpoint: {} (see /v1/models, /v1/chat/completions, /v1/completions)", uri.path()),
        ),
    )
}

async fn method_not_allowed(State(s): State<Shared>, method: axum::http::Method, uri: axum::http::Uri) -> Response {
    error(&s, api_error(405, "invalid_request_error", format!("{method} is not allowed on {}", uri.path())))
}

fn error(state: &AppState, e: ApiError) -> Response {
    state.metrics.status(e.status);
    tracing::info!(status = e.status, message = %loggable(&e.message), "request refused");
    let mut r = (StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST), Json(e.body())).into_response();
    if e.status == 429 {
        r.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from_static("5"));
    }
    if e.status == 401 {
        r.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
    }
    r
}

fn api_error(status: u16, kind: &'static str, message: impl Into<String>) -> ApiError {
    ApiError { status, message: message.into(), param: None, kind }
}

fn authorize(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &state.cfg.api_key else { return Ok(()) };
    // The scheme is case-insensitive (RFC 7235); the key is not.
    let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
        let (scheme, rest) = v.trim().split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
    });
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

async fn metrics_text(State(s): State<Shared>, headers: HeaderMap) -> Response {
    // Behind the key when there is one: the metrics say what the server is doing.
    if let Err(e) = authorize(&s, &headers) {
        return error(&s, e);
    }
    let depth = s.ready.get().map_or(0, |r| r.queue.depth.load(Ordering::Acquire));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], s.metrics.render(depth, s.ready.get().is_some())).into_response()
}

async fn models(State(s): State<Shared>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&s, &headers) {
        return error(&s, e);
    }
    s.metrics.status(200);
    Json(json!({"object": "list", "data": [model_object(&s)]})).into_response()
}

fn model_object(s: &AppState) -> Value {
    json!({"id": s.cfg.model_name, "object": "model", "created": 0, "owned_by": "deltafin"})
}

async fn model_by_id(State(s): State<Shared>, headers: HeaderMap, axum::extract::Path(id): axum::extract::Path<String>) -> Response {
    if let Err(e) = authorize(&s, &headers) {
        return error(&s, e);
    }
    if id != s.cfg.model_name {
        return error(&s, api_error(404, "not_found_error", format!("no model `{id}`; this server serves `{}`", s.cfg.model_name)));
    }
    s.metrics.status(200);
    Json(model_object(&s)).into_response()
}

async fn completions(State(s): State<Shared>, headers: HeaderMap, body: axum::body::Body) -> Response {
    handle(s, headers, body, false).await
}

async fn chat_completions(State(s): State<Shared>, headers: HeaderMap, body: axum::body::Body) -> Response {
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
    /// Ends the worker's generation after its current token (a stop string was found).
    stop: Arc<std::sync::atomic::AtomicBool>,
    /// Tools were declared: `tool_call` elements are parsed; inside, the text of a tag the
    /// prompt opened for a required or named call.
    tool_turn: Option<Option<Vec<u32>>>,
}

impl Turn {
    /// The interpretation of this turn's worker events.
    fn events(&self, model: &Arc<LoadedModel>) -> TurnEvents {
        let structured = self.req.response_format.is_some();
        TurnEvents::new(model.clone(), self.chat, self.req.stop.clone(), self.stop.clone(), self.tool_turn.clone(), structured)
    }
}

async fn handle(s: Shared, headers: HeaderMap, body: axum::body::Body, chat: bool) -> Response {
    if let Err(e) = authorize(&s, &headers) {
        return error(&s, e);
    }
    let body = match read_body(&s, &headers, body).await {
        Ok(b) => b,
        Err(e) => return error(&s, e),
    };
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
    // Tokenizing is CPU work of up to a second per megabyte: it runs on a blocking thread, a
    // few requests at a time, so the async workers keep answering (`/health` included); a
    // request that goes away while it waits for a turn costs nothing.
    let Ok(_turn) = s.tokenizing.acquire().await else {
        return error(&s, api_error(503, "server_error", "the server is shutting down"));
    };
    let m = model.clone();
    // Set when this handler is dropped (its client went away), from here on: the tokenizing
    // stops between pieces instead of finishing a text nobody waits for, and so does the
    // generation later.
    let cancel = Cancel::new();
    let guard = CancelOnDrop(cancel.clone());
    let c = cancel.clone();
    let grammars = ready.grammars.clone();
    let built = tokio::task::spawn_blocking(move || {
        let constraint = intake::constraint(&m, &grammars, &req)?;
        build_prompt(&m, req, chat, &c).map(|b| (b, constraint))
    })
    .await;
    let ((req, prompt, stop_ids, tool_turn), constraint) = match built {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => return error(&s, e),
        Err(e) => return error(&s, api_error(500, "server_error", format!("tokenizing the prompt failed: {e}"))),
    };
    drop(_turn);
    let (tx, rx) = unbounded_channel();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let job = Job {
        prompt: prompt.clone(),
        max_tokens: req.max_tokens,
        stop_ids,
        logprobs: req.logprobs.then_some(req.top_logprobs),
        prompt_logprobs: (req.echo && req.logprobs).then_some(req.top_logprobs),
        events: tx,
        cancel: cancel.clone(),
        stop: stop.clone(),
        draft_max: s.cfg.draft_max,
        draft_gate: s.cfg.draft_gate,
        sampling: req.sampling,
        constraint,
    };
    if ready.queue.submit(job).is_err() {
        return error(
            &s,
            api_error(429, "rate_limit_error", format!("the engine is busy and {} requests already wait; retry later", s.cfg.max_queue)),
        );
    }
    let n = s.counter.fetch_add(1, Ordering::Relaxed);
    let turn = Turn {
        id: format!("{}-{:016x}{n:08x}", if chat { "chatcmpl" } else { "cmpl" }, s.nonce),
        created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        model: s.cfg.model_name.clone(),
        chat,
        req,
        prompt_len: prompt.len(),
        stop,
        tool_turn,
    };
    if turn.req.stream {
        // A stream's status is sent now, whatever follows.
        s.metrics.status(200);
        stream_response(s, model, turn, rx, guard)
    } else {
        whole_response(s, model, turn, rx, guard).await
    }
}

/// The log line of a finished request.
fn log_done(turn: &Turn, finish: &str, generated: usize, stats: Option<&Stats>) {
    // Absent only when the worker hung up before reporting.
    let ttft_ms = stats.map_or("-".to_string(), |s| format!("{:.0}", s.ttft_s * 1000.0));
    let tok_s = stats.map_or("-".to_string(), |s| format!("{:.2}", s.decode_tok_s));
    tracing::info!(
        id = %turn.id,
        status = 200,
        stream = turn.req.stream,
        prompt_tokens = turn.prompt_len,
        completion_tokens = generated,
        ttft_ms = %ttft_ms,
        tok_s = %tok_s,
        finish,
        "request done"
    );
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
    // Held until the response is built: a client that goes away drops it and stops the worker.
    _guard: CancelOnDrop,
) -> Response {
    let tok = model.tokenizer();
    let mut events = turn.events(&model);
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
    // `done` stays None when the worker hung up before reporting.
    let mut done: Option<Box<Stats>> = None;
    let mut calls = output::ToolCalls::new(&turn.id);
    while !events.done {
        let ev = rx.recv().await;
        for item in events.on_event(ev) {
            match item {
                Item::Started => {}
                Item::Token { id, logprob, parts, tools } => {
                    if let Some((lp, top)) = logprob {
                        lps.push((id, Some(lp), top));
                    }
                    add(parts, &mut content, &mut reasoning);
                    for e in tools {
                        calls.apply(&e);
                    }
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
    if s.cfg.reasoning_in_content && turn.chat && !reasoning.is_empty() {
        content = format!("<think>{}</think>{content}", std::mem::take(&mut reasoning));
    }
    let mut body = if turn.chat {
        let mut msg = json!({"role": "assistant", "content": content});
        if !reasoning.is_empty() {
            msg["reasoning_content"] = json!(reasoning);
        }
        if !calls.is_empty() {
            msg["tool_calls"] = calls.to_json();
            if content.is_empty() {
                msg["content"] = Value::Null;
            }
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
            match &turn.req.prompt {
                Prompt::Text(p) => content.insert_str(0, p),
                Prompt::Ids(ids) => content.insert_str(0, &tok.decode(ids)),
                Prompt::Chat { .. } => {}
            }
            prompt_lps.append(&mut lps);
            lps = prompt_lps;
        }
        let logprobs = if turn.req.logprobs { completion_logprobs(tok, &lps) } else { Value::Null };
        json!({"id": turn.id, "object": "text_completion", "created": turn.created, "model": turn.model,
            "choices": [{"index": 0, "text": content, "logprobs": logprobs, "finish_reason": finish}]})
    };
    body["usage"] = usage(&turn, generated, cached);
    if let Some(sm) = &turn.req.sampling {
        // The seed it was sampled with (drawn here when none was sent): the same request with
        // it gives the same text.
        body["seed"] = json!(sm.seed);
    }
    if let Some(stats) = &done {
        body["timings"] = timings(stats, cached);
    }
    log_done(&turn, finish, generated, done.as_deref());
    s.metrics.status(200);
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
    let stream = async_stream(s.cfg.reasoning_in_content, model, turn, rx, guard);
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
    if let Some(sm) = &turn.req.sampling {
        c["seed"] = json!(sm.seed);
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

/// With `reasoning_in_content`: reasoning goes into `content` between `<think>` and `</think>`.
/// `open` tracks whether a `<think>` was written and not yet closed.
fn fold_reasoning(parts: Vec<(Part, String)>, open: &mut bool, end: bool) -> Vec<(Part, String)> {
    let mut out = Vec::new();
    for (p, t) in parts {
        match p {
            Part::Reasoning if !*open => {
                *open = true;
                out.push((Part::Content, format!("<think>{t}")));
            }
            Part::Reasoning => out.push((Part::Content, t)),
            Part::Content if *open => {
                *open = false;
                out.push((Part::Content, format!("</think>{t}")));
            }
            Part::Content => out.push((Part::Content, t)),
        }
    }
    if end && *open {
        *open = false;
        out.push((Part::Content, "</think>".to_string()));
    }
    out
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
    calls: output::ToolCalls,
    /// Reasoning folded into content, and whether a `<think>` is open.
    fold: bool,
    think_open: bool,
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
                Item::Token { id, logprob, parts, tools } => {
                    let mut lp = match logprob {
                        Some((l, top)) if turn.chat => json!({"content": [chat_logprob(tok, id, l, &top)]}),
                        Some((l, top)) => completion_logprobs(tok, &[(id, Some(l), top)]),
                        None => Value::Null,
                    };
                    let parts = if self.fold { fold_reasoning(parts, &mut self.think_open, false) } else { parts };
                    for (p, t) in parts {
                        self.queue.push_back(chunk(turn, delta(turn, p, t), std::mem::take(&mut lp), None));
                    }
                    for e in tools {
                        let d = self.calls.delta(&e);
                        self.queue.push_back(chunk(turn, d, std::mem::take(&mut lp), None));
                    }
                }
                Item::Text(parts) => {
                    let parts = if self.fold { fold_reasoning(parts, &mut self.think_open, true) } else { parts };
                    for (p, t) in parts {
                        self.queue.push_back(chunk(turn, delta(turn, p, t), Value::Null, None));
                    }
                }
                // `echo` is refused with `stream`: no prompt logprobs reach a stream.
                Item::Prompt(_) => {}
                Item::Finished { reason, stats } => {
                    log_done(turn, reason, self.events.generated, stats.as_deref());
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
    fold: bool,
    model: Arc<LoadedModel>,
    turn: Turn,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    guard: CancelOnDrop,
) -> impl futures_util::Stream<Item = Result<SseEvent, Infallible>> {
    let events = turn.events(&model);
    let calls = output::ToolCalls::new(&turn.id);
    let fold = turn.chat && fold;
    let state = StreamState { rx, _guard: guard, turn, model, events, queue: Default::default(), calls, fold, think_open: false };
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
