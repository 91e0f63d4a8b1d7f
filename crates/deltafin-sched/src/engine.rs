//! The engine: a model, its experts, and the step, the unit of all work. Forward passes over one
//! sequence are steps (a long prompt in chunks); generation, which repeats steps, is
//! `generation.rs`.
//!
//! **The step.** One forward pass over a set of slots: a slot is one sequence, its new token ids,
//! which rows want logits, and its phase (prompt, decode, verify). The layer walk is written here
//! once: per layer, attention runs per slot (each has its own state), then the MLP runs over the
//! rows of all slots together; at an MoE layer each distinct routed expert is requested once for
//! the whole step and applied to every row routed to it as its bytes arrive. The kernels are
//! batch-invariant, so a slot's output is bit-identical whatever else shares its step.
//!
//! **Rollback without copies.** A step records, per KDA layer, only what is needed to undo it
//! (the state it started from; for verification, also each token's recurrence inputs, so it can be
//! cut back to any prefix); MLA caches are truncated. A failed or cancelled step is undone from
//! that record; no sequence's state is ever cloned, so a step's memory does not grow with the
//! context.
//!
//! **Expert-major.** At each MoE layer every new token is routed first; each distinct routed
//! expert is then requested once and applied to all the tokens routed to it, as soon as its bytes
//! arrive, while the remaining reads are still in flight. Outputs land in per-token slots summed
//! in ascending expert id ([`MoeCombine`]), so arrival order never changes a bit of the result.

use std::sync::Arc;
use std::time::{Duration, Instant};

use deltafin_core::{LayerState, Mat, MlpKind, Model, MoeCombine, Residual};
use deltafin_store::{ExpertSource, Priority};

use crate::error::{Error, Result};
use crate::sequence::Sequence;

/// How many of the last layer's expert reads are still outstanding when the next token's guess
/// is made: it runs the logits and the next token's first layers (about twice a layer guess's
/// compute), so with one read left the drive ran dry before the guess was ready (a timeline of
/// reads showed ~10 ms idle per token); two leave room for it, at the cost of one more missing
/// expert output in the guess.
pub(crate) const BOUNDARY_GUESS_LEFT: usize = 2;

/// The next token's guess is only as good as the provisional next token it starts from, and a
/// wrong one costs whole expert reads: on a 100 MB/s drive, a random-weight model whose
/// provisional token matched half the time lost 10% to it, while one that matched 71% of the
/// time gained under 1% (`slice-mini`, `slice`). So the provisional token is worked out at every
/// step (its logits are cheap next to the reads still in flight), and the next token's first
/// MoE layer is prefetched from it only while it has matched the real token at least this often
/// over the last [`AGREEMENT_WINDOW`] steps, estimated as (right + 1) / (steps + 2): off at the
/// start, on after two matches in a row; a confident model keeps it on.
pub(crate) const BOUNDARY_AGREEMENT_MIN: f64 = 0.75;
/// Steps the estimate remembers.
const AGREEMENT_WINDOW: usize = 16;

/// How often the provisional next token matched the real one, lately.
#[derive(Debug, Default)]
struct Agreement {
    tries: std::collections::VecDeque<bool>,
}

impl Agreement {
    fn estimate(&self) -> f64 {
        let right = self.tries.iter().filter(|&&r| r).count() as f64;
        (right + 1.0) / (self.tries.len() as f64 + 2.0)
    }
    fn note(&mut self, right: bool) {
        if self.tries.len() == AGREEMENT_WINDOW {
            self.tries.pop_front();
        }
        self.tries.push_back(right);
    }
}

/// Knobs of the engine loop that do not change its output.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Most prompt tokens per forward pass (memory bound); `None` = the whole prompt at once.
    pub prefill_chunk: Option<usize>,
    /// During decode, once only the last of a layer's expert reads is outstanding, guess the next
    /// layer's experts from this layer's output so far (its attention and router run on a
    /// throwaway copy of the state) and prefetch them, so the drive does not idle while the last
    /// expert, the next attention and the next router compute; in the last layer of a
    /// generation step, guess the next token's first MoE layer the same way, while the
    /// provisional next token it starts from has been matching the real one. No effect on the
    /// output.
    pub prefetch: bool,
}

impl Default for EngineOptions {
    /// Whole prompts at once, prefetch on (`cargo xtask bench decode` measures both ways).
    fn default() -> Self {
        EngineOptions { prefill_chunk: None, prefetch: true }
    }
}

