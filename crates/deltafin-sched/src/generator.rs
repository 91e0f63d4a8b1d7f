//! Generation on top of the engine step: a [`Generator`] owns the state kept between
//! generations (the prefix cache), stop conditions, `max_new` and stats, and reports through
//! one [`Output`] trait that the CLI, the server and embedders share.
//!
//! **Prefix reuse.** The generator keeps the sequence of each generation and a copy taken right
//! after its prompt (inside the generation, so the prompt still runs in one pass), for several
//! conversations within the budget's allowance for kept state ([`crate::kept`]). A new prompt
//! that extends one (a chat follow-up extends the prompt; it rarely extends the generated tokens
//! exactly, since replies are re-rendered) runs only its new tokens. The kernels are
//! batch-invariant, so the continuation is bit-identical to a cold run.

use deltafin_spec::Drafter;

use crate::error::{Error, Result};
use crate::generation::{GenerateOptions, Step};
use crate::kept::KeptStates;
use crate::open::LoadedModel;
use crate::stats::Stats;

/// Receives what a generation produces.
pub trait Output {
    /// The prompt is about to run; its first `cached_tokens` were reused from kept state.
    fn begin(&mut self, cached_tokens: usize) {
        let _ = cached_tokens;
    }
    /// One new token and the logits it was chosen from; `false` stops the generation after it.
    fn token(&mut self, step: Step<'_>) -> bool;
    /// The generation ended (not called when it fails).
    fn finish(&mut self, stats: &Stats) {
        let _ = stats;
    }
}

/// An [`Output`] made of a closure over each token.
pub struct OnToken<F>(pub F);

impl<F: FnMut(Step<'_>) -> bool> Output for OnToken<F> {
    fn token(&mut self, step: Step<'_>) -> bool {
        (self.0)(step)
    }
}

/// Greedy generation with a prefix cache over one model.
pub struct Generator<'m> {
    model: &'m LoadedModel,
    /// Sequences of past generations, and copies taken right after their prompts.
    kept: KeptStates,
    /// Guesses tokens for K3 to verify (speculative decoding), if set.
    drafter: Option<Box<dyn Drafter + 'm>>,
}

impl<'m> Generator<'m> {
    /// A generator with nothing kept, drafting with the model's drafter if it was opened with
    /// one ([`crate::EngineBuilder::draft`]).
    pub fn new(model: &'m LoadedModel) -> Generator<'m> {
        let drafter = model.drafter().map(|d| d as Box<dyn Drafter + 'm>);
        Generator { model, kept: KeptStates::new(model.kept_bytes()), drafter }
    }

    /// Drafts tokens with `drafter` for K3 to verify (`None`: plain decoding). The output is the
    /// same either way; only the number of steps changes.
    pub fn set_drafter(&mut self, drafter: Option<Box<dyn Drafter + 'm>>) {
        self.drafter = drafter;
    }

    /// Forgets every kept state.
    pub fn reset(&mut self) {
        self.kept.clear();
    }

    /// Conversations' states kept now (after-prompt copies count apart).
    pub fn kept_states(&self) -> usize {
        self.kept.len()
    }

    /// Generates greedily after `prompt` (the whole conversation so far), reusing kept state
    /// where `prompt` extends it. Ends at a stop id, after `opts.max_new` tokens, at the context
    /// limit, when `out` says so, or with [`Error::Cancelled`] once `opts.cancel` is set.
    pub fn generate(&mut self, prompt: &[u32], opts: &GenerateOptions, out: &mut dyn Output) -> Result<Stats> {
        if prompt.is_empty() {
            return Err(Error::Invalid("the prompt is empty".into()));
        }
        let mut seq = self.kept.take_longest(prompt, opts.max_new).unwrap_or_else(|| self.model.new_sequence());
        let cached = seq.ids().len();
        out.begin(cached);
        // The new part of the prompt runs in one pass; a copy of the state is kept right after
        // it, since the next prompt of a chat extends this one.
        let drafter = self.drafter.as_deref_mut();
        let kept = &mut self.kept;
        let cfg = self.model.engine().model().config();
        let result = self.model.engine().generate_keeping(
            &mut seq,
            &prompt[cached..],
            opts,
            drafter,
            |s| out.token(s),
            |s| {
                if opts.max_new > 0 {
                    kept.keep_copy(s, cfg)
                }
            },
        );
        match result {
            Ok(mut stats) => {
                stats.cached_tokens = cached;
                self.kept.keep(seq, cfg);
                out.finish(&stats);
                Ok(stats)
            }
            Err(e) => {
                // A cancelled step is undone, so the sequence is still whole and reusable.
                if matches!(e, Error::Cancelled) {
                    self.kept.keep(seq, cfg);
                }
                Err(e)
            }
        }
    }
}
