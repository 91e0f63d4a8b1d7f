//! Generation: greedy or sampled tokens after a prompt, one engine step each, or several with
//! drafts that K3 verifies (cut back exactly to what it agrees with); stop rules, cancellation
//! and the generation's stats. The steps themselves are the engine's (`engine.rs`).

use std::time::Instant;

use deltafin_core::{argmax, Mat};
use deltafin_spec::{verify_with, CostGate, Drafter};
use deltafin_store::peak_rss_bytes;

use crate::constraint::Constraint;
use crate::engine::{Engine, ForwardReport, LogitRows};
use crate::engine::{Phase, Slot};
use crate::error::Result;
use crate::sample::Sampling;
use crate::sequence::Sequence;
use crate::stats::Stats;
use crate::Cancel;

/// Options of one generation.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct GenerateOptions {
    /// Most new tokens.
    pub max_new: usize,
    /// Ids that end generation (emitted, then stop).
    pub stop_ids: Vec<u32>,
    /// Checked between layers: once set, the generation stops with [`Error::Cancelled`] (a
    /// client that went away must free the engine at once, even mid-prompt).
    pub cancel: Option<Cancel>,
    /// Most drafted tokens verified per step when a drafter is given (0: plain decoding).
    pub draft_max: usize,
    /// Whether the live cost gate chooses each step's draft length (up to `draft_max`, 0
    /// included); off, every step drafts `draft_max` (tests of exactness, benchmarks of the
    /// gate itself).
    pub draft_gate: bool,
    /// How each token is chosen: `None` (or temperature 0) is greedy.
    pub sampling: Option<Sampling>,
    /// An output grammar the tokens must follow (structured output); no drafts with one.
    pub constraint: Option<Constraint>,
}

/// One generated token and the logits it was chosen from.
pub struct Step<'a> {
    pub id: u32,
    /// Logits over the vocabulary that produced `id` (for logprobs).
    pub logits: &'a [f32],
}

impl GenerateOptions {
    /// At most `max_new` new tokens, no stop ids, no cancel flag.
    pub fn new(max_new: usize) -> GenerateOptions {
        GenerateOptions { max_new, ..Default::default() }
    }
    /// Ids that end generation (emitted, then stop).
    pub fn stop_ids(mut self, ids: Vec<u32>) -> GenerateOptions {
        self.stop_ids = ids;
        self
    }
    /// A flag that stops the generation once set.
    pub fn cancel(mut self, cancel: Cancel) -> GenerateOptions {
        self.cancel = Some(cancel);
        self
    }
    /// Verify up to `k` drafted tokens per step when a drafter is given.
    pub fn draft_max(mut self, k: usize) -> GenerateOptions {
        self.draft_max = k;
        self
    }
    /// Let the live cost gate choose draft lengths (the default), or always draft `draft_max`.
    pub fn draft_gate(mut self, on: bool) -> GenerateOptions {
        self.draft_gate = on;
        self
    }
    /// Sample each token as `s` says (`None`: greedy).
    pub fn sampling(mut self, s: Option<Sampling>) -> GenerateOptions {
        self.sampling = s;
        self
    }
    /// Makes every token follow `c`'s grammar.
    pub fn constraint(mut self, c: Option<Constraint>) -> GenerateOptions {
        self.constraint = c;
        self
    }
    /// The token generated at `position` from `logits`: [`GenerateOptions::choose`] among the
    /// ids the output grammar allows, committed to the grammar.
    pub fn next_token(&self, logits: &[f32], position: usize) -> Result<u32> {
        match &self.constraint {
            Some(c) => c.next(logits, |l| self.choose(l, position)),
            None => Ok(self.choose(logits, position)),
        }
    }
    /// The token at `position` from `logits`, as these options choose it (no grammar: what
    /// verification compares drafts with).
    pub fn choose(&self, logits: &[f32], position: usize) -> u32 {
        match &self.sampling {
            Some(s) => s.choose(logits, position),
            None => argmax(logits),
        }
    }
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_new: 64,
            stop_ids: Vec::new(),
            cancel: None,
            draft_max: 4,
            draft_gate: true,
            sampling: None,
            constraint: None,
        }
    }
}

impl Engine {
    /// Scores the step's provisional next token (if one was worked out) against the real one.
    fn note_provisional(&self, r: &ForwardReport, next: u32, stats: &mut Stats) {
        let Some(p) = r.provisional else { return };
        let right = p == next;
        self.note_agreement(right);
        stats.boundary_guesses += u64::from(r.boundary_guessed);
        stats.provisional_tokens += 1;
        stats.provisional_tokens_right += u64::from(right);
    }