/// What one forward pass did, for the stats.
#[derive(Clone, Debug, Default)]
pub struct ForwardReport {
    /// Seconds spent waiting for expert bytes.
    pub read_wait: Duration,
    /// Bytes of the distinct experts routed in this pass, summed over layers.
    pub distinct_expert_bytes: u64,
    /// The provisional next token worked out in the last layer, if one was.
    pub provisional: Option<u32>,
    /// Whether the next token's first MoE layer was prefetched from it.
    pub boundary_guessed: bool,
}

/// The model, its experts and the loop that drives them.
pub struct Engine {
    model: Model,
    experts: Arc<dyn ExpertSource>,
    options: EngineOptions,
    /// The MoE layers a step walks, in order (what each step tells the expert source).
    moe_layers: Vec<usize>,
    /// How often the next token's guess started from the right token (kept across generations:
    /// it describes how predictable the model and its text are).
    agreement: std::sync::Mutex<Agreement>,
    /// Spine layers read per pass (the budget could not hold the whole spine).
    spine: Option<crate::spine::SpineStream>,
}

impl Engine {
    /// Wraps a loaded spine and an expert source.
    pub fn new(model: Model, experts: Arc<dyn ExpertSource>, options: EngineOptions) -> Engine {
        let moe_layers = model.config().moe_layers();
        Engine { model, experts, options, moe_layers, agreement: Default::default(), spine: None }
    }

    /// With the spine layers that did not fit the budget streamed by `spine`.
    pub(crate) fn with_spine(mut self, spine: crate::spine::SpineStream) -> Engine {
        self.spine = Some(spine);
        self
    }

    /// The streamed spine layers, if any.
    pub(crate) fn spine(&self) -> Option<&crate::spine::SpineStream> {
        self.spine.as_ref()
    }

    /// The spine.
    #[doc(hidden)]
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The expert source.
    #[doc(hidden)]
    pub fn experts(&self) -> &Arc<dyn ExpertSource> {
        &self.experts
    }

    /// Cuts `seq` back to its first `len` tokens, which must lie within its latest step (a verify
    /// step, or any step of a sequence recording all: [`Sequence::set_recording`]); the state is
    /// then bit-identical to a sequence that consumed only those tokens.
    pub fn rewind(&self, seq: &mut Sequence, len: usize) -> Result<()> {
        Ok(seq.rewind_to(&self.model, len)?)
    }

    /// The options in force.
    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    /// Runs `ids` through the model after what `seq` holds, returning logits for the new rows
    /// selected by `logit_rows` (`All` or only the last).
    pub fn forward(&self, seq: &mut Sequence, ids: &[u32], logit_rows: LogitRows) -> Result<(Mat, ForwardReport)> {
        self.forward_with(seq, ids, logit_rows, None)
    }

    /// [`Engine::forward`] that stops with [`Error::Cancelled`] once `cancel` is set (checked
    /// between layers); the sequence is then left as it was before the call.
    pub fn forward_with(
        &self,
        seq: &mut Sequence,
        ids: &[u32],
        logit_rows: LogitRows,
        cancel: Option<&Cancel>,
    ) -> Result<(Mat, ForwardReport)> {
        self.forward_inner(seq, ids, logit_rows, cancel, false, &[]).map(|(m, r, _)| (m, r))
    }

