//! `deltafin batch`: files in the OpenAI Batch API line format (what `vllm run-batch` reads and
//! writes) run through the server's own request handling, in process, up to `max_batch`
//! requests in lockstep so each expert read serves all of them.
//!
//! In: one JSON object per line, `custom_id`, `method` (`POST`), `url` (`/v1/chat/completions` or
//! `/v1/completions`), `body`. Out: one line per request, `id`, `custom_id`, `response`
//! (`status_code`, `request_id`, `body`: exactly what the server would answer) and `error`, in
//! the order requests finish.
//!
//! **Resumable.** Each result is appended whole and synced before the next is written; a re-run
//! first cuts off a torn last line (a crash mid-write), then skips every `custom_id` the output
//! already holds a result for (a `response` with its status and body, or an `error`), so no
//! line is lost or written twice. Line and request ids carry a number drawn per run, so a resumed
//! batch never repeats one. An output that is the input, or that holds results for requests the
//! input does not have (another batch's), is refused before anything runs. A request's own error (a refused field, a
//! prompt too long) is that line's result and the batch goes on; a malformed envelope (no
//! `custom_id`, a repeated one, not JSON) stops the batch before anything runs, naming the line.

use std::collections::HashSet;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::http::{header, Request as HttpRequest};
use deltafin::LoadedModel;
use serde_json::{json, Value};
use tower::ServiceExt;

use crate::{router, AppState, Ready, ServerConfig};

/// What a batch run needs.
#[derive(Clone, Debug)]
pub struct BatchConfig {
    pub input: PathBuf,
    pub output: PathBuf,
    /// Requests run in lockstep at most (the model must hold as many sequence slots).
    pub max_batch: usize,
    pub model_name: String,
    pub default_max_tokens: usize,
    /// Drafts each request verifies per step by prompt lookup (0: none).
    pub draft_max: usize,
}

/// Progress of a batch run, for a progress bar.
pub trait BatchProgress {
    /// `total` requests, of which `done` were finished by an earlier run.
    fn start(&mut self, total: usize, done: usize);
    /// One more request finished, having generated `tokens`.
    fn line(&mut self, tokens: u64);
}

/// What a batch run did.
#[derive(Clone, Debug, Default)]
pub struct BatchSummary {
    pub total: usize,
    /// Finished by an earlier run (found in the output).
    pub skipped: usize,
    /// Answered 200 / answered with an error.
    pub succeeded: usize,
    pub failed: usize,
    pub prompt_tokens: u64,
    /// Prompt tokens not run again: started from a prefix another request shared.
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    pub seconds: f64,
    /// Engine steps run in lockstep, and summed over them: the sequences they ran and the
    /// distinct experts they routed; expert bytes they read.
    pub steps: u64,
    pub sequence_steps: u64,
    pub distinct_experts: u64,
    pub expert_bytes_read: u64,
}

impl BatchSummary {
    /// Mean sequences per lockstep step.
    pub fn sequences_per_step(&self) -> f64 {
        self.sequence_steps as f64 / (self.steps as f64).max(1.0)
    }
    /// Mean distinct experts routed per step (all layers).
    pub fn distinct_experts_per_step(&self) -> f64 {
        self.distinct_experts as f64 / (self.steps as f64).max(1.0)
    }
    /// Expert bytes read per generated token.
    pub fn bytes_per_token(&self) -> f64 {
        self.expert_bytes_read as f64 / (self.completion_tokens as f64).max(1.0)
    }
}

/// Why a batch could not run.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    // `err`, not `source`: the message carries the cause, and a source as well would print it
    // twice in a chain (`error: X: cause: cause`).
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{path} line {line}: {why}")]
    Input { path: PathBuf, line: usize, why: String },
    #[error("{path}: {why}")]
    Output { path: PathBuf, why: String },
}

/// One request line.
struct Line {
    custom_id: String,
    url: String,
    method: String,
    body: Value,
}

fn read_input(path: &PathBuf) -> Result<Vec<Line>, BatchError> {
    let text = std::fs::read_to_string(path).map_err(|err| BatchError::Io { path: path.clone(), err })?;
    let mut seen = HashSet::new();
    let mut lines = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        if raw.trim().is_empty() {
            continue;
        }
        let bad = |why: String| BatchError::Input { path: path.clone(), line: i + 1, why };
        let v: Value = serde_json::from_str(raw).map_err(|e| bad(format!("not JSON: {e}")))?;
        let field = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
        let custom_id = field("custom_id").ok_or_else(|| bad("no `custom_id` string".into()))?;
        if !seen.insert(custom_id.clone()) {
            return Err(bad(format!("`custom_id` {custom_id:?} appears twice; each request needs its own")));
        }
        let body = v.get("body").filter(|b| b.is_object()).cloned().ok_or_else(|| bad("no `body` object".into()))?;
        lines.push(Line {
            custom_id,
            url: field("url").unwrap_or_default(),
            method: field("method").unwrap_or_else(|| "POST".into()),
            body,
        });
    }
    Ok(lines)
}

