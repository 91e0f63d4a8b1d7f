//! The one engine thread, fed from a bounded queue in arrival order.
//!
//! With `--max-batch 1` generations run one at a time: the worker's [`Generator`] keeps the state
//! of the last generation; when a new prompt extends it (the usual chat follow-up), only the new
//! tokens are run, bit-identical to a cold run (tested). With more, a [`Batcher`] runs up to that
//! many requests in lockstep, one expert read serving all of them; each gets its solo output, and
//! the batcher keeps several conversations' states the same way.
//! A panic inside a generation is caught: its clients get an error, the server lives.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};

use std::collections::HashMap;

use deltafin::{
    BatchEvent, BatchJob, Batcher, Cancel, Error as EngineError, FinishReason, GenerateOptions, Generator, JobId, LoadedModel, Output,
    Stats, Step,
};
use tokio::sync::mpsc::UnboundedSender;

use crate::metrics::Metrics;

/// One queued generation.
pub struct Job {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub stop_ids: Vec<u32>,
    /// 0 = no logprobs; otherwise compute the chosen token's logprob and this many alternatives
    /// (`top + 1` so that `logprobs: true, top_logprobs: 0` still works).
    pub logprobs: Option<usize>,
    /// Also the prompt tokens' logprobs with this many alternatives (`echo` with `logprobs`).
    pub prompt_logprobs: Option<usize>,
    pub events: UnboundedSender<Event>,
    pub cancel: Cancel,
    /// Set when a stop string ended the reply: the generation ends after its current token, with
    /// its stats (a cancel would lose them and count as a client gone).
    pub stop: Arc<std::sync::atomic::AtomicBool>,
    /// Most drafts verified per step (with a drafter set), and whether the cost gate picks each
    /// step's length.
    pub draft_max: usize,
    pub draft_gate: bool,
    /// How tokens are chosen (`None`: greedy).
    pub sampling: Option<deltafin::Sampling>,
    /// The grammar a `response_format` asks the reply to follow.
    pub constraint: Option<deltafin::Constraint>,
}

/// What the worker reports back.
#[derive(Debug)]
pub enum Event {
    /// The prompt is being processed; this many leading tokens were reused.
    Started {
        cached_tokens: usize,
    },
    Token {
        id: u32,
        logprob: Option<f32>,
        top: Vec<(u32, f32)>,
    },
    /// Prompt tokens with their logprobs (none for the first: nothing precedes it), in order.
    PromptLogprobs(Vec<PromptLogprob>),
    Done {
        stats: Box<Stats>,
        cached_tokens: usize,
        hit_stop_id: bool,
    },
    Failed(String),
}

/// A prompt token, its logprob given the tokens before it, and the top alternatives there.
pub type PromptLogprob = (u32, Option<f32>, Vec<(u32, f32)>);

/// The prompt items that logits rows `first..` of `job`'s prompt give: row `r` scores the token
/// at `first + r + 1`; the first prompt token has no logprob.
fn prompt_items(job: &Job, k: usize, first: usize, logits: &deltafin::Mat) -> Vec<PromptLogprob> {
    let mut items = Vec::with_capacity(logits.rows + 1);
    if first == 0 {
        items.push((job.prompt[0], None, vec![]));
    }
    for r in 0..logits.rows {
        if let Some(&id) = job.prompt.get(first + r + 1) {
            let (lp, top) = logprobs(logits.row(r), id, k);
            items.push((id, lp, top));
        }
    }
    items
}

/// Sends jobs to the worker, refusing when the queue is full.
#[derive(Clone)]
pub struct Queue {
    tx: mpsc::SyncSender<Job>,
    pub depth: Arc<AtomicUsize>,
}

impl Queue {
    /// Queues a job, or gives it back if `max_queue` jobs already wait.
    pub fn submit(&self, job: Job) -> Result<(), Box<Job>> {
        self.depth.fetch_add(1, Ordering::AcqRel);
        self.tx.try_send(job).map_err(|e| {
            self.depth.fetch_sub(1, Ordering::AcqRel);
            match e {
                mpsc::TrySendError::Full(j) | mpsc::TrySendError::Disconnected(j) => Box::new(j),
            }
        })
    }
}