    /// `guess_next`: another one-token pass will follow this one (generation), so the last layer
    /// may prefetch for it. Also returns the hidden states after each of `hidden` layers, every
    /// row.
    pub(crate) fn forward_inner(
        &self,
        seq: &mut Sequence,
        ids: &[u32],
        logit_rows: LogitRows,
        cancel: Option<&Cancel>,
        guess_next: bool,
        hidden: &[usize],
    ) -> Result<(Mat, ForwardReport, Vec<Mat>)> {
        if ids.is_empty() {
            return Err(Error::Invalid("nothing to run: the token list is empty".into()));
        }
        let chunk = self.options.prefill_chunk.unwrap_or(ids.len()).max(1);
        let mut report = ForwardReport::default();
        let mut logits: Option<Mat> = None;
        let mut states: Vec<Mat> = Vec::new();
        for (i, part) in ids.chunks(chunk).enumerate() {
            let last_part = (i + 1) * chunk >= ids.len();
            let rows = match logit_rows {
                LogitRows::All => Some(LogitRows::All),
                LogitRows::Last if last_part => Some(LogitRows::Last),
                LogitRows::Last => None,
            };
            let phase = if part.len() == 1 { Phase::Decode } else { Phase::Prompt };
            let mut slot = [Slot::new(seq, part, phase).logit_rows(rows.unwrap_or(LogitRows::Last)).hidden_states(hidden)];
            let out = self.step_inner(&mut slot, cancel, guess_next && last_part)?;
            let h = out.hidden.into_iter().next().expect("one slot");
            if states.is_empty() {
                states = h;
            } else {
                states.iter_mut().zip(&h).for_each(|(s, h)| s.append(h));
            }
            let r = out.report;
            report.read_wait += r.read_wait;
            report.distinct_expert_bytes += r.distinct_expert_bytes;
            report.provisional = r.provisional;
            report.boundary_guessed = r.boundary_guessed;
            if rows.is_some() {
                let l = out.logits.into_iter().next().expect("one slot, one logits matrix");
                match &mut logits {
                    None => logits = Some(l),
                    Some(m) => m.append(&l),
                }
            }
        }
        Ok((logits.expect("the last chunk always yields logits"), report, states))
    }

    /// The MoE layers a step walks, in order.
    pub(crate) fn moe_layers(&self) -> &[usize] {
        &self.moe_layers
    }

    /// How often the provisional next token matched the real one, lately.
    pub(crate) fn agreement_estimate(&self) -> f64 {
        self.agreement.lock().expect("poisoned").estimate()
    }

    /// Notes whether the provisional next token (the boundary guess) was the real one.
    pub(crate) fn note_agreement(&self, right: bool) {
        self.agreement.lock().expect("poisoned").note(right);
    }
}

/// Which rows of a forward pass need logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    /// Every new token (scoring, `deltafin logits`, draft verification).
    All,
    /// Only the last (generation).
    Last,
}

/// A shared flag that stops a generation, and a count of the layers it has walked (checked and
/// counted between layers, so a front end can show a long prompt's progress and stop it).
#[derive(Clone, Debug, Default)]
pub struct Cancel(Arc<std::sync::atomic::AtomicBool>, Arc<std::sync::atomic::AtomicU64>);

impl Cancel {
    /// A fresh, unset flag.
    pub fn new() -> Cancel {
        Cancel::default()
    }
    /// Sets the flag.
    pub fn cancel(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Release);
    }
    /// Whether the flag is set.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }
    /// Layers walked so far by the steps that carried this flag (each step walks every layer).
    pub fn layers_walked(&self) -> u64 {
        self.1.load(std::sync::atomic::Ordering::Relaxed)
    }
    /// Checks the flag between layers, counting the layer about to run.
    pub(crate) fn check_layer(&self) -> bool {
        self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.is_cancelled()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_tokens_guess_waits_for_matches_and_stops_at_misses() {
        let mut a = Agreement::default();
        let on = |a: &Agreement| a.estimate() >= BOUNDARY_AGREEMENT_MIN;
        assert!(!on(&a), "no evidence yet");
        a.note(true);
        assert!(!on(&a));
        a.note(true);
        assert!(on(&a), "two matches in a row");
        a.note(false);
        assert!(!on(&a), "a miss after two matches: {}", a.estimate());
        // A model right 90% of the time keeps it on; one right half the time keeps it off.
        let mut good = Agreement::default();
        let mut coin = Agreement::default();
        for i in 0..40 {
            good.note(i % 10 != 3);
            coin.note(i % 2 == 0);
        }
        assert!(on(&good), "{}", good.estimate());
        assert!(!on(&coin), "{}", coin.estimate());
        assert!(good.tries.len() == AGREEMENT_WINDOW);
    }
}
/// What a slot's rows are for. Decides what the step records to undo them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Phase {
    /// Prompt tokens (a whole prompt or a chunk of one).
    Prompt,
    /// One generated token.
    Decode,
    /// Drafted tokens to check: the step can afterwards be cut back to any prefix
    /// ([`Sequence::rewind_to`]).
    Verify,
}

/// One sequence's part of a step.
pub struct Slot<'a> {
    pub(crate) seq: &'a mut Sequence,
    pub(crate) ids: &'a [u32],
    pub(crate) logits: LogitRows,
    pub(crate) phase: Phase,
    pub(crate) hidden: &'a [usize],
}