/// The `custom_id`s the output already holds a result for, after cutting off a torn last line.
/// A line whose `custom_id` the input does not have is refused (the output of another batch).
fn finished_ids(path: &PathBuf, input: &[Line]) -> Result<HashSet<String>, BatchError> {
    let io = |err| BatchError::Io { path: path.clone(), err };
    let Ok(bytes) = std::fs::read(path) else { return Ok(HashSet::new()) };
    let whole = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |p| p + 1);
    let known: HashSet<&str> = input.iter().map(|l| l.custom_id.as_str()).collect();
    let mut done = HashSet::new();
    let mut foreign = Vec::new();
    for line in String::from_utf8_lossy(&bytes[..whole]).lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else { continue };
        let Some(id) = v.get("custom_id").and_then(Value::as_str) else { continue };
        if !known.contains(id) {
            foreign.push(id.to_string());
            continue;
        }
        if is_result(&v) {
            done.insert(id.to_string());
        }
    }
    if let Some(first) = foreign.first() {
        return Err(BatchError::Output {
            path: path.clone(),
            why: format!(
                "holds results for {} request(s) the input does not have (custom_id {first:?}...): it is another batch's output; \
                 choose another --output, or remove those lines",
                foreign.len()
            ),
        });
    }
    if whole < bytes.len() {
        let f = std::fs::OpenOptions::new().write(true).open(path).map_err(io)?;
        f.set_len(whole as u64).map_err(io)?;
        f.sync_all().map_err(io)?;
    }
    Ok(done)
}

/// Whether an output line is a request's result: a `response` with its status and body, or an
/// `error` with its code.
fn is_result(v: &Value) -> bool {
    let response = v.get("response").is_some_and(|r| r.get("status_code").is_some_and(Value::is_u64) && r.get("body").is_some());
    let error = v.get("error").is_some_and(|e| e.get("code").is_some_and(Value::is_string));
    response || error
}

/// Refuses an output that is the input file itself (appending results to the requests would
/// lose both).
fn check_paths(cfg: &BatchConfig) -> Result<(), BatchError> {
    let same = match (std::fs::canonicalize(&cfg.input), std::fs::canonicalize(&cfg.output)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same {
        return Err(BatchError::Output {
            path: cfg.output.clone(),
            why: "is the input file: results would be appended to the requests; choose another --output".into(),
        });
    }
    Ok(())
}

/// Runs one line through the router; returns its output object and completion tokens. `run` is
/// this run's number, `n` the line's within it.
async fn answer(app: axum::Router, line: Line, run: u64, n: u64) -> (Value, u64, u64, bool) {
    let error_line = |code: &str, message: String| json!({"id": format!("batch_req_{run:016x}{n:08x}"), "custom_id": line.custom_id, "response": null, "error": {"code": code, "message": message}});
    if line.method != "POST" {
        return (error_line("invalid_method", format!("method {:?}: only POST is supported", line.method)), 0, 0, false);
    }
    if line.url != "/v1/chat/completions" && line.url != "/v1/completions" {
        return (error_line("invalid_url", format!("url {:?}: use /v1/chat/completions or /v1/completions", line.url)), 0, 0, false);
    }
    if line.body.get("stream").and_then(Value::as_bool) == Some(true) {
        return (error_line("invalid_request", "`stream`: a batch cannot stream; leave it out".into()), 0, 0, false);
    }
    let req = HttpRequest::post(&line.url)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(serde_json::to_vec(&line.body).unwrap_or_default()))
        .expect("a valid request");
    let resp = match app.oneshot(req).await {
        Ok(r) => r,
        Err(e) => return (error_line("internal_error", e.to_string()), 0, 0, false),
    };
    let status = resp.status().as_u16();
    let body = axum::body::to_bytes(resp.into_body(), usize::MAX).await.unwrap_or_default();
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let (p, c) = (body["usage"]["prompt_tokens"].as_u64().unwrap_or(0), body["usage"]["completion_tokens"].as_u64().unwrap_or(0));
    let out = json!({
        "id": format!("batch_req_{run:016x}{n:08x}"),
        "custom_id": line.custom_id,
        "response": {"status_code": status, "request_id": format!("req_{run:016x}{n:08x}"), "body": body},
        "error": null
    });
    (out, p, c, status == 200)
}