/// Prompt prefixes at least this long that queued requests share run once (`deltafin batch`).
pub const SHARED_PREFIX_MIN: usize = 16;

/// How the lockstep loop reuses state across requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reuse {
    /// A conversation's next turn continues its kept state (`serve`).
    Conversations,
    /// A prompt prefix queued requests share runs once ([`SHARED_PREFIX_MIN`] tokens or more;
    /// `deltafin batch`, whose requests have no next turn).
    SharedPrefixes,
}

/// Starts the worker thread for `model` with room for `max_queue` waiting jobs, running up to
/// `max_batch` in lockstep (1: one at a time, with the generator's drafter and kept state; more:
/// each request drafting up to `draft_max` tokens per step with a drafter of the kind the model
/// was opened with, state reused as `reuse` says).
pub fn start(model: Arc<LoadedModel>, max_queue: usize, max_batch: usize, draft_max: usize, reuse: Reuse, metrics: Arc<Metrics>) -> Queue {
    let (tx, rx) = mpsc::sync_channel::<Job>(max_queue);
    let depth = Arc::new(AtomicUsize::new(0));
    let d = depth.clone();
    std::thread::Builder::new()
        .name("deltafin-engine".into())
        .spawn(move || {
            if max_batch > 1 {
                return run_batched(&model, max_batch, draft_max, reuse, &rx, &d, &metrics);
            }
            let mut generator = Generator::new(&model);
            while let Ok(job) = rx.recv() {
                d.fetch_sub(1, Ordering::AcqRel);
                if job.cancel.is_cancelled() || job.events.is_closed() {
                    metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                let events = job.events.clone();
                let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    if job.prompt_logprobs.is_some() || job.max_tokens == 0 {
                        // Scoring needs the prompt rows' logits: the batcher's path, alone.
                        let mut jobs = HashMap::new();
                        let mut b = Batcher::new(&model, 1);
                        jobs.insert(b.submit(batch_job(&job)), job);
                        while !b.is_idle() {
                            b.step(&mut |e: BatchEvent<'_>| on_batch_event(e, &mut jobs, &metrics));
                        }
                    } else if let Ok(text) = std::env::var("DELTAFIN_REPLAY_REPLY") {
                        replay(&model, &job, &text)
                    } else {
                        run(&mut generator, job, &metrics)
                    }
                }));
                if result.is_err() {
                    generator.reset();
                    metrics.panics.fetch_add(1, Ordering::Relaxed);
                    let _ = events.send(Event::Failed("internal error: the generation panicked; the server is still running".into()));
                }
            }
        })
        .expect("spawn engine thread");
    Queue { tx, depth }
}

/// Reports a generation's progress to its client as events.
struct JobOutput<'j> {
    job: &'j Job,
    last: Option<u32>,
}

impl Output for JobOutput<'_> {
    fn begin(&mut self, cached_tokens: usize) {
        let _ = self.job.events.send(Event::Started { cached_tokens });
    }
    fn token(&mut self, step: Step<'_>) -> bool {
        self.last = Some(step.id);
        fault_token_delay();
        let (logprob, top) = match self.job.logprobs {
            Some(k) => logprobs(step.logits, step.id, k),
            None => (None, vec![]),
        };
        self.job.events.send(Event::Token { id: step.id, logprob, top }).is_ok()
            && !self.job.cancel.is_cancelled()
            && !self.job.stop.load(Ordering::Acquire)
    }
}

