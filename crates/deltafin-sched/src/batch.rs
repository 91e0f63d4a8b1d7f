//! Many sequences in lockstep: every step of a [`Batcher`] runs the next tokens of all its active
//! sequences together, so each distinct expert a step routes is read once for all of them.
//!
//! Sequences join between steps (a joining prompt runs in the same step as the others' decode
//! rows, in chunks of the engine's prefill chunk) and leave when they finish; the number active
//! at once is bounded by the model's sequence slots ([`crate::EngineBuilder::max_sequences`]),
//! whose state the RAM budget holds; the rest wait in order. The step is batch-invariant, so a
//! sequence's ids and logits are bit-identical to running it alone, whoever shares its steps.
//!
//! With [`Batcher::keep_states`] on (the server), each finished sequence and a copy of it right
//! after its prompt are kept within the budget's allowance for kept state, and a job whose prompt
//! extends one (a conversation's next turn) continues it, running only its new tokens.
//!
//! With [`Batcher::drafting`] on, each decoding job drafts by prompt lookup (its own n-gram
//! drafter over its own tokens) whenever its text repeats: its pending token and the drafts run
//! as one verify slot of the shared step, the prefix K3 agrees with is kept and the sequence cut
//! back exactly, so every job's ids stay its solo plain run's.
//!
//! With [`Batcher::share_prefixes`] on (`deltafin batch`), a prompt prefix that waiting jobs
//! share (a common system prompt) is run once: the first job to run it stops its prompt there
//! for a step, a copy of its state is kept, and the jobs that share the prefix wait for that copy
//! and start from it, running only what follows.
//!
//! A job may also ask for the logits of its prompt rows (prompt scoring: `echo` with logprobs,
//! single-token classification); with `max_new` 0 it ends after its prompt.

use std::collections::VecDeque;
use std::time::Instant;

use deltafin_core::Mat;

use crate::engine::LogitRows;
use crate::engine::{Phase, Slot};
use crate::error::{Error, Result};
use crate::generation::{GenerateOptions, Step};
use crate::kept::KeptStates;
use crate::open::LoadedModel;
use crate::sequence::Sequence;
use crate::stats::Stats;
use deltafin_spec::{verify_with, Drafter, NgramDrafter};

/// Most rows of scoring prompts one step takes when the working memory sets no bound (a model
/// opened without a RAM budget).
const SCORING_ROWS_MAX: usize = 4096;

/// Most prompt tokens a job runs per step while other jobs are decoding, by default
/// ([`Batcher::mixed_prompt_chunk`]): a long prompt then delays the others' next tokens by one
/// such chunk per step, not by the whole prompt.
pub const MIXED_PROMPT_CHUNK: usize = 512;

/// A job's number within its [`Batcher`], in submission order.
pub type JobId = u64;

/// One sequence to run.
#[derive(Clone, Debug)]
pub struct BatchJob {
    pub prompt: Vec<u32>,
    /// `max_new` (0: the prompt only), stop ids, a cancel flag, sampling, an output grammar.
    /// Drafting is the batcher's ([`Batcher::drafting`]; never for a job with a grammar), not
    /// these options' `draft_max`.
    pub opts: GenerateOptions,
    /// Hand over the logits of every prompt row ([`BatchEvent::PromptLogits`]).
    pub prompt_logits: bool,
}

impl BatchJob {
    /// Up to `opts.max_new` tokens after `prompt`.
    pub fn new(prompt: Vec<u32>, opts: GenerateOptions) -> BatchJob {
        BatchJob { prompt, opts, prompt_logits: false }
    }
    /// Also hand over the prompt rows' logits.
    pub fn with_prompt_logits(mut self) -> BatchJob {
        self.prompt_logits = true;
        self
    }
}

/// Why a job ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// It generated a stop id (emitted).
    Stop,
    /// It reached `max_new`, or the output said to stop.
    Length,
    /// Its sequence reached the context limit.
    ContextLimit,
}