/// Runs the batch in `cfg` on `model` (opened with at least `cfg.max_batch` sequence slots).
pub fn run_batch(cfg: &BatchConfig, model: LoadedModel, progress: &mut dyn BatchProgress) -> Result<BatchSummary, BatchError> {
    check_paths(cfg)?;
    let lines = read_input(&cfg.input)?;
    let done = finished_ids(&cfg.output, &lines)?;
    let total = lines.len();
    let pending: Vec<Line> = lines.into_iter().filter(|l| !done.contains(&l.custom_id)).collect();
    let mut summary = BatchSummary { total, skipped: total - pending.len(), ..Default::default() };
    progress.start(total, summary.skipped);
    let io = |err| BatchError::Io { path: cfg.output.clone(), err };
    let mut out = std::fs::OpenOptions::new().create(true).append(true).open(&cfg.output).map_err(io)?;
    let start = Instant::now();
    let max_batch = cfg.max_batch.max(1);
    let server = ServerConfig {
        host: String::new(),
        port: 0,
        api_key: None,
        max_queue: 2 * max_batch,
        max_body_bytes: usize::MAX,
        body_timeout_s: 30,
        header_timeout_s: 30,
        max_connections: 1,
        default_max_tokens: cfg.default_max_tokens,
        model_name: cfg.model_name.clone(),
        keep_alive_s: 15,
        draft_max: cfg.draft_max,
        draft_gate: true,
        max_batch,
        reasoning_in_content: false,
    };
    let model = Arc::new(model);
    let state = AppState::new(server);
    let queue = crate::worker::start(
        model.clone(),
        state.cfg.max_queue,
        max_batch,
        cfg.draft_max,
        crate::worker::Reuse::SharedPrefixes,
        state.metrics.clone(),
    );
    let _ = state.ready.set(Ready { model, queue, grammars: Arc::default() });
    let metrics = state.metrics.clone();
    let app = router(state);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(io)?;
    rt.block_on(async {
        // As many in flight as run in lockstep, and as many again queued behind them, so a slot
        // freed by a finished request is taken at the next step.
        let (tx, mut rx) = tokio::sync::mpsc::channel::<(Value, u64, u64, bool)>(2 * max_batch);
        let permits = Arc::new(tokio::sync::Semaphore::new(2 * max_batch));
        let feeder = {
            let app = app.clone();
            // Ids are this run's number and the line's: a resumed batch never repeats one.
            let run = {
                let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
                twox_hash::XxHash3_64::oneshot(&[now.to_le_bytes(), u64::from(std::process::id()).to_le_bytes()].concat())
            };
            tokio::spawn(async move {
                for (i, line) in pending.into_iter().enumerate() {
                    let permit = permits.clone().acquire_owned().await.expect("semaphore open");
                    let (app, tx) = (app.clone(), tx.clone());
                    tokio::spawn(async move {
                        let r = answer(app, line, run, i as u64).await;
                        let _ = tx.send(r).await;
                        drop(permit);
                    });
                }
            })
        };
        // Fault injection for the resume test: crash mid-write after this many lines.
        let crash_after = std::env::var("DELTAFIN_FAULT_BATCH_CRASH_AFTER").ok().and_then(|v| v.parse::<usize>().ok());
        let mut written = 0;
        while let Some((line, p, c, ok)) = rx.recv().await {
            let mut text = serde_json::to_vec(&line).unwrap_or_default();
            text.push(b'\n');
            if crash_after == Some(written) {
                let _ = out.write_all(&text[..text.len() / 2]).and_then(|_| out.sync_data());
                std::process::abort();
            }
            written += 1;
            out.write_all(&text).and_then(|_| out.sync_data()).map_err(io)?;
            summary.prompt_tokens += p;
            summary.completion_tokens += c;
            if ok {
                summary.succeeded += 1;
            } else {
                summary.failed += 1;
            }
            progress.line(c);
        }
        let _ = feeder.await;
        Ok::<(), BatchError>(())
    })?;
    summary.seconds = start.elapsed().as_secs_f64();
    let g = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    summary.steps = g(&metrics.steps);
    summary.cached_tokens = g(&metrics.cached_tokens);
    summary.sequence_steps = g(&metrics.sequence_steps);
    summary.distinct_experts = g(&metrics.distinct_experts);
    summary.expert_bytes_read = g(&metrics.step_expert_bytes_read);
    Ok(summary)
}