fn run(generator: &mut Generator<'_>, job: Job, metrics: &Metrics) {
    fault_panic(std::iter::once(job.prompt.as_slice()));
    let opts = GenerateOptions::new(job.max_tokens)
        .stop_ids(job.stop_ids.clone())
        .cancel(job.cancel.clone())
        .draft_max(job.draft_max)
        .draft_gate(job.draft_gate)
        .sampling(job.sampling)
        .constraint(job.constraint.clone());
    let mut out = JobOutput { job: &job, last: None };
    match generator.generate(&job.prompt, &opts, &mut out) {
        Ok(stats) => {
            if job.events.is_closed() {
                metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            }
            metrics.record(&stats, stats.cached_tokens);
            let hit_stop_id = out.last.is_some_and(|id| job.stop_ids.contains(&id));
            let cached_tokens = stats.cached_tokens;
            let _ = job.events.send(Event::Done { stats: Box::new(stats), cached_tokens, hit_stop_id });
        }
        Err(EngineError::Cancelled) => {
            metrics.cancelled.fetch_add(1, Ordering::Relaxed);
        }
        Err(e) => {
            let _ = job.events.send(Event::Failed(e.to_string()));
        }
    }
}

/// The batcher's job for a queued request.
fn batch_job(job: &Job) -> BatchJob {
    let opts = GenerateOptions::new(job.max_tokens)
        .stop_ids(job.stop_ids.clone())
        .cancel(job.cancel.clone())
        .sampling(job.sampling)
        .constraint(job.constraint.clone());
    let b = BatchJob::new(job.prompt.clone(), opts);
    if job.prompt_logprobs.is_some() {
        b.with_prompt_logits()
    } else {
        b
    }
}

/// Turns a batcher event into the events of its request; `false` stops that job.
fn on_batch_event(e: BatchEvent<'_>, jobs: &mut HashMap<JobId, Job>, metrics: &Metrics) -> bool {
    match e {
        BatchEvent::Started { job, cached_tokens } => {
            if let Some(j) = jobs.get(&job) {
                let _ = j.events.send(Event::Started { cached_tokens });
            }
            true
        }
        BatchEvent::Token { job, step } => {
            let Some(j) = jobs.get(&job) else { return false };
            let (logprob, top) = match j.logprobs {
                Some(k) => logprobs(step.logits, step.id, k),
                None => (None, vec![]),
            };
            j.events.send(Event::Token { id: step.id, logprob, top }).is_ok() && !j.cancel.is_cancelled() && !j.stop.load(Ordering::Acquire)
        }
        BatchEvent::PromptLogits { job, first, logits } => {
            if let Some(j) = jobs.get(&job) {
                if let Some(k) = j.prompt_logprobs {
                    let _ = j.events.send(Event::PromptLogprobs(prompt_items(j, k, first, logits)));
                }
            }
            true
        }
        BatchEvent::Finished { job, reason, stats } => {
            if let Some(j) = jobs.remove(&job) {
                if j.events.is_closed() {
                    metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                }
                let cached_tokens = stats.cached_tokens;
                metrics.record(&stats, cached_tokens);
                let _ = j.events.send(Event::Done { stats, cached_tokens, hit_stop_id: reason == FinishReason::Stop });
            }
            true
        }
        BatchEvent::Failed { job, error } => {
            if let Some(j) = jobs.remove(&job) {
                if matches!(error, EngineError::Cancelled) {
                    metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                } else {
                    let _ = j.events.send(Event::Failed(error.to_string()));
                }
            }
            true
        }
    }
}