impl<'a> Slot<'a> {
    /// `ids` to run after what `seq` holds; logits for the last row (for every row when verifying).
    pub fn new(seq: &'a mut Sequence, ids: &'a [u32], phase: Phase) -> Slot<'a> {
        let logits = if phase == Phase::Verify { LogitRows::All } else { LogitRows::Last };
        Slot { seq, ids, logits, phase, hidden: &[] }
    }
    /// Also hand back the hidden state of every new row after each of `layers` (ascending
    /// layer indices): the residual stream's running sum once the layer's MLP output has joined
    /// it, what hidden-state drafters (EAGLE-3-style heads) read.
    pub fn hidden_states(mut self, layers: &'a [usize]) -> Slot<'a> {
        self.hidden = layers;
        self
    }
    /// Which rows want logits.
    pub fn logit_rows(mut self, rows: LogitRows) -> Slot<'a> {
        self.logits = rows;
        self
    }
}

/// What a step produced.
#[derive(Debug)]
#[non_exhaustive]
pub struct StepOutput {
    /// Per slot, in order: logits `[rows, vocab]` of the rows it asked for.
    pub logits: Vec<Mat>,
    /// Per slot, in order: its hidden states `[rows, hidden]`, one per layer it asked for
    /// ([`Slot::hidden_states`]).
    pub hidden: Vec<Vec<Mat>>,
    /// Reads, waits and guesses of the step.
    pub report: ForwardReport,
}

/// The error for the first row of `logits` holding a NaN or an infinity; row 0 is the sequence's
/// position `first`.
fn non_finite(logits: &Mat, first: usize) -> Option<Error> {
    (0..logits.rows).find_map(|i| {
        let row = logits.row(i);
        if row.iter().all(|x| x.is_finite()) {
            return None;
        }
        let nan = row.iter().filter(|x| x.is_nan()).count();
        let inf = row.iter().filter(|x| x.is_infinite()).count();
        Some(Error::NonFinite { position: first + i, what: format!("{nan} NaN and {inf} infinite of {}", row.len()) })
    })
}

/// What the lone decode row of a step lends the MoE layers for prefetch guesses.
struct Guess<'s> {
    layers: &'s mut [LayerState],
    res: &'s Residual,
    /// Another one-token step follows: the last layer may guess the next token's experts.
    next_token: bool,
}

