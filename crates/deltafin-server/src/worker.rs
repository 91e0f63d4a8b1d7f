//! The one engine thread: generations run one at a time, in arrival order, from a bounded queue.
//!
//! The worker keeps the sequence state of the last generation; when a new prompt extends the
//! tokens that state has consumed (the usual chat follow-up), only the new tokens are run. The
//! engine's kernels are batch-invariant, so the continuation is bit-identical to a cold run
//! (tested). A panic inside a generation is caught: the client gets an error, the server lives.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};

use deltafin::{Cancel, Error as EngineError, GenerateOptions, LoadedModel, Sequence, Stats};
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
    pub events: UnboundedSender<Event>,
    pub cancel: Cancel,
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
    Done {
        stats: Box<Stats>,
        cached_tokens: usize,
        hit_stop_id: bool,
    },
    Failed(String),
}

/// Sends jobs to the worker, refusing when the queue is full.
#[derive(Clone)]
pub struct Queue {
    tx: mpsc::SyncSender<Job>,
    pub depth: Arc<AtomicUsize>,
}

impl Queue {
    /// Queues a job, or gives it back if `max_queue` jobs already wait.
    pub fn submit(&self, job: Job) -> Result<(), Job> {
        self.depth.fetch_add(1, Ordering::AcqRel);
        self.tx.try_send(job).map_err(|e| {
            self.depth.fetch_sub(1, Ordering::AcqRel);
            match e {
                mpsc::TrySendError::Full(j) | mpsc::TrySendError::Disconnected(j) => j,
            }
        })
    }
}

/// Starts the worker thread for `model` with room for `max_queue` waiting jobs.
pub fn start(model: Arc<LoadedModel>, max_queue: usize, metrics: Arc<Metrics>) -> Queue {
    let (tx, rx) = mpsc::sync_channel::<Job>(max_queue);
    let depth = Arc::new(AtomicUsize::new(0));
    let d = depth.clone();
    std::thread::Builder::new()
        .name("deltafin-engine".into())
        .spawn(move || {
            let mut kept = Kept::default();
            while let Ok(job) = rx.recv() {
                d.fetch_sub(1, Ordering::AcqRel);
                if job.cancel.is_cancelled() || job.events.is_closed() {
                    metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                let events = job.events.clone();
                let result = std::panic::catch_unwind(AssertUnwindSafe(|| run(&model, &mut kept, job, &metrics)));
                if result.is_err() {
                    kept = Kept::default();
                    metrics.panics.fetch_add(1, Ordering::Relaxed);
                    let _ = events.send(Event::Failed("internal error: the generation panicked; the server is still running".into()));
                }
            }
        })
        .expect("spawn engine thread");
    Queue { tx, depth }
}

/// What the worker keeps between generations: the full sequence of the last one, and a copy
/// taken right after its prompt (a chat follow-up always extends the prompt; it rarely extends
/// the generated tokens exactly, since the reply is re-rendered and re-tokenized).
#[derive(Default)]
pub struct Kept {
    full: Option<Sequence>,
    prompt: Option<Sequence>,
}

fn extends(s: &Sequence, prompt: &[u32], max_tokens: usize) -> bool {
    s.ids().len() < prompt.len() && prompt.starts_with(s.ids()) && prompt.len() + max_tokens <= s.context_limit()
}

fn run(model: &LoadedModel, kept: &mut Kept, job: Job, metrics: &Metrics) {
    // Fault injection for the test that a panicking generation leaves the server up.
    if let Some(id) = std::env::var("DELTAFIN_FAULT_PANIC_ON_TOKEN").ok().and_then(|v| v.parse::<u32>().ok()) {
        if job.prompt.contains(&id) {
            panic!("injected fault: prompt contains token {id}");
        }
    }
    let full = kept.full.take();
    let snap = kept.prompt.take();
    let mut seq = match (full, snap) {
        (Some(f), _) if extends(&f, &job.prompt, job.max_tokens) => f,
        (_, Some(p)) if extends(&p, &job.prompt, job.max_tokens) => p,
        _ => model.new_sequence(),
    };
    let cached = seq.ids().len();
    let _ = job.events.send(Event::Started { cached_tokens: cached });
    let opts = GenerateOptions::new(job.max_tokens).stop_ids(job.stop_ids.clone()).cancel(job.cancel.clone());
    // Run all but the last prompt token first and keep a copy there; the split does not change a
    // bit of the output (the kernels are batch-invariant).
    let t0 = std::time::Instant::now();
    let body = &job.prompt[cached..job.prompt.len() - 1];
    if !body.is_empty() {
        if let Err(e) = model.engine().forward_with(&mut seq, body, deltafin::LogitRows::Last, Some(&job.cancel)) {
            if !matches!(e, EngineError::Cancelled) {
                let _ = job.events.send(Event::Failed(e.to_string()));
            }
            return;
        }
    }
    let body_secs = t0.elapsed().as_secs_f64();
    let snapshot = seq.clone();
    let mut last = None;
    let result = model.engine().generate_with(&mut seq, &job.prompt[job.prompt.len() - 1..], &opts, |step| {
        last = Some(step.id);
        let (logprob, top) = match job.logprobs {
            Some(k) => logprobs(step.logits, step.id, k),
            None => (None, vec![]),
        };
        job.events.send(Event::Token { id: step.id, logprob, top }).is_ok() && !job.cancel.is_cancelled()
    });
    kept.prompt = Some(snapshot);
    match result {
        Ok(mut stats) => {
            if job.events.is_closed() {
                metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            }
            stats.prompt_tokens = job.prompt.len() - cached;
            stats.ttft_s += body_secs;
            stats.total_s += body_secs;
            metrics.record(&stats, cached);
            let hit_stop_id = last.is_some_and(|id| job.stop_ids.contains(&id));
            let _ = job.events.send(Event::Done { stats: Box::new(stats), cached_tokens: cached, hit_stop_id });
            kept.full = Some(seq);
        }
        Err(EngineError::Cancelled) => {
            metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            kept.full = Some(seq);
        }
        Err(e) => {
            let _ = job.events.send(Event::Failed(e.to_string()));
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