    /// Greedy generation after `prompt`: calls `on_token` with each new id; stops at a stop id,
    /// after `max_new` tokens, or when `on_token` returns `false`.
    pub fn generate(
        &self,
        seq: &mut Sequence,
        prompt: &[u32],
        opts: &GenerateOptions,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<Stats> {
        self.generate_with(seq, prompt, opts, |s| on_token(s.id))
    }

    /// [`Engine::generate`] that also hands over the logits each token was chosen from.
    pub fn generate_with(
        &self,
        seq: &mut Sequence,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_step: impl FnMut(Step<'_>) -> bool,
    ) -> Result<Stats> {
        self.generate_keeping(seq, prompt, opts, None, on_step, |_| {})
    }

    /// [`Engine::generate_with`] with drafts: each step feeds the latest token plus up to
    /// `opts.draft_max` of `drafter`'s guesses as one verify slot, keeps the longest prefix K3
    /// agrees with plus K3's own next token, and cuts the sequence back exactly. The ids, and the
    /// state left behind, are plain decoding's.
    pub fn generate_drafted(
        &self,
        seq: &mut Sequence,
        prompt: &[u32],
        opts: &GenerateOptions,
        drafter: &mut dyn Drafter,
        on_step: impl FnMut(Step<'_>) -> bool,
    ) -> Result<Stats> {
        self.generate_keeping(seq, prompt, opts, Some(drafter), on_step, |_| {})
    }

    /// [`Engine::generate_with`] that hands `after_prompt` the sequence right after the prompt
    /// ran (a generator keeps a copy there for the next turn of a conversation).
    pub(crate) fn generate_keeping<'d>(
        &self,
        seq: &mut Sequence,
        prompt: &[u32],
        opts: &GenerateOptions,
        mut drafter: Option<&mut (dyn Drafter + 'd)>,
        mut on_step: impl FnMut(Step<'_>) -> bool,
        after_prompt: impl FnOnce(&Sequence),
    ) -> Result<Stats> {
        // Drafts are guessed without the output grammar: a constrained generation runs plain.
        if opts.constraint.is_some() {
            drafter = None;
        }
        let start = Instant::now();
        let before = self.experts().stats();
        let spine_before = self.spine().map_or(0, |s| s.bytes_read());
        // A hidden-state drafter reads K3's hidden states at its layers for every kept token.
        let hidden: Vec<usize> = drafter.as_deref().map(|d| d.hidden_layers()).unwrap_or_default();
        let start_len = seq.ids.len();
        let (logits, rep, states) = self.forward_inner(seq, prompt, LogitRows::Last, opts.cancel.as_ref(), opts.max_new > 1, &hidden)?;
        if let (Some(d), false) = (drafter.as_deref_mut(), hidden.is_empty()) {
            d.observe_hidden(start_len, &states);
        }
        after_prompt(seq);
        let after_prefill = self.experts().stats();
        let ttft = start.elapsed();
        let mut stats = Stats { prompt_tokens: prompt.len(), ttft_s: ttft.as_secs_f64(), ..Default::default() };
        stats.expert_bytes_read_prefill = after_prefill.bytes_read - before.bytes_read;
        stats.expert_bytes_distinct_prefill = rep.distinct_expert_bytes;
        let mut read_wait = rep.read_wait;
        let mut last = logits.row(logits.rows - 1).to_vec();
        // What a drafter sees: every token so far, kept in step as tokens are emitted (not
        // rebuilt from the sequence at every step).
        let mut context = if drafter.is_some() { seq.ids.clone() } else { Vec::new() };
        // Each token is chosen at its position in the sequence: sampling draws depend on it alone.
        let mut next = opts.next_token(&last, seq.ids.len())?;
        // Draft lengths come from the live cost gate unless fixed by the options.
        let mut gate = (drafter.is_some() && opts.draft_gate).then(|| CostGate::new(opts.draft_max));
        let trace_gate = gate.is_some() && std::env::var_os("DELTAFIN_GATE_TRACE").is_some();
        let decode_start = Instant::now();
        let mut generated = 0;
        while generated < opts.max_new {
            generated += 1;
            if drafter.is_some() {
                context.push(next);
            }
            let keep_going = on_step(Step { id: next, logits: &last });
            if opts.stop_ids.contains(&next) || !keep_going || generated == opts.max_new {
                break;
            }
            // The context is full: end like `max_new` does, keeping what was generated (an error
            // here would throw it away).
            if seq.ids.len() + 1 > seq.context_limit {
                stats.context_limit_reached = true;
                break;
            }
            let step_start = Instant::now();
            if let Some(d) = drafter.as_deref_mut() {
                let room = seq.context_limit - seq.ids.len() - 1;
                let chosen = match gate.as_mut() {
                    Some(g) => {
                        let k = g.choose();
                        if trace_gate {
                            eprintln!("gate: {:?} -> {k}", g.view());
                        }
                        k
                    }
                    None => opts.draft_max,
                };
                let want = chosen.min(opts.max_new - generated).min(room);
                let mut drafts = if want > 0 { d.draft(&context, want) } else { Vec::new() };
                drafts.truncate(want);
                stats.draft_s += step_start.elapsed().as_secs_f64();
                if !drafts.is_empty() {
                    let mut ids = vec![next];
                    ids.extend_from_slice(&drafts);
                    let start = seq.ids.len();
                    let out =
                        self.step_inner(&mut [Slot::new(seq, &ids, Phase::Verify).hidden_states(&hidden)], opts.cancel.as_ref(), false)?;
                    read_wait += out.report.read_wait;
                    let rows = out.logits.into_iter().next().expect("one slot");
                    // Each draft is kept when it is the token plain decoding chooses at its
                    // position (greedy: the argmax; sampled: the same seeded draw).
                    // Row i predicts position start + i + 1.
                    let verdict = verify_with(&drafts, &rows, |row, i| opts.choose(row, start + i + 1));
                    stats.verifies += 1;
                    stats.drafted += drafts.len() as u64;
                    stats.accepted += verdict.accepted as u64;
                    stats.verify_union_bytes += out.report.distinct_expert_bytes;
                    d.accepted(drafts.len(), verdict.accepted);
                    if let Some(g) = gate.as_mut() {
                        g.note_verify(drafts.len(), verdict.accepted, step_start.elapsed().as_secs_f64());
                    }
                    // Emit the accepted drafts (each is K3's own choice), stopping as plain
                    // decoding would; then keep what it would hold: all emitted but the last.
                    let mut stopped_at = None;
                    for (i, &t) in drafts[..verdict.accepted].iter().enumerate() {
                        generated += 1;
                        context.push(t);
                        let keep_going = on_step(Step { id: t, logits: rows.row(i) });
                        if opts.stop_ids.contains(&t) || !keep_going || generated == opts.max_new {
                            stopped_at = Some(i);
                            break;
                        }
                    }
                    let kept = 1 + stopped_at.unwrap_or(verdict.accepted);
                    seq.rewind_to(self.model(), start + kept)?;
                    if !hidden.is_empty() {
                        let rows: Vec<Mat> = out.hidden[0].iter().map(|m| m.rows_range(0, kept)).collect();
                        d.observe_hidden(start, &rows);
                    }
                    if stopped_at.is_some() {
                        break;
                    }
                    last = rows.row(verdict.accepted).to_vec();
                    next = verdict.next;
                    continue;
                }
            }
            let at = seq.ids.len();
            let (l, r, states) =
                self.forward_inner(seq, &[next], LogitRows::Last, opts.cancel.as_ref(), generated + 1 < opts.max_new, &hidden)?;
            if let (Some(d), false) = (drafter.as_deref_mut(), hidden.is_empty()) {
                d.observe_hidden(at, &states);
            }
            read_wait += r.read_wait;
            last = l.row(0).to_vec();
            next = opts.next_token(&last, seq.ids.len())?;
            self.note_provisional(&r, next, &mut stats);
            if let Some(g) = gate.as_mut() {
                g.note_plain(step_start.elapsed().as_secs_f64());
            }
        }
        stats.draft_probes = gate.as_ref().map_or(0, CostGate::probes);
        let decode = decode_start.elapsed().as_secs_f64();
        let end = self.experts().stats();
        stats.generated_tokens = generated;
        // Decode rate counts the forwards after the first token (which prefill produced).
        stats.decode_tok_s = if generated > 1 && decode > 0.0 { (generated - 1) as f64 / decode } else { 0.0 };
        stats.total_s = start.elapsed().as_secs_f64();
        stats.read_wait_s = read_wait.as_secs_f64();
        stats.compute_s = (stats.total_s - stats.read_wait_s).max(0.0);
        stats.expert_bytes_read = end.bytes_read - before.bytes_read;
        stats.spine_bytes_read = self.spine().map_or(0, |s| s.bytes_read()) - spine_before;
        let (hits, misses) = (end.hits - before.hits, end.misses - before.misses);
        stats.cache_hit_rate = if hits + misses > 0 { hits as f64 / (hits + misses) as f64 } else { 0.0 };
        stats.bytes_per_token =
            if generated > 1 { (stats.expert_bytes_read - stats.expert_bytes_read_prefill) as f64 / (generated - 1) as f64 } else { 0.0 };
        stats.prefetch_issued = end.prefetch_issued - before.prefetch_issued;
        stats.prefetch_used = end.prefetch_used - before.prefetch_used;
        let decode_demands = (end.hits + end.misses).saturating_sub(after_prefill.hits + after_prefill.misses);
        stats.prefetch_recall =
            if decode_demands > 0 { (end.prefetch_used - after_prefill.prefetch_used) as f64 / decode_demands as f64 } else { 0.0 };
        stats.prefetch_wasted_bytes = end.prefetch_wasted_bytes - before.prefetch_wasted_bytes;
        stats.decode_read_busy_s = end.per_home.iter().zip(&after_prefill.per_home).map(|(e, p)| e.busy_s - p.busy_s).fold(0.0, f64::max);
        stats.per_drive = end.per_home;
        stats.unverified_bytes = end.unverified_bytes;
        stats.peak_rss_bytes = peak_rss_bytes();
        Ok(stats)
    }
}