/// What a job's run produced, as it happens.
pub enum BatchEvent<'a> {
    /// The job took a sequence slot; its first `cached_tokens` prompt tokens were reused from a
    /// kept state.
    Started { job: JobId, cached_tokens: usize },
    /// Logits of prompt rows `first..first + logits.rows` (row `i`: the distribution after
    /// prompt token `first + i`), for a job that asked; chunks arrive in order.
    PromptLogits { job: JobId, first: usize, logits: &'a Mat },
    /// One generated token.
    Token { job: JobId, step: Step<'a> },
    /// The job ended normally; its own stats (tokens, time to first token, decode rate).
    Finished { job: JobId, reason: FinishReason, stats: Box<Stats> },
    /// The job ended with an error (its own, or the step it shared failed); others go on.
    Failed { job: JobId, error: &'a Error },
}

/// Receives a batch's events.
pub trait BatchOutput {
    /// An event; for [`BatchEvent::Token`], `false` ends that job after this token.
    fn event(&mut self, event: BatchEvent<'_>) -> bool;
}

impl<F: FnMut(BatchEvent<'_>) -> bool> BatchOutput for F {
    fn event(&mut self, event: BatchEvent<'_>) -> bool {
        self(event)
    }
}

/// Totals of a batch run.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct BatchStats {
    pub jobs_finished: u64,
    pub jobs_failed: u64,
    pub steps: u64,
    /// Sequences summed over steps (mean per step = this / steps).
    pub sequence_steps: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    /// Bytes of the distinct experts the steps routed, summed.
    pub distinct_expert_bytes: u64,
    /// Distinct experts the steps routed (each counted once per layer and step), summed.
    pub distinct_experts: u64,
    /// Prompt tokens reused from kept states and shared prefixes (not run again).
    pub cached_tokens: u64,
    /// Shared prompt prefixes run once and kept for the jobs sharing them
    /// ([`Batcher::share_prefixes`]).
    pub shared_prefixes: u64,
    /// Expert bytes read from the drives.
    pub expert_bytes_read: u64,
    /// Drafted tokens verified, those K3 agreed with, and verify slots run ([`Batcher::drafting`]).
    pub drafted: u64,
    pub accepted: u64,
    pub verifies: u64,
    pub seconds: f64,
}

impl BatchStats {
    /// Generated tokens per second over the whole run.
    pub fn tok_s(&self) -> f64 {
        if self.seconds > 0.0 {
            self.generated_tokens as f64 / self.seconds
        } else {
            0.0
        }
    }
    /// Prompt and generated tokens per second.
    pub fn all_tok_s(&self) -> f64 {
        if self.seconds > 0.0 {
            (self.prompt_tokens + self.generated_tokens) as f64 / self.seconds
        } else {
            0.0
        }
    }
    /// Mean sequences per step.
    pub fn sequences_per_step(&self) -> f64 {
        self.sequence_steps as f64 / (self.steps as f64).max(1.0)
    }
    /// Mean distinct experts routed per step (all layers together).
    pub fn distinct_experts_per_step(&self) -> f64 {
        self.distinct_experts as f64 / (self.steps as f64).max(1.0)
    }
    /// Expert bytes read per generated token.
    pub fn bytes_per_token(&self) -> f64 {
        self.expert_bytes_read as f64 / (self.generated_tokens as f64).max(1.0)
    }
}

/// Where an active job stands.
struct Active {
    id: JobId,
    job: BatchJob,
    seq: Sequence,
    /// Prompt tokens already run (or reused).
    fed: usize,
    /// Prompt tokens reused from a kept state.
    cached: usize,
    /// The length of a prompt prefix waiting jobs share, which this job runs first and keeps.
    share_at: Option<usize>,
    /// The next token to run (its id was emitted already), once the prompt is done.
    pending: Option<u32>,
    generated: usize,
    started: Instant,
    first_token: Option<Instant>,
    /// Its drafter and every token so far (with [`Batcher::drafting`]).
    drafter: Option<(Box<dyn Drafter>, Vec<u32>)>,
    /// The drafts in this step's verify slot, after the pending token.
    drafts: Vec<u32>,
    drafted: u64,
    accepted: u64,
    verifies: u64,
}

impl Active {
    /// A job starting on `seq`, whose first `cached` prompt tokens it holds already.
    fn new(id: JobId, job: BatchJob, seq: Sequence, cached: usize) -> Active {
        Active {
            id,
            job,
            seq,
            fed: cached,
            cached,
            share_at: None,
            pending: None,
            generated: 0,
            started: Instant::now(),
            first_token: None,
            drafter: None,
            drafts: vec![],
            drafted: 0,
            accepted: 0,
            verifies: 0,
        }
    }

    /// Emits generated token `t` (chosen from `logits`); the reason the job ends there, if it does.
    fn emit(&mut self, t: u32, logits: &[f32], out: &mut dyn BatchOutput) -> Option<FinishReason> {
        self.generated += 1;
        self.first_token.get_or_insert_with(Instant::now);
        if let Some((_, context)) = &mut self.drafter {
            context.push(t);
        }
        let keep_going = out.event(BatchEvent::Token { job: self.id, step: Step { id: t, logits } });
        if self.job.opts.stop_ids.contains(&t) {
            Some(FinishReason::Stop)
        } else if !keep_going || self.generated == self.job.opts.max_new {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    /// Drafts for this step (up to `k`, within `max_new` and the context), if it drafts.
    fn draft(&mut self, k: usize) {
        self.drafts.clear();
        let room = self.seq.context_limit().saturating_sub(self.seq.ids().len() + 1);
        let want = k.min(self.job.opts.max_new.saturating_sub(self.generated)).min(room);
        if let (Some((d, context)), true, Some(_)) = (&mut self.drafter, want > 0, self.pending) {
            self.drafts = d.draft(context, want);
            self.drafts.truncate(want);
        }
    }

    /// After a verify slot: emits the drafts K3 agreed with and cuts the sequence back to them.
    /// `Ok(Ok(row))`: go on choosing from `logits` row `row`; `Ok(Err(reason))`: the job ended.
    fn settle_drafts(
        &mut self,
        model: &deltafin_core::Model,
        logits: &Mat,
        out: &mut dyn BatchOutput,
    ) -> Result<std::result::Result<usize, FinishReason>> {
        let drafts = std::mem::take(&mut self.drafts);
        // Row i predicts the token at `start + i + 1`, `start` being the pending token's place.
        let start = self.seq.ids().len() - drafts.len() - 1;
        let opts = &self.job.opts;
        let verdict = verify_with(&drafts, logits, |row, i| opts.choose(row, start + i + 1));
        if let Some((d, _)) = &mut self.drafter {
            d.accepted(drafts.len(), verdict.accepted);
        }
        (self.drafted, self.accepted, self.verifies) =
            (self.drafted + drafts.len() as u64, self.accepted + verdict.accepted as u64, self.verifies + 1);
        let mut ended = None;
        let mut kept = verdict.accepted;
        for (i, &t) in drafts[..verdict.accepted].iter().enumerate() {
            if let Some(reason) = self.emit(t, logits.row(i), out) {
                (ended, kept) = (Some(reason), i + 1);
                break;
            }
        }
        self.seq.rewind_to(model, start + 1 + kept)?;
        Ok(ended.map_or(Ok(verdict.accepted), Err))
    }

    /// The job's own stats (the steps it shared are counted in the batch's).
    fn stats(&self) -> Stats {
        let now = Instant::now();
        let first = self.first_token.unwrap_or(now);
        let decode = (now - first).as_secs_f64();
        Stats {
            prompt_tokens: self.job.prompt.len() - self.cached,
            cached_tokens: self.cached,
            generated_tokens: self.generated,
            ttft_s: (first - self.started).as_secs_f64(),
            decode_tok_s: if self.generated > 1 && decode > 0.0 { (self.generated - 1) as f64 / decode } else { 0.0 },
            total_s: (now - self.started).as_secs_f64(),
            drafted: self.drafted,
            accepted: self.accepted,
            verifies: self.verifies,
            ..Stats::default()
        }
    }
}

/// Runs jobs in lockstep over one model (see the module doc).
pub struct Batcher<'m> {
    model: &'m LoadedModel,
    max_active: usize,
    waiting: VecDeque<(JobId, BatchJob)>,
    active: Vec<Active>,
    next_id: JobId,
    stats: BatchStats,
    /// Sequences kept for reuse (with [`Batcher::keep_states`]).
    kept: Option<KeptStates>,
    /// Most drafts a job verifies per step (0: no drafting), and each job's drafter.
    draft_max: usize,
    new_drafter: DrafterFactory,
    /// Shared prompt prefixes run once, and the least length worth it (with
    /// [`Batcher::share_prefixes`]).
    prefixes: Option<(KeptStates, usize)>,
    /// Most prompt tokens per job and step while others decode.
    mixed_chunk: usize,
}

/// Makes a job's drafter when it starts.
pub type DrafterFactory = Box<dyn Fn(&BatchJob) -> Box<dyn Drafter>>;

impl<'m> Batcher<'m> {
    /// A batcher running at most `max_active` sequences at once (and never more than the model
    /// holds sequence slots for).
    pub fn new(model: &'m LoadedModel, max_active: usize) -> Batcher<'m> {
        let max_active = max_active.clamp(1, model.max_sequences());
        Batcher {
            model,
            max_active,
            waiting: VecDeque::new(),
            active: Vec::new(),
            next_id: 0,
            stats: BatchStats::default(),
            kept: None,
            draft_max: 0,
            new_drafter: Box::new(|_| Box::new(NgramDrafter::default())),
            prefixes: None,
            mixed_chunk: MIXED_PROMPT_CHUNK,
        }
    }

    /// Most prompt tokens a job runs per step while other jobs are decoding (default
    /// [`MIXED_PROMPT_CHUNK`]; `None`: the engine's prefill chunk, so a long prompt runs whole
    /// and the others wait for it). Never changes an output: chunks give a prompt's bits.
    pub fn mixed_prompt_chunk(mut self, tokens: Option<usize>) -> Batcher<'m> {
        self.mixed_chunk = tokens.unwrap_or(usize::MAX).max(1);
        self
    }

    /// Instead of [`Batcher::keep_states`] (the allowance for kept state serves one or the
    /// other): runs a prompt prefix of at least `min_tokens` that waiting jobs share once,
    /// keeping its state for every job that starts with it, so a batch whose requests share a
    /// system prompt computes it once. Each job's ids stay its solo run's.
    pub fn share_prefixes(mut self, min_tokens: usize) -> Batcher<'m> {
        self.kept = None;
        // Without room for a kept state, a prefix's state could not be kept for the others.
        let room = self.model.kept_bytes();
        self.prefixes = (room > 0).then(|| (KeptStates::new(room), min_tokens.max(1)));
        self
    }

    /// Whether `job` shares the prefix an active job is still running to keep: it then waits
    /// for that prefix's state.
    fn awaits_prefix(&self, job: &BatchJob) -> bool {
        self.prefixes.is_some()
            && !job.prompt_logits
            && self
                .active
                .iter()
                .any(|a| a.share_at.is_some_and(|p| a.fed < p && job.prompt.len() > p && job.prompt[..p] == a.job.prompt[..p]))
    }

    /// The longest prefix of `prompt` that a waiting job's prompt shares, if it is long enough
    /// to share and leaves `prompt` a token of its own.
    fn shared_prefix(&self, prompt: &[u32]) -> Option<usize> {
        let (_, min) = self.prefixes.as_ref()?;
        let longest = self
            .waiting
            .iter()
            .filter(|(_, j)| !j.prompt_logits)
            .map(|(_, j)| j.prompt.iter().zip(prompt).take_while(|(a, b)| a == b).count())
            .max()?;
        let p = longest.min(prompt.len() - 1);
        (p >= *min).then_some(p)
    }

    /// Lets every job draft up to `k` tokens per step by prompt lookup (jobs with an output
    /// grammar never draft): where text repeats, a job advances several tokens per step.
    pub fn drafting(mut self, k: usize) -> Batcher<'m> {
        self.draft_max = k;
        self
    }

    /// [`Batcher::drafting`] with the drafter the model was opened with (a draft model: one per
    /// job, each with its own cache; prompt lookup if it was opened without one).
    pub fn drafting_as_opened(self, k: usize) -> Batcher<'m> {
        match self.model.drafter_factory() {
            Some(f) => self.drafting_with(k, f),
            None => self.drafting(k),
        }
    }

    /// [`Batcher::drafting`] with drafters `new_drafter` makes for each job (the tests' oracle
    /// and random drafters).
    pub fn drafting_with(mut self, k: usize, new_drafter: DrafterFactory) -> Batcher<'m> {
        self.draft_max = k;
        self.new_drafter = new_drafter;
        self
    }

    /// Keeps finished sequences (and copies right after their prompts) within the model's
    /// allowance for kept state, and continues one when a job's prompt extends it: a chat
    /// server's conversations take turns without running their history again.
    pub fn keep_states(mut self) -> Batcher<'m> {
        // One use of the allowance at a time: conversations or shared prefixes.
        self.prefixes = None;
        self.kept = Some(KeptStates::new(self.model.kept_bytes()));
        self
    }

    /// Keeps `seq` for reuse, if states are kept.
    fn keep(&mut self, seq: Sequence) {
        if let Some(k) = &mut self.kept {
            k.keep(seq, self.model.engine().model().config());
        }
    }

    /// Sequences run at once at most.
    pub fn max_active(&self) -> usize {
        self.max_active
    }

    /// Queues a job; it starts when a sequence slot is free.
    pub fn submit(&mut self, job: BatchJob) -> JobId {
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back((id, job));
        id
    }

    /// No job waiting or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.active.is_empty()
    }

    /// Jobs running now.
    pub fn active(&self) -> usize {
        self.active.len()
    }

    /// Totals so far.
    pub fn stats(&self) -> &BatchStats {
        &self.stats
    }

    /// Checks a job before it takes a slot: an error here fails that job alone.
    fn check(&self, job: &BatchJob) -> Result<()> {
        let vocab = self.model.engine().model().config().vocab_size;
        if job.prompt.is_empty() {
            return Err(Error::Invalid("the prompt is empty".into()));
        }
        if let Some(&bad) = job.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(deltafin_core::Error::TokenOutOfRange { id: bad, vocab }.into());
        }
        let limit = self.model.context();
        if job.prompt.len() > limit {
            return Err(Error::Invalid(format!(
                "the prompt has {} tokens, more than the context limit of {limit}; shorten it or raise --context",
                job.prompt.len()
            )));
        }
        Ok(())
    }

    /// Runs every job to its end.
    pub fn run(&mut self, out: &mut dyn BatchOutput) -> BatchStats {
        while !self.is_idle() {
            self.step(out);
        }
        self.stats.clone()
    }

    /// Whether `job` is scored in one step on a transient sequence (its whole prompt's logits,
    /// nothing generated, short enough for one step's rows): it then needs no sequence slot.
    fn scores_transiently(&self, job: &BatchJob, row_cap: usize) -> bool {
        job.prompt_logits && job.opts.max_new == 0 && job.prompt.len() <= row_cap
    }

    /// Admits waiting jobs to free sequence slots, in order, failing those that cannot run, up
    /// to the first that must wait (a scoring job joins later, once the rows are planned).
    fn admit(&mut self, out: &mut dyn BatchOutput, row_cap: usize) {
        while let Some((_, job)) = self.waiting.front() {
            if let Err(e) = self.check(job) {
                let (id, _) = self.waiting.pop_front().expect("a front job");
                self.stats.jobs_failed += 1;
                out.event(BatchEvent::Failed { job: id, error: &e });
                continue;
            }
            if self.scores_transiently(job, row_cap) || self.active.len() >= self.max_active || self.awaits_prefix(job) {
                break;
            }
            let (id, job) = self.waiting.pop_front().expect("a front job");
            // Scoring wants every prompt row's logits, so it never starts from a kept state. A
            // conversation's state is taken out; a shared prefix's is copied (others want it too).
            let reused = match (&mut self.kept, &mut self.prefixes) {
                _ if job.prompt_logits => None,
                (Some(k), _) => k.take_longest(&job.prompt, job.opts.max_new),
                (None, Some((k, _))) => k.copy_longest(&job.prompt, job.opts.max_new),
                (None, None) => None,
            };
            let seq = reused.unwrap_or_else(|| self.model.new_sequence());
            let cached = seq.ids().len();
            self.stats.cached_tokens += cached as u64;
            out.event(BatchEvent::Started { job: id, cached_tokens: cached });
            let share_at = if job.prompt_logits { None } else { self.shared_prefix(&job.prompt).filter(|&p| p > cached) };
            let mut a = Active::new(id, job, seq, cached);
            a.share_at = share_at;
            if self.draft_max > 0 && a.job.opts.constraint.is_none() {
                a.drafter = Some(((self.new_drafter)(&a.job), a.job.prompt.clone()));
            }
            self.active.push(a);
        }
    }

    /// Takes the waiting scoring jobs at the front of the queue that fit in `rows` more rows and
    /// in the state the free sequence slots would hold: each gets a transient sequence holding
    /// one layer's state at a time.
    fn take_scoring(&mut self, out: &mut dyn BatchOutput, mut rows: usize, row_cap: usize) -> Vec<Active> {
        let engine_model = self.model.engine().model();
        let free = (self.max_active - self.active.len()) * Sequence::max_bytes(engine_model.config(), self.model.context());
        let (mut state, mut taken) = (0, Vec::new());
        while let Some((_, job)) = self.waiting.front() {
            if !self.scores_transiently(job, row_cap) {
                break;
            }
            let (n, bytes) = (job.prompt.len(), engine_model.layer_state_bytes(job.prompt.len()));
            if let Err(e) = self.check(job) {
                let (id, _) = self.waiting.pop_front().expect("a front job");
                self.stats.jobs_failed += 1;
                out.event(BatchEvent::Failed { job: id, error: &e });
                continue;
            }
            if n > rows || state + bytes > free {
                break;
            }
            let (id, job) = self.waiting.pop_front().expect("a front job");
            rows -= n;
            state += bytes;
            out.event(BatchEvent::Started { job: id, cached_tokens: 0 });
            taken.push(Active::new(id, job, Sequence::transient(engine_model, n), 0));
        }
        taken
    }

    /// One engine step over every active job (admitting waiting ones first). Errors end the
    /// jobs they concern, reported as [`BatchEvent::Failed`]; the batch goes on.
    ///
    /// A step runs at most the rows the model's working memory was planned for (a prompt chunk
    /// beside every other slot's decode row): decode rows first, then prompt chunks in order,
    /// then whole scoring prompts, each on a transient sequence.
    pub fn step(&mut self, out: &mut dyn BatchOutput) {
        let start = Instant::now();
        let chunk = self.model.engine().options().prefill_chunk.unwrap_or(usize::MAX).max(1);
        let rows_planned = chunk.saturating_add(self.model.max_sequences() - 1);
        let row_cap = rows_planned.min(SCORING_ROWS_MAX);
        self.admit(out, row_cap);
        // Cancelled jobs leave before the step.
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].job.opts.cancel.as_ref().is_some_and(|c| c.is_cancelled()) {
                let a = self.active.remove(i);
                self.stats.jobs_failed += 1;
                out.event(BatchEvent::Failed { job: a.id, error: &Error::Cancelled });
                // Between steps its state is whole.
                self.keep(a.seq);
            } else {
                i += 1;
            }
        }
        // What each active job runs in this step: decode rows first, then prompt chunks while
        // rows are left (a job with none left sits this step out).
        let decoding = self.active.iter().filter(|a| a.pending.is_some()).count().min(rows_planned);
        // Drafts take rows the step would give prompt chunks, up to what the working memory
        // was planned for.
        let mut spare = rows_planned - decoding;
        for a in &mut self.active {
            a.draft(self.draft_max.min(spare));
            spare -= a.drafts.len();
        }
        let mut rows_left = spare;
        // Beside decoding jobs a prompt runs in shorter chunks, so their next tokens come soon.
        let prompt_chunk = if decoding > 0 { chunk.min(self.mixed_chunk) } else { chunk };
        let plan: Vec<Option<(Vec<u32>, Phase, LogitRows)>> = self
            .active
            .iter()
            .map(|a| match a.pending {
                Some(t) if a.drafts.is_empty() => Some((vec![t], Phase::Decode, LogitRows::Last)),
                Some(t) => Some(([&[t][..], &a.drafts].concat(), Phase::Verify, LogitRows::All)),
                None => {
                    // A shared prefix ends a step of its own, so its state can be kept.
                    let stop = a.share_at.filter(|&p| p > a.fed).unwrap_or(a.job.prompt.len());
                    let end = a.fed.saturating_add(rows_left.min(prompt_chunk)).min(stop);
                    rows_left -= end - a.fed;
                    let rows = if a.job.prompt_logits { LogitRows::All } else { LogitRows::Last };
                    (end > a.fed).then(|| (a.job.prompt[a.fed..end].to_vec(), Phase::Prompt, rows))
                }
            })
            .collect();
        let mut scoring = self.take_scoring(out, rows_left.min(row_cap), row_cap);
        let in_step = plan.iter().filter(|p| p.is_some()).count() + scoring.len();
        if in_step == 0 {
            return;
        }
        let before = self.model.engine().experts().stats();
        let result = {
            let mut slots: Vec<Slot<'_>> = self
                .active
                .iter_mut()
                .zip(&plan)
                .filter_map(|(a, p)| p.as_ref().map(|(ids, phase, rows)| Slot::new(&mut a.seq, ids, *phase).logit_rows(*rows)))
                .collect();
            for a in &mut scoring {
                slots.push(Slot::new(&mut a.seq, &a.job.prompt, Phase::Prompt).logit_rows(LogitRows::All));
            }
            self.model.engine().step(&mut slots, None)
        };
        self.stats.steps += 1;
        self.stats.sequence_steps += in_step as u64;
        self.stats.expert_bytes_read += self.model.engine().experts().stats().bytes_read - before.bytes_read;
        let output = match result {
            Ok(o) => o,
            Err(e) => {
                // The step was undone for everyone in it; they fail, the others go on.
                let mut k = 0;
                self.active.retain(|a| {
                    let ran = plan[k].is_some();
                    k += 1;
                    if ran {
                        out.event(BatchEvent::Failed { job: a.id, error: &e });
                    }
                    !ran
                });
                for a in &scoring {
                    out.event(BatchEvent::Failed { job: a.id, error: &e });
                }
                self.stats.jobs_failed += in_step as u64;
                self.stats.seconds += start.elapsed().as_secs_f64();
                return;
            }
        };
        self.stats.distinct_expert_bytes += output.report.distinct_expert_bytes;
        self.stats.distinct_experts += output.report.distinct_expert_bytes / self.model.engine().experts().expert_bytes().max(1);
        let mut logits = output.logits.iter();
        let mut done = Vec::new();
        let mut failed = Vec::new();
        for (i, p) in plan.iter().enumerate() {
            let Some((ids, phase, _)) = p else { continue };
            let logits = logits.next().expect("one logits matrix per slot");
            let a = &mut self.active[i];
            let mut last = logits.row(logits.rows - 1);
            if *phase == Phase::Verify {
                let before = a.generated;
                let settled = a.settle_drafts(self.model.engine().model(), logits, out);
                self.stats.generated_tokens += (a.generated - before) as u64;
                self.stats.drafted += logits.rows as u64 - 1;
                self.stats.verifies += 1;
                match settled {
                    Ok(Ok(row)) => {
                        self.stats.accepted += row as u64;
                        last = logits.row(row);
                    }
                    Ok(Err(reason)) => {
                        self.stats.accepted += (a.generated - before) as u64;
                        done.push((i, reason));
                        continue;
                    }
                    Err(e) => {
                        failed.push((i, e));
                        continue;
                    }
                }
            }
            if *phase == Phase::Prompt {
                if a.job.prompt_logits {
                    out.event(BatchEvent::PromptLogits { job: a.id, first: a.fed, logits });
                }
                a.fed += ids.len();
                self.stats.prompt_tokens += ids.len() as u64;
                if let (Some((k, _)), true) = (&mut self.prefixes, a.share_at == Some(a.fed)) {
                    k.keep_copy(&a.seq, self.model.engine().model().config());
                    self.stats.shared_prefixes += 1;
                }
                if a.fed < a.job.prompt.len() {
                    continue;
                }
                if a.job.opts.max_new == 0 {
                    done.push((i, FinishReason::Length));
                    continue;
                }
                // The next turn of a chat extends the prompt, rarely the re-rendered reply.
                if let Some(k) = &mut self.kept {
                    k.keep_copy(&a.seq, self.model.engine().model().config());
                }
            }
            // A new token, chosen exactly as plain generation chooses it (at its position in the
            // sequence, so a seeded draw is the one the job gets alone).
            let t = match a.job.opts.next_token(last, a.seq.ids().len()) {
                Ok(t) => t,
                Err(e) => {
                    failed.push((i, e));
                    continue;
                }
            };
            self.stats.generated_tokens += 1;
            if let Some(reason) = a.emit(t, last, out) {
                done.push((i, reason));
            } else if a.seq.ids().len() + 1 > a.seq.context_limit() {
                done.push((i, FinishReason::ContextLimit));
            } else {
                a.pending = Some(t);
            }
        }
        for (a, logits) in scoring.iter().zip(logits) {
            out.event(BatchEvent::PromptLogits { job: a.id, first: 0, logits });
            self.stats.prompt_tokens += a.job.prompt.len() as u64;
        }
        // Finished and failed jobs leave, in order (indices from the end, so each stays valid).
        let mut ends: Vec<(usize, std::result::Result<FinishReason, Error>)> =
            done.into_iter().map(|(i, r)| (i, Ok(r))).chain(failed.into_iter().map(|(i, e)| (i, Err(e)))).collect();
        ends.sort_by_key(|e| e.0);
        let mut ended: Vec<_> = ends.into_iter().rev().map(|(i, r)| (self.active.remove(i), r)).collect();
        ended.reverse();
        for (a, end) in ended {
            match end {
                Ok(reason) => {
                    self.stats.jobs_finished += 1;
                    out.event(BatchEvent::Finished { job: a.id, reason, stats: Box::new(a.stats()) });
                    self.keep(a.seq);
                }
                Err(error) => {
                    self.stats.jobs_failed += 1;
                    out.event(BatchEvent::Failed { job: a.id, error: &error });
                }
            }
        }
        for mut a in scoring {
            a.fed = a.job.prompt.len();
            self.stats.jobs_finished += 1;
            out.event(BatchEvent::Finished { job: a.id, reason: FinishReason::Length, stats: Box::new(a.stats()) });
        }
        self.stats.seconds += start.elapsed().as_secs_f64();
    }
}