impl Engine {
    /// Runs one forward pass over `slots`: each slot's new ids after what its sequence holds.
    /// On success every sequence has advanced; on any error (a dead drive, a corrupt expert, a
    /// full context, `cancel`) every sequence is as it was before the call.
    pub fn step(&self, slots: &mut [Slot<'_>], cancel: Option<&Cancel>) -> Result<StepOutput> {
        self.step_inner(slots, cancel, false)
    }

    /// [`Engine::step`]; `guess_next`: another one-token step will follow (generation), so the
    /// last layer may prefetch for it.
    ///
    /// The pass runs on a thread of the compute pool ([`deltafin_core::on_compute_threads`]), so
    /// every parallel product inside it starts from a thread that takes its share of the work.
    /// Run from any other thread, each of a decode step's hundreds of products put the caller to
    /// sleep until done: on `slice`, about 200 voluntary context switches per token (now about
    /// 20) and a quarter of the process's kernel time; wall time measured level either way
    /// (docs/bench/kernels.md).
    pub(crate) fn step_inner(&self, slots: &mut [Slot<'_>], cancel: Option<&Cancel>, guess_next: bool) -> Result<StepOutput> {
        deltafin_core::on_compute_threads(|| self.step_here(slots, cancel, guess_next))
    }

    /// [`Engine::step_inner`] on the calling thread.
    pub(crate) fn step_here(&self, slots: &mut [Slot<'_>], cancel: Option<&Cancel>, guess_next: bool) -> Result<StepOutput> {
        if slots.is_empty() || slots.iter().any(|s| s.ids.is_empty()) {
            return Err(Error::Invalid("nothing to run: a step needs slots with at least one token each".into()));
        }
        for s in slots.iter() {
            if s.seq.transient && !s.seq.ids.is_empty() {
                return Err(Error::Invalid("a transient sequence runs one step only; it keeps no state to continue from".into()));
            }
            if s.seq.ids.len() + s.ids.len() > s.seq.context_limit {
                return Err(deltafin_core::Error::ContextLimit(format!(
                    "{} tokens held + {} new exceed the context limit of {}; start a new conversation or raise --context",
                    s.seq.ids.len(),
                    s.ids.len(),
                    s.seq.context_limit
                ))
                .into());
            }
        }
        let layers = self.model().config().num_layers;
        if let Some(bad) = slots.iter().flat_map(|s| s.hidden.iter()).find(|&&l| l >= layers) {
            return Err(Error::Invalid(format!("hidden states of layer {bad} asked for: the model has layers 0..{layers}")));
        }
        for s in slots.iter_mut() {
            s.seq.begin_pass(s.phase);
        }
        // The store is told the plan: which MoE layers this step requests, in order.
        self.experts().begin_pass(self.moe_layers());
        let mut advanced = vec![0usize; slots.len()];
        let out = self.walk(slots, &mut advanced, cancel, guess_next).and_then(|(res, report, hidden)| {
            let mut logits = Vec::with_capacity(slots.len());
            for (s, r) in slots.iter().zip(&res) {
                let n = s.ids.len();
                let (rows, first) = match s.logits {
                    LogitRows::All => (self.model().logits(r, 0..n), 0),
                    LogitRows::Last => (self.model().logits(r, n - 1..n), n - 1),
                };
                // Every token is chosen from these: a NaN would otherwise be chosen past silently.
                if let Some(e) = non_finite(&rows, s.seq.ids.len() + first) {
                    return Err(e);
                }
                logits.push(rows);
            }
            Ok(StepOutput { logits, report, hidden })
        });
        match out {
            Ok(out) => {
                for s in slots.iter_mut() {
                    s.seq.commit_pass(s.ids, s.phase);
                }
                Ok(out)
            }
            Err(e) => {
                for (s, &done) in slots.iter_mut().zip(&advanced) {
                    // A transient sequence holds no state to undo; it is thrown away.
                    if !s.seq.transient {
                        s.seq.undo_pass(self.model(), done)?;
                    }
                }
                Err(e)
            }
        }
    }

    /// The layer walk. `advanced[i]`: layers whose state slot `i` has advanced (what an undo
    /// must roll back).
    fn walk(
        &self,
        slots: &mut [Slot<'_>],
        advanced: &mut [usize],
        cancel: Option<&Cancel>,
        guess_next: bool,
    ) -> Result<(Vec<Residual>, ForwardReport, Vec<Vec<Mat>>)> {
        let model = self.model();
        let cfg = model.config();
        let mut report = ForwardReport::default();
        let mut hidden: Vec<Vec<Mat>> = slots.iter().map(|s| Vec::with_capacity(s.hidden.len())).collect();
        let mut res: Vec<Residual> = slots.iter().map(|s| model.embed(s.ids).map(Residual::new)).collect::<std::result::Result<_, _>>()?;
        // Prefetch pays only in decode (a prompt step demands most experts anyway), for a lone row.
        let lone_decode = slots.len() == 1 && slots[0].ids.len() == 1 && !slots[0].seq.transient;
        let spine = self.spine();
        let _pass = spine.map(|s| s.pass());
        for l in 0..cfg.num_layers {
            if cancel.is_some_and(Cancel::check_layer) {
                return Err(Error::Cancelled);
            }
            if let Some(s) = spine {
                s.ensure(model, l)?;
            }
            let mut x: Option<Mat> = None;
            for (i, s) in slots.iter_mut().enumerate() {
                if s.seq.transient {
                    s.seq.layers[l] = model.new_layer_state(l, s.ids.len());
                }
                let xi = model.attention_block(l, &mut s.seq.layers[l], &mut res[i])?;
                if s.seq.transient {
                    s.seq.layers[l] = model.released_layer_state();
                }
                advanced[i] = l + 1;
                match &mut x {
                    None => x = Some(xi),
                    Some(m) => m.append(&xi),
                }
            }
            let x = x.expect("at least one slot");
            let out = match cfg.mlp[l] {
                MlpKind::Dense => model.dense_mlp(l, &x),
                MlpKind::Moe => {
                    let guess = if lone_decode {
                        Some(Guess { layers: &mut slots[0].seq.layers, res: &res[0], next_token: guess_next })
                    } else {
                        None
                    };
                    let out = self.moe_layer(l, &x, guess, &mut report)?;
                    #[cfg(test)]
                    if slots.len() == 1 {
                        step_tests::MOE_HOOK.with(|h| {
                            if let Some(f) = h.borrow_mut().as_mut() {
                                f(model, l, &mut slots[0].seq.layers, &res[0], &x, &out);
                            }
                        });
                    }
                    out
                }
            };
            let mut row = 0;
            for ((s, r), h) in slots.iter().zip(res.iter_mut()).zip(hidden.iter_mut()) {
                let n = s.ids.len();
                if n == out.rows {
                    model.finish_layer(r, &out);
                } else {
                    model.finish_layer(r, &out.rows_range(row, n));
                }
                if s.hidden.contains(&l) {
                    h.push(r.partial.clone());
                }
                row += n;
            }
            if let Some(s) = spine {
                s.release(model, l);
            }
        }
        Ok((res, report, hidden))
    }

    /// An MoE layer over the rows `x` of a whole step: route every row, request each distinct
    /// expert once, apply it to all its rows as it arrives (combined in ascending expert id), and
    /// run the shared experts while the routed ones are read.
    fn moe_layer(&self, l: usize, x: &Mat, mut guess: Option<Guess<'_>>, report: &mut ForwardReport) -> Result<Mat> {
        let model = self.model();
        let cfg = model.config();
        let routes = model.route(l, x);
        let mut combine = MoeCombine::new(routes, cfg.latent_size);
        let wanted = combine.expert_rows();
        report.distinct_expert_bytes += wanted.len() as u64 * self.experts().expert_bytes();
        let expert_ids: Vec<u32> = wanted.iter().map(|(e, _)| *e).collect();
        let rx = self.experts().request(l, &expert_ids, Priority::Demand);
        // The misses are asked for first, so every product below runs while the drives read.
        let z = model.moe_latent_in(l, x);
        // The shared experts need no reads: run them while the routed ones arrive.
        let shared = model.moe_shared(l, x);
        let layout = self.experts().layout(l);
        let prefetch = self.options().prefetch && guess.is_some();
        // Guess the next layer's experts only where the next layer is an MoE layer.
        let lookahead = prefetch && l + 1 < cfg.num_layers && cfg.mlp[l + 1] == MlpKind::Moe;
        // In the last layer, with another token to come, the guess runs on: the provisional
        // output gives a provisional next token, whose first MoE layer's experts are prefetched
        // while this token's last expert, the logits and the next token's first layers compute.
        let boundary = prefetch && guess.as_ref().is_some_and(|g| g.next_token) && l + 1 == cfg.num_layers;
        for i in 0..wanted.len() {
            // The last expert is still being read: the drive would idle between its arrival and
            // the next layer's request (its compute, the next attention). Guess the next layer's
            // experts from this layer's output so far and queue them behind it (in the last
            // layer: the next token's first).
            let left = if boundary { BOUNDARY_GUESS_LEFT } else { 1 };
            if let (true, Some(g)) = (lookahead || boundary, guess.as_mut()) {
                if i + left == wanted.len() && i > 0 && rx.is_empty() {
                    let out = model.moe_finish(l, combine.partial(), shared.clone());
                    // A guess that cannot run (a full context) only means no prefetch.
                    if lookahead {
                        // No routes: the next layer is streamed and not read yet (no guess).
                        if let Ok(Some(r)) = model.guess_routes(l + 1, &mut g.layers[l + 1], g.res, &out).map(|r| r.into_iter().next()) {
                            self.experts().prefetch(l + 1, &r.experts);
                        }
                    } else {
                        let on = self.agreement_estimate() >= BOUNDARY_AGREEMENT_MIN;
                        report.provisional = model.provisional_next_token(g.res, &out);
                        if let (true, Some(t)) = (on, report.provisional) {
                            if let Ok(Some((f, routes))) = model.first_moe_routes(g.layers, t) {
                                self.experts().prefetch(f, &routes[0].experts);
                                report.boundary_guessed = true;
                            }
                        }
                    }
                }
            }
            let t0 = Instant::now();
            let (e, bytes) = rx.recv().map_err(|_| Error::Invalid(format!("expert reader for layer {l} stopped")))?;
            report.read_wait += t0.elapsed();
            let bytes = bytes?;
            let rows = &wanted.iter().find(|(id, _)| *id == e).expect("delivered an expert that was not requested").1;
            let y = model.expert(l, e, &layout, bytes.as_slice(), &z.gather(rows))?;
            combine.add(e, rows, &y);
        }
        Ok(model.moe_finish(l, combine.finish(), shared))
    }
}

#[cfg(test)]
mod step_tests {
    //! The prefetch guesses, checked inside the real layer walk: a hook sees each MoE layer's
    //! input and complete output (for a lone slot) before the output joins the residual.

    use std::cell::RefCell;
    use std::rc::Rc;

    use deltafin_core::{argmax, LayerState, Mat, Model, Residual, Route};

    use super::{Phase, Slot};
    use crate::EngineBuilder;

    type MoeHook = Box<dyn FnMut(&Model, usize, &mut [LayerState], &Residual, &Mat, &Mat)>;
    /// A guessed MoE layer and its routes.
    type Guessed = Option<(usize, Vec<Route>)>;

    thread_local! {
        pub(super) static MOE_HOOK: RefCell<Option<MoeHook>> = const { RefCell::new(None) };
    }

    fn with_hook<T>(hook: MoeHook, run: impl FnOnce() -> T) -> T {
        MOE_HOOK.with(|h| *h.borrow_mut() = Some(hook));
        let out = run();
        MOE_HOOK.with(|h| *h.borrow_mut() = None);
        out
    }

    fn fixture() -> std::path::PathBuf {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-k3-dev/checkpoint")
    }

    /// The fixture's model (no prefetch, so nothing but the hook guesses) with a short prompt run.
    fn after_a_prompt() -> (crate::LoadedModel, crate::Sequence) {
        let loaded = EngineBuilder::new(fixture()).prefetch(false).open().unwrap();
        let mut seq = loaded.new_sequence();
        loaded.engine().step(&mut [Slot::new(&mut seq, &[78, 544, 115, 815, 284], Phase::Prompt)], None).unwrap();
        (loaded, seq)
    }

    #[test]
    fn a_next_layer_guess_from_the_complete_output_is_the_true_routing_and_leaves_the_state_alone() {
        let (loaded, mut seq) = after_a_prompt();
        let pending: Rc<RefCell<(Guessed, usize)>> = Default::default();
        let p = pending.clone();
        with_hook(
            Box::new(move |m, l, layers, res, x, out| {
                let mut p = p.borrow_mut();
                if let Some((gl, routes)) = p.0.take() {
                    assert_eq!(gl, l);
                    assert_eq!(routes, m.route(l, x), "layer {l}: a guess from the complete output is the true routing");
                    p.1 += 1;
                }
                let cfg = m.config();
                if l + 1 < cfg.num_layers && cfg.mlp[l + 1] == deltafin_core::MlpKind::Moe {
                    let before = layers[l + 1].clone();
                    let guess = m.guess_routes(l + 1, &mut layers[l + 1], res, out).unwrap();
                    assert_eq!(layers[l + 1], before, "layer {}: guessing changed the state", l + 1);
                    assert_eq!(guess[0].experts.len(), cfg.experts_per_token);
                    p.0 = Some((l + 1, guess));
                }
            }),
            || loaded.engine().step_here(&mut [Slot::new(&mut seq, &[101], Phase::Decode)], None, false).unwrap(),
        );
        assert!(pending.borrow().1 > 0, "the fixture has consecutive MoE layers");
    }

    #[test]
    fn a_next_token_guess_from_the_complete_output_is_the_true_routing_and_leaves_the_state_alone() {
        let (loaded, mut seq) = after_a_prompt();
        let guess: Rc<RefCell<Guessed>> = Default::default();
        let g = guess.clone();
        let out = with_hook(
            Box::new(move |m, l, layers, res, _x, out| {
                if l + 1 == m.config().num_layers {
                    let before = layers.to_vec();
                    *g.borrow_mut() = m.guess_next_token_routes(layers, res, out).unwrap();
                    assert!(layers == before.as_slice(), "guessing changed the state");
                }
            }),
            || loaded.engine().step_here(&mut [Slot::new(&mut seq, &[101], Phase::Decode)], None, false).unwrap(),
        );
        let (first, routes) = guess.borrow_mut().take().expect("the last layer is an MoE layer");
        // The real next token: its first MoE layer routes as guessed.
        let next = argmax(out.logits[0].row(0));
        let seen = Rc::new(RefCell::new(false));
        let s = seen.clone();
        with_hook(
            Box::new(move |m, l, _layers, _res, x, _out| {
                if l == first {
                    assert_eq!(m.route(l, x), routes, "a guess from the complete output is the true routing");
                    *s.borrow_mut() = true;
                }
            }),
            || loaded.engine().step_here(&mut [Slot::new(&mut seq, &[next], Phase::Decode)], None, false).unwrap(),
        );
        assert!(*seen.borrow());
    }
}
