//! The Deltafin engine: the step that runs Kimi K3 over streamed experts for a set of sequences,
//! and generation on top of it. Front ends use it through the `deltafin` crate.
//!
//! Open a model with [`EngineBuilder`], make a [`Sequence`], and call [`Engine::generate`]:
//!
//! ```no_run
//! use deltafin_sched::{EngineBuilder, GenerateOptions};
//! let model = EngineBuilder::new("models/small").open()?;
//! let prompt = model.tokenizer().encode_ordinary("The quick brown fox");
//! let mut seq = model.new_sequence();
//! let opts = GenerateOptions::new(16);
//! let stats = model.engine().generate(&mut seq, &prompt, &opts, |id| {
//!     print!("{}", model.tokenizer().decode(&[id]));
//!     true
//! })?;
//! eprintln!("{}", stats.summary());
//! # Ok::<(), deltafin_sched::Error>(())
//! ```
//!
//! What this crate decides: the order of work (expert-major prefill, decode steps, prefetch
//! guesses) and the sequence state. What it never does: math (that is `deltafin-core`) or file
//! and drive access (that is `deltafin-store`). Whatever order it picks, output is identical:
//! the core's kernels are batch-invariant and expert outputs are combined in a fixed order.

mod batch;
mod budget;
mod constraint;
mod draft;
mod engine;
mod error;
mod generation;
mod generator;
mod kept;
mod open;
mod plan;
mod sample;
mod sequence;
mod spine;
mod stats;

pub use deltafin_core::argmax;
pub use deltafin_store::{peak_rss_bytes, CacheMode, CachePolicy};

pub use crate::{
    batch::{BatchEvent, BatchJob, BatchOutput, BatchStats, Batcher, DrafterFactory, FinishReason, JobId, MIXED_PROMPT_CHUNK},
    constraint::{Constraint, TokenConstraint},
    draft::{DraftWith, AUTO_DRAFT_DIR},
    engine::{Cancel, Engine, EngineOptions, ForwardReport, LogitRows, Phase, Slot, StepOutput},
    error::{Error, Result},
    generation::{GenerateOptions, Step},
    generator::{Generator, OnToken, Output},
    open::{EngineBuilder, LoadedModel, MemoryPlan, DEFAULT_BUDGET_CHUNK, DEFAULT_CONTEXT},
    plan::{model_sizes, size, ComputeRates, ModelSizes, Plan, PlanInput, LADDER_EFFICIENCY},
    sample::{fresh_seed, Sampling},
    sequence::Sequence,
    stats::Stats,
};
