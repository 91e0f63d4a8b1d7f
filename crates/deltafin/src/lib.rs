//! Deltafin runs the full, unmodified Kimi K3 on one machine, streaming its experts from SSDs,
//! and decides every token exactly (greedy, reproducible, weight-exact). This crate is its stable
//! API: the CLI, the server, the examples and embedders use it and nothing beneath it.
//!
//! ```no_run
//! use deltafin::{EngineBuilder, GenerateOptions};
//! let model = EngineBuilder::new("models/small").open()?;
//! let prompt = model.tokenizer().encode_ordinary("The quick brown fox");
//! let mut seq = model.new_sequence();
//! let stats = model.engine().generate(&mut seq, &prompt, &GenerateOptions::new(16), |id| {
//!     print!("{}", model.tokenizer().decode(&[id]));
//!     true
//! })?;
//! eprintln!("{}", stats.summary());
//! # Ok::<(), deltafin::Error>(())
//! ```
//!
//! What is here:
//! - Opening and generating: [`EngineBuilder`] opens a checkpoint folder or a store into a
//!   [`LoadedModel`]; a [`Generator`] generates over it, reusing the state of earlier turns, and
//!   reports through an [`Output`]; its [`Engine`] runs one forward pass over several sequences at
//!   a time ([`Engine::step`] with [`Slot`]s).
//! - Text: K3's [`Tokenizer`] and its chat format ([`ChatFormat`], [`Message`], [`Role`]).
//! - Compute: [`Compute`] opens the CPU's kernels or a CUDA GPU ([`BackendChoice`]); both give
//!   the same bits.
//! - Stores: [`setup`] installs a checkpoint over drives, [`doctor`] checks one, [`repair`] fixes one.
//!
//! Types that may gain fields or variants are `#[non_exhaustive]`; options are built with
//! methods taking plain values. Items marked `#[doc(hidden)]` below the engine (its model and
//! expert source, a sequence's raw layer states) serve tests and tools, not the stable API.
#![deny(missing_docs)]

use std::path::Path;

mod compute;

pub use compute::{BackendChoice, Compute, GpuStats};

/// Errors of model math and tokenizing (what [`ChatFormat`] and [`Tokenizer`] return).
pub use deltafin_core::Error as CoreError;
pub use deltafin_core::{
    reserved_token_name, Backend, ChatFormat, Cpu, IndexerRounding, Isa, IsaKind, Mat, Message, ReplyPart, ReplySplitter, Role,
    StreamDecoder, Tokenizer, ToolCall, ToolEvent, ToolTurn, RESERVED,
};
pub use deltafin_grammar::{Error as GrammarError, Grammars, Tool as GrammarTool};
pub use deltafin_sched::{
    argmax, fresh_seed, model_sizes, size, BatchEvent, BatchJob, BatchOutput, BatchStats, Batcher, CacheMode, CachePolicy, Cancel,
    ComputeRates, Constraint, DraftWith, Engine, EngineBuilder, Error, FinishReason, GenerateOptions, Generator, JobId, LoadedModel,
    LogitRows, MemoryPlan, ModelSizes, OnToken, Output, Phase, Plan, PlanInput, Result, Sampling, Sequence, Slot, Stats, Step, StepOutput,
    AUTO_DRAFT_DIR, DEFAULT_BUDGET_CHUNK, DEFAULT_CONTEXT, LADDER_EFFICIENCY,
};
pub use deltafin_spec::{Drafter, NgramDrafter};
pub use deltafin_store::{
    hf_hub_cache, resolve_model_dir, DoctorReport, DriveFacts, ExpertLayoutKind, HomeStats, LayoutPlan, NoProgress, Placement, PlannedHome,
    Progress, SetupOptions, StreamOptions, DEFAULT_SPLIT_MIN,
};

/// What a store holds, as [`setup`] and [`repair`] leave it.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct StoreInfo {
    /// Bytes of the spine (held in RAM when running).
    pub spine_bytes: u64,
    /// Routed experts installed.
    pub experts: usize,
    /// Bytes of one copy of every expert.
    pub expert_bytes: u64,
    /// Drives (homes) holding experts.
    pub homes: usize,
    /// `packs`, `in-place` or `stream`.
    pub layout: String,
    /// Hash over the checksum of every installed byte: the identity of the weights.
    pub content_id: String,
}

impl StoreInfo {
    fn of(m: &deltafin_store::Manifest) -> StoreInfo {
        StoreInfo {
            spine_bytes: m.spine_bytes,
            experts: m.experts.len(),
            expert_bytes: m.experts.iter().map(|e| e.len).sum(),
            homes: m.homes.len(),
            layout: m.layout.clone(),
            content_id: m.content_id.clone(),
        }
    }
}

/// Installs a checkpoint into a store (or resumes, or repairs, an earlier install of the same
/// checkpoint with the same options).
pub fn setup(opts: &SetupOptions, progress: &dyn Progress) -> Result<StoreInfo> {
    Ok(StoreInfo::of(&deltafin_store::setup(opts, progress)?))
}

/// The layout [`setup`] with `opts` would make (bytes per drive, shares of reads, the read rate
/// decode can expect, and every placement's), installing nothing.
pub fn plan_layout(opts: &SetupOptions) -> Result<LayoutPlan> {
    Ok(deltafin_store::plan_layout(opts)?)
}

/// Sets up (or resumes) a stream store: the revision pinned, config, tokenizer and spine
/// fetched now, experts fetched from the hub on first use (all of them with `opts.fill`).
pub fn setup_stream(opts: &StreamOptions, progress: &dyn Progress) -> Result<StoreInfo> {
    Ok(StoreInfo::of(&deltafin_store::setup_stream(opts, progress)?))
}

/// Fetches every expert a stream store has not cached yet (it then runs offline).
pub fn fill(store: &Path, progress: &dyn Progress) -> Result<()> {
    let s = deltafin_store::Store::open(store)?;
    Ok(s.hub_cache()?.fill(progress)?)
}

/// Checks a store: structure, files and sizes; with `verify`, every byte against its checksum.
pub fn doctor(store: &Path, verify: bool, progress: &dyn Progress) -> Result<DoctorReport> {
    Ok(deltafin_store::doctor(store, verify, progress)?)
}

/// Repairs a store by re-running its setup as recorded: everything is read back and whatever is
/// damaged is rewritten from the checkpoint.
pub fn repair(store: &Path, progress: &dyn Progress) -> Result<StoreInfo> {
    Ok(StoreInfo::of(&deltafin_store::repair(store, progress)?))
}

/// Whether `dir` is a store made by [`setup`] (finished or not) rather than a checkpoint folder.
pub fn is_store(dir: &Path) -> bool {
    deltafin_store::Store::is_store(dir)
}