/// The lockstep loop: jobs join the batcher as they arrive and leave as they finish.
fn run_batched(
    model: &LoadedModel,
    max_batch: usize,
    draft_max: usize,
    reuse: Reuse,
    rx: &mpsc::Receiver<Job>,
    depth: &AtomicUsize,
    metrics: &Metrics,
) {
    let new_batcher = || {
        let b = Batcher::new(model, max_batch).drafting_as_opened(draft_max);
        match reuse {
            Reuse::Conversations => b.keep_states(),
            Reuse::SharedPrefixes => b.share_prefixes(SHARED_PREFIX_MIN),
        }
    };
    let mut batcher = new_batcher();
    let mut jobs: HashMap<JobId, Job> = HashMap::new();
    loop {
        // Wait for work when idle; otherwise take whatever arrived since the last step.
        let mut incoming = Vec::new();
        if batcher.is_idle() {
            match rx.recv() {
                Ok(j) => incoming.push(j),
                Err(_) => return,
            }
        }
        incoming.extend(rx.try_iter());
        for job in incoming {
            depth.fetch_sub(1, Ordering::AcqRel);
            if job.cancel.is_cancelled() || job.events.is_closed() {
                metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let id = batcher.submit(batch_job(&job));
            jobs.insert(id, job);
        }
        let step = std::panic::catch_unwind(AssertUnwindSafe(|| {
            fault_panic(jobs.values().map(|j| j.prompt.as_slice()));
            let before = batcher.stats().clone();
            batcher.step(&mut |e: BatchEvent<'_>| on_batch_event(e, &mut jobs, metrics));
            metrics.record_step(&before, batcher.stats());
        }));
        if step.is_err() {
            metrics.panics.fetch_add(1, Ordering::Relaxed);
            for (_, j) in jobs.drain() {
                let _ = j.events.send(Event::Failed("internal error: the generation panicked; the server is still running".into()));
            }
            batcher = new_batcher();
        }
    }
}

/// Fault injection for the test that a panicking generation leaves the server up.
/// Test hook for what no random model emits (tool calls): `DELTAFIN_REPLAY_REPLY` is a recorded
/// reply, text with control tokens by name, sent as if generated (no engine run, zero stats), so
/// the server's parsing and streaming of it can be tested with real clients.
fn replay(model: &LoadedModel, job: &Job, text: &str) {
    let ids = model.tokenizer().encode_with_specials(text);
    let _ = job.events.send(Event::Started { cached_tokens: 0 });
    let mut last = None;
    for &id in ids.iter().take(job.max_tokens) {
        last = Some(id);
        if job.events.send(Event::Token { id, logprob: None, top: vec![] }).is_err()
            || job.stop.load(Ordering::Acquire)
            || job.stop_ids.contains(&id)
        {
            break;
        }
    }
    let mut stats = Stats::default();
    stats.prompt_tokens = job.prompt.len();
    stats.generated_tokens = ids.len().min(job.max_tokens);
    let hit_stop_id = last.is_some_and(|id| job.stop_ids.contains(&id));
    let _ = job.events.send(Event::Done { stats: Box::new(stats), cached_tokens: 0, hit_stop_id });
}

/// A planted slow generator (tests only: `DELTAFIN_FAULT_TOKEN_DELAY_MS`): each token of a
/// one-at-a-time generation waits this long, so a test can act on a reply mid-way (the chat
/// page's Stop) however fast this machine generates.
fn fault_token_delay() {
    static DELAY: std::sync::OnceLock<Option<std::time::Duration>> = std::sync::OnceLock::new();
    let delay = DELAY.get_or_init(|| {
        std::env::var("DELTAFIN_FAULT_TOKEN_DELAY_MS").ok().and_then(|v| v.parse().ok()).map(std::time::Duration::from_millis)
    });
    if let Some(d) = delay {
        std::thread::sleep(*d);
    }
}

fn fault_panic<'p>(mut prompts: impl Iterator<Item = &'p [u32]>) {
    if let Some(id) = std::env::var("DELTAFIN_FAULT_PANIC_ON_TOKEN").ok().and_then(|v| v.parse::<u32>().ok()) {
        if prompts.any(|p| p.contains(&id)) {
            panic!("injected fault: prompt contains token {id}");
        }
    }
}

/// The chosen token's log-probability and the `k` most likely alternatives, from real logits.
pub fn logprobs(logits: &[f32], id: u32, k: usize) -> (Option<f32>, Vec<(u32, f32)>) {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = m + logits.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    let lp = |i: usize| (logits[i] as f64 - lse) as f32;
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    let k = k.min(logits.len());
    if k > 0 {
        idx.select_nth_unstable_by(k - 1, |&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    }
    let mut top: Vec<(u32, f32)> = idx[..k].iter().map(|&i| (i as u32, lp(i))).collect();
    top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    (Some(lp(id as usize)), top)
}
