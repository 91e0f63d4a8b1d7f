//! The RAM budget in one place. Each part of a run states its own charge (a sequence's state:
//! [`Sequence::max_bytes`]; a step's working memory: [`EngineBuilder::working_bytes`]; one expert's
//! buffer: the store's `StreamingExperts::min_budget`; the tokenizer's vocabulary; the draft
//! model), [`Charges`] collects them for a run, and [`MemoryPlan::fit`] adds them and places the
//! spine: opening a model ([`EngineBuilder::open`]) and `deltafin plan` ([`crate::Plan`]) both
//! come here, so they state the same bytes.

use deltafin_core::K3Config;
use deltafin_store::StreamingExperts;

use crate::open::{EngineBuilder, MemoryPlan};
use crate::sequence::Sequence;
use crate::spine::SpineFit;

/// What every part but the spine and the expert cache takes from the budget, in bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Charges {
    /// The state of every sequence that may run at once, at the context limit.
    pub sequence_state: u64,
    /// A step's activations: one prompt chunk beside the other sequences' decode rows.
    pub working: u64,
    /// The draft model's weights and cache.
    pub draft: u64,
    /// Sequences kept between generations for reuse.
    pub kept: u64,
    /// The tokenizer's vocabulary.
    pub tokenizer: u64,
    /// The least an expert cache can be: one expert's buffer.
    pub one_expert: u64,
}

impl Charges {
    /// The charges of a run of `sequences` sequences at once, `kept` more kept, `context`
    /// tokens each, prompts in chunks of `chunk` tokens, a draft model of `draft` bytes and a
    /// vocabulary of `tokenizer` bytes.
    pub fn for_run(cfg: &K3Config, context: usize, sequences: usize, kept: usize, chunk: usize, draft: u64, tokenizer: u64) -> Charges {
        let one = Sequence::max_bytes(cfg, context) as u64;
        Charges {
            sequence_state: sequences as u64 * one,
            working: EngineBuilder::working_bytes(cfg, chunk + sequences.max(1) - 1, context),
            draft,
            kept: kept as u64 * one,
            tokenizer,
            one_expert: StreamingExperts::min_budget(cfg.expert_shape()),
        }
    }

    /// Everything but the spine and the experts.
    pub fn others(&self) -> u64 {
        self.sequence_state + self.working + self.draft + self.kept + self.tokenizer
    }
}

/// The spine's sizes, as a checkpoint's headers or a store's manifest give them.
#[derive(Clone, Copy, Debug)]
pub struct SpineSizes<'a> {
    /// Every language-model tensor but the routed experts.
    pub spine: u64,
    /// Each layer's spine tensors.
    pub layer_bytes: &'a [u64],
    /// The embedding table.
    pub embed_bytes: u64,
    pub vocab: usize,
    pub tied: bool,
}

impl MemoryPlan {
    /// Where `budget` goes: the spine whole if it fits beside `charges` and one expert, else
    /// the layers that fit kept and the rest read each pass; the expert cache gets what is left.
    /// Also returns the spine's placement and the least budget that works (more than `budget`
    /// when it does not: the plan is then what the minimum would leave, floored at zero).
    pub(crate) fn fit(budget: u64, spine: &SpineSizes<'_>, charges: &Charges) -> (MemoryPlan, SpineFit, u64) {
        let others = charges.others();
        let fit = SpineFit::new(
            spine.spine,
            spine.layer_bytes,
            spine.embed_bytes,
            spine.vocab,
            spine.tied,
            budget.saturating_sub(others + charges.one_expert),
        );
        let minimum = fit.minimum + others + charges.one_expert;
        let plan = MemoryPlan {
            budget,
            spine: fit.resident_bytes,
            sequence_state: charges.sequence_state,
            working: charges.working,
            draft: charges.draft,
            kept: charges.kept,
            tokenizer: charges.tokenizer,
            experts: budget.saturating_sub(fit.resident_bytes + others),
            streamed_layers: fit.streamed_layers(),
        };
        (plan, fit, minimum)
    }

    /// Experts the expert cache holds at most, each charged `per_expert` bytes.
    pub fn cached_experts(&self, per_expert: u64, total: u64) -> u64 {
        (self.experts / per_expert.max(1)).min(total)
    }
}
