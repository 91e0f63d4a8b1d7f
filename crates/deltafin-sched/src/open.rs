//! Opening a model: a builder that turns a folder and a few knobs into a ready [`LoadedModel`].
//!
//! A checkpoint folder is served from memory maps (everything in RAM, no budget). A store made by
//! `deltafin setup` keeps its spine resident and streams experts through a cache sized so that
//! spine + sequence state + working memory + expert buffers stay within `--ram-budget`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use deltafin_core::{Backend, ChatFormat, Cpu, IndexerRounding, K3Config, Model, Tokenizer, K3_PATTERN};
use deltafin_spec::Drafter;
use deltafin_store::{
    CacheMode, CachePolicy, Checkpoint, Error as StoreError, ExpertSource, MappedExperts, ReaderOptions, Store, StreamingExperts,
};

use crate::budget::{Charges, SpineSizes};
use crate::draft::{DraftWith, Drafting};
use crate::engine::{Engine, EngineOptions};
use crate::error::Result;
use crate::sequence::Sequence;

/// Default context limit (tokens) when none is given.
pub const DEFAULT_CONTEXT: usize = 4096;
/// Prompt tokens per forward pass when a RAM budget is set and no chunk size is given.
pub const DEFAULT_BUDGET_CHUNK: usize = 512;

/// Configures how a model is opened.
#[derive(Clone, Debug)]
pub struct EngineBuilder {
    path: PathBuf,
    options: EngineOptions,
    context: usize,
    ram_budget: Option<u64>,
    cache_mode: CacheMode,
    queue_depth: usize,
    pin_bytes: u64,
    policy: CachePolicy,
    split_min: u64,
    read_caps: Vec<u64>,
    backend: Option<Arc<dyn Backend>>,
    draft: Option<DraftWith>,
    max_sequences: usize,
    kept_states: usize,
    progress: ProgressSink,
    background_fill: bool,
    verified_only: bool,
    indexer: Option<IndexerRounding>,
}

/// Where long work at open reports (opaque in `Debug`).
#[derive(Clone)]
struct ProgressSink(Arc<dyn deltafin_store::Progress>);

impl std::fmt::Debug for ProgressSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Progress")
    }
}

/// Where the RAM budget goes, in bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryPlan {
    pub budget: u64,
    pub spine: u64,
    pub sequence_state: u64,
    pub working: u64,
    /// The draft model's weights and cache (0 without one).
    pub draft: u64,
    /// Sequences kept between generations for reuse ([`EngineBuilder::kept_states`]).
    pub kept: u64,
    /// The tokenizer's vocabulary.
    pub tokenizer: u64,
    pub experts: u64,
    /// Spine layers read from the store each pass (the budget cannot hold them); `spine` is
    /// then what stays resident plus two such layers' buffers.
    pub streamed_layers: usize,
}

impl EngineBuilder {
    /// Starts from a checkpoint folder or a store.
    pub fn new(path: impl AsRef<Path>) -> EngineBuilder {
        EngineBuilder {
            path: path.as_ref().to_path_buf(),
            options: EngineOptions::default(),
            context: DEFAULT_CONTEXT,
            ram_budget: None,
            cache_mode: CacheMode::Direct,
            queue_depth: 4,
            pin_bytes: 0,
            policy: CachePolicy::NextUse,
            split_min: deltafin_store::DEFAULT_SPLIT_MIN,
            read_caps: Vec::new(),
            backend: None,
            draft: None,
            max_sequences: 1,
            kept_states: 1,
            progress: ProgressSink(Arc::new(deltafin_store::NoProgress)),
            background_fill: false,
            verified_only: false,
            indexer: None,
        }
    }

    /// How a Kimi K3.1 model's sparse-attention indexer rounds its scores (default
    /// [`IndexerRounding::F32`], the definition). Asking for `Fp8` of a model without an
    /// indexer (K3) is an error at open.
    pub fn indexer(mut self, rounding: IndexerRounding) -> Self {
        self.indexer = Some(rounding);
        self
    }

    /// `cfg` with the indexer rounding asked for.
    fn model_config(&self, cfg: &K3Config) -> Result<K3Config> {
        let mut cfg = cfg.clone();
        match (&mut cfg.indexer, self.indexer) {
            (Some(ix), Some(r)) => ix.rounding = r,
            (None, Some(IndexerRounding::Fp8)) => {
                return Err(crate::Error::Invalid(
                    "--indexer fp8 applies to Kimi K3.1 (model_type kimi_k31) only: this model has no sparse-attention indexer".into(),
                ))
            }
            _ => {}
        }
        Ok(cfg)
    }
    /// With a stream store: compute only with bytes the hub's SHA-256 has covered. Opening checks
    /// every large shard not checked yet, fetching what is not cached (and repairing what was
    /// corrupted in transit), or fails saying what cannot be checked.
    pub fn verified_only(mut self, on: bool) -> Self {
        self.verified_only = on;
        self
    }
    /// With a stream store: fetch the experts it has not cached in the background while the
    /// engine runs, with spare bandwidth (demand fetches go first), until it is full or its disk
    /// budget is reached. No effect on output.
    pub fn background_fill(mut self, on: bool) -> Self {
        self.background_fill = on;
        self
    }
    /// Where long work at open reports (the first budgeted open of a checkpoint folder checks
    /// all of it).
    pub fn progress(mut self, progress: Arc<dyn deltafin_store::Progress>) -> Self {
        self.progress = ProgressSink(progress);
        self
    }
    /// Prefetch next-layer experts guessed from the current layer's output (on by default; no
    /// effect on output).
    pub fn prefetch(mut self, on: bool) -> Self {
        self.options.prefetch = on;
        self
    }
    /// Most prompt tokens per forward pass (no effect on output).
    pub fn prefill_chunk(mut self, tokens: Option<usize>) -> Self {
        self.options.prefill_chunk = tokens;
        self
    }
    /// Most tokens a sequence may hold.
    pub fn context(mut self, tokens: usize) -> Self {
        self.context = tokens;
        self
    }
    /// Bytes everything the engine holds must fit in. A checkpoint folder opened with a budget
    /// runs through its in-place store (`deltafin_store::checkpoint_store`), made on first use.
    pub fn ram_budget(mut self, bytes: Option<u64>) -> Self {
        self.ram_budget = bytes;
        self
    }
    /// Bypass the page cache for expert reads (default) or not.
    pub fn cache_mode(mut self, mode: CacheMode) -> Self {
        self.cache_mode = mode;
        self
    }
    /// Concurrent reads per drive.
    pub fn queue_depth(mut self, n: usize) -> Self {
        self.queue_depth = n.max(1);
        self
    }
    /// Expert cache eviction policy (no effect on output).
    pub fn cache_policy(mut self, policy: CachePolicy) -> Self {
        self.policy = policy;
        self
    }
    /// Split demand reads of experts at least this large over the drives holding copies
    /// (`u64::MAX` turns splitting off; no effect on output).
    pub fn split_reads_min(mut self, bytes: u64) -> Self {
        self.split_min = bytes;
        self
    }
    /// Caps each drive's read rate (bytes/s, in the store's home order; 0 = none): emulates slower
    /// drives on one fast disk where the kernel's throttle is unavailable (no effect on output).
    pub fn read_caps(mut self, caps: Vec<u64>) -> Self {
        self.read_caps = caps;
        self
    }
    /// What computes (default: the fastest CPU kernels). Every backend gives the same bits.
    pub fn backend(mut self, backend: Arc<dyn Backend>) -> Self {
        self.backend = Some(backend);
        self
    }
    /// Sequence slots: how many sequences may hold state at once (a [`crate::Batcher`]'s jobs
    /// in lockstep); the RAM budget holds each one's state at the context limit, and a step's
    /// working memory for their rows. Default 1.
    pub fn max_sequences(mut self, n: usize) -> Self {
        self.max_sequences = n.max(1);
        self
    }
    /// Room for `n` sequences' state at the context limit kept between generations, so that a
    /// prompt extending an earlier one (a chat's next turn, from any of several conversations)
    /// runs only its new tokens; short conversations take less, so more fit. 0 keeps nothing.
    /// Default 1.
    pub fn kept_states(mut self, n: usize) -> Self {
        self.kept_states = n;
        self
    }
    /// Draft tokens with `with` (speculative decoding; output unchanged). A draft model is
    /// loaded when the model opens, inside the RAM budget.
    pub fn draft(mut self, with: Option<DraftWith>) -> Self {
        self.draft = with;
        self
    }
    /// Bytes of the hottest experts (from the store's heat history) to keep pinned in RAM.
    pub fn pin_bytes(mut self, bytes: u64) -> Self {
        self.pin_bytes = bytes;
        self
    }

    /// Working memory of one forward pass over `tokens` rows (activations, residual anchors,
    /// expert outputs, logits): an upper estimate used by the budget.
    pub fn working_bytes(cfg: &K3Config, tokens: usize, context: usize) -> u64 {
        let blocks = cfg.num_layers.div_ceil(cfg.attn_res_block_size);
        let widest = [
            cfg.intermediate_size,
            cfg.moe_intermediate_size * cfg.num_shared_experts.max(1),
            3 * cfg.kda_dim(),
            cfg.mla_heads * cfg.qk_head_dim(),
            cfg.num_experts,
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        let per_row = cfg.hidden_size * (blocks + 12) + cfg.experts_per_token * cfg.latent_size + 4 * widest + cfg.vocab_size;
        // MLA scores are per (token, head) task, at most a few at a time per thread.
        let scores = 64 * context;
        (4 * (tokens * per_row + scores)) as u64 + (8 << 20)
    }

    /// The bytes of kept state the budget reserves.
    fn kept_bytes(&self, cfg: &K3Config) -> usize {
        self.kept_states * Sequence::max_bytes(cfg, self.context)
    }

    fn compute(&self) -> Arc<dyn Backend> {
        self.backend.clone().unwrap_or_else(|| Arc::new(Cpu::best()))
    }

    /// Opens the model: parses the config, checks every spine tensor, starts the expert source.
    pub fn open(mut self) -> Result<LoadedModel> {
        // `hf://OWNER/REPO` names a model in the local Hugging Face cache, read where it is.
        self.path = deltafin_store::resolve_model_dir(&self.path)?;
        if Store::is_store(&self.path) {
            return self.open_store();
        }
        if self.ram_budget.is_some() {
            // Budgeted runs read every byte checked against a checksum, which a bare folder
            // lacks: its in-place store holds them (made on first use, nothing copied).
            self.path = deltafin_store::checkpoint_store(&self.path, self.progress.0.as_ref())?;
            return self.open_store();
        }
        let ckpt = Arc::new(Checkpoint::open(&self.path)?);
        let (ranks, tok_config) = ckpt.tokenizer_texts()?;
        let tokenizer = Arc::new(Tokenizer::from_tiktoken(&ranks, tok_config.as_deref(), K3_PATTERN)?);
        let drafting = self.draft.as_ref().map(|w| Drafting::open(w, &self.path, &tokenizer, self.compute())).transpose()?;
        let cfg = self.model_config(ckpt.config())?;
        let model = Model::load_with(cfg.clone(), ckpt.as_ref(), self.compute())?;
        let kept_bytes = self.kept_bytes(&cfg);
        let experts: Arc<dyn ExpertSource> = Arc::new(MappedExperts::new(ckpt.clone())?);
        self.options.prefill_chunk = self.options.prefill_chunk.filter(|&c| c > 0);
        Ok(LoadedModel {
            engine: Engine::new(model, experts, self.options),
            tokenizer,
            context: self.context,
            max_sequences: self.max_sequences,
            kept_bytes,
            plan: None,
            store: None,
            drafting,
        })
    }

    fn open_store(mut self) -> Result<LoadedModel> {
        let mut store = Store::open(&self.path)?;
        if self.verified_only {
            store.verify_streamed(self.progress.0.as_ref())?;
        }
        let cfg = self.model_config(store.config())?;
        // The tokenizer and the draft model first: the draft's memory comes out of the budget.
        let (ranks, tok_config) = store.tokenizer_texts()?;
        let tokenizer = Arc::new(Tokenizer::from_tiktoken(&ranks, tok_config.as_deref(), K3_PATTERN)?);
        let drafting = self.draft.as_ref().map(|w| Drafting::open(w, &self.path, &tokenizer, self.compute())).transpose()?;
        let draft = drafting.as_ref().map_or(0, |d| d.memory_bytes(self.context, self.max_sequences));
        let tokenizer_bytes = tokenizer.heap_bytes() as u64;
        let spine = store.spine_bytes();
        let expert_len = cfg.expert_shape().total_bytes() as u64;
        let all_experts = (cfg.moe_layers().len() * cfg.num_experts) as u64
            * deltafin_store::AlignedBuf::charge(cfg.expert_shape().total_bytes() + deltafin_store::BUF_ALIGN);
        // Spine layers read per pass instead of held, and the embedding read by row (neither
        // unless the budget is short).
        let mut streamed = vec![false; cfg.num_layers];
        let mut embed_by_row = false;
        let embed_name = format!("{}model.embed_tokens.weight", deltafin_core::LM_PREFIX);
        let chunk = match self.ram_budget {
            None => self.options.prefill_chunk.unwrap_or(self.context),
            Some(_) => *self.options.prefill_chunk.get_or_insert(DEFAULT_BUDGET_CHUNK),
        };
        let charges = Charges::for_run(&cfg, self.context, self.max_sequences, self.kept_states, chunk, draft, tokenizer_bytes);
        let plan = match self.ram_budget {
            None => MemoryPlan {
                budget: 0,
                spine,
                sequence_state: charges.sequence_state,
                working: charges.working,
                draft,
                kept: charges.kept,
                tokenizer: tokenizer_bytes,
                experts: all_experts,
                streamed_layers: 0,
            },
            Some(budget) => {
                let layer_bytes: Vec<u64> = (0..cfg.num_layers).map(|l| store.layer_spine_bytes(l)).collect();
                let sizes = SpineSizes {
                    spine,
                    layer_bytes: &layer_bytes,
                    embed_bytes: store.spine_tensor_bytes(&embed_name),
                    vocab: cfg.vocab_size,
                    tied: cfg.tie_word_embeddings,
                };
                let (plan, fit, min) = MemoryPlan::fit(budget, &sizes, &charges);
                if budget < min {
                    return Err(StoreError::BudgetTooSmall {
                        budget,
                        minimum: min,
                        why: format!(
                            "output head, norms, the embedding's row checksums and two streamed spine layers {:.1} MB + state of {} sequence(s) of {} tokens {:.1} MB + kept states {:.1} MB + working memory {:.1} MB + draft model {:.1} MB + tokenizer {:.1} MB + one expert {:.1} MB",
                            fit.minimum as f64 / 1e6,
                            self.max_sequences,
                            self.context,
                            charges.sequence_state as f64 / 1e6,
                            charges.kept as f64 / 1e6,
                            charges.working as f64 / 1e6,
                            draft as f64 / 1e6,
                            tokenizer_bytes as f64 / 1e6,
                            expert_len as f64 / 1e6
                        ),
                    }
                    .into());
                }
                embed_by_row = fit.embed_by_row;
                streamed = fit.streamed;
                plan
            }
        };
        // The hot tier: the hottest experts from past runs, up to pin_bytes (within the budget).
        let pin_cap = self.pin_bytes.min(plan.experts.saturating_sub(StreamingExperts::min_budget(cfg.expert_shape())));
        let mut heat: Vec<((usize, u32), u64)> = store.heat().into_iter().collect();
        heat.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let per = deltafin_store::AlignedBuf::charge(cfg.expert_shape().total_bytes() + deltafin_store::BUF_ALIGN);
        let pinned: Vec<(usize, u32)> = heat.into_iter().take((pin_cap / per) as usize).map(|(k, _)| k).collect();
        let layer_prefixes: Vec<String> = (0..cfg.num_layers).filter(|&l| streamed[l]).map(Model::layer_prefix).collect();
        store.load_spine_resident(
            &|name| !(layer_prefixes.iter().any(|p| name.starts_with(p)) || embed_by_row && name == embed_name),
            self.progress.0.as_ref(),
        )?;
        let embed_rows: Option<Arc<dyn deltafin_core::EmbedRows>> = match embed_by_row {
            true => Some(Arc::new(store.spine_rows(&embed_name, cfg.vocab_size)?)),
            false => None,
        };
        let experts = store.experts(ReaderOptions {
            queue_depth: self.queue_depth,
            cache_mode: self.cache_mode,
            expert_budget: plan.experts,
            pinned,
            policy: self.policy,
            split_min: self.split_min,
            read_caps: self.read_caps.clone(),
            background_fill: self.background_fill,
        })?;
        let model = Model::load_resident(cfg, &store, self.compute(), &|l| !streamed[l], embed_rows)?;
        let store = Arc::new(store);
        let mut engine = Engine::new(model, Arc::new(experts), self.options);
        if streamed.iter().any(|s| *s) {
            engine = engine.with_spine(crate::spine::SpineStream::start(store.clone(), streamed));
        }
        Ok(LoadedModel {
            engine,
            tokenizer,
            context: self.context,
            max_sequences: self.max_sequences,
            kept_bytes: plan.kept as usize,
            plan: Some(plan),
            store: Some(store),
            drafting,
        })
    }
}

/// A model ready to generate: engine, tokenizer and the data they borrow.
pub struct LoadedModel {
    engine: Engine,
    tokenizer: Arc<Tokenizer>,
    context: usize,
    max_sequences: usize,
    kept_bytes: usize,
    plan: Option<MemoryPlan>,
    store: Option<Arc<Store>>,
    drafting: Option<Drafting>,
}

impl LoadedModel {
    /// The engine loop.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }
    /// K3's tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }
    /// The tokenizer, shared (for what outlives a borrow of the model: a compiled grammar).
    pub fn shared_tokenizer(&self) -> Arc<Tokenizer> {
        self.tokenizer.clone()
    }
    /// The chat renderer.
    pub fn chat(&self) -> Result<ChatFormat<'_>> {
        Ok(ChatFormat::new(&self.tokenizer)?)
    }
    /// The context limit of its sequences.
    pub fn context(&self) -> usize {
        self.context
    }
    /// For a Kimi K3.1 model, one line saying how its sparse attention runs (printed at start);
    /// `None` for K3.
    pub fn indexer_note(&self) -> Option<String> {
        let ix = self.engine.model().config().indexer.as_ref()?;
        let mut note = format!(
            "Kimi K3.1: each query attends to its {} highest-scoring keys once the context passes {} tokens (dense below); indexer scores in {}",
            ix.topk,
            ix.topk,
            ix.rounding.name()
        );
        if ix.checkpoint_fp8 && ix.rounding == IndexerRounding::F32 {
            note.push_str(" (the checkpoint sets indexer_use_fp8: --indexer fp8 selects as vLLM does)");
        }
        Some(note)
    }
    /// Sequences that may hold state at once ([`EngineBuilder::max_sequences`]).
    pub fn max_sequences(&self) -> usize {
        self.max_sequences
    }
    /// Bytes of state kept between generations for reuse ([`EngineBuilder::kept_states`]).
    pub fn kept_bytes(&self) -> usize {
        self.kept_bytes
    }
    /// A fresh sequence at this model's context limit.
    pub fn new_sequence(&self) -> Sequence {
        Sequence::new(self.engine.model(), self.context)
    }
    /// A fresh drafter of the kind the model was opened with ([`EngineBuilder::draft`]), for one
    /// generation or conversation; `None` without one.
    pub fn drafter(&self) -> Option<Box<dyn Drafter + Send>> {
        self.drafting.as_ref().map(|d| d.drafter(&self.tokenizer))
    }
    /// Makes a fresh drafter of the kind the model was opened with for each job of a
    /// [`crate::Batcher`] (each its own draft cache, which the budget charges per sequence slot);
    /// `None` without one.
    pub fn drafter_factory(&self) -> Option<crate::DrafterFactory> {
        let (drafting, tokenizer) = (self.drafting.clone()?, self.tokenizer.clone());
        Some(Box::new(move |_| -> Box<dyn Drafter> { drafting.drafter(&tokenizer) }))
    }
    /// What drafts, in words (`None` without drafting).
    pub fn drafter_description(&self) -> Option<String> {
        self.drafting.as_ref().map(Drafting::describe)
    }
    /// How the RAM budget is split (stores only).
    pub fn memory_plan(&self) -> Option<&MemoryPlan> {
        self.plan.as_ref()
    }
    /// Adds this session's expert demand counts to the store's heat history (for `--pin`).
    pub fn save_heat(&self) -> Result<()> {
        if let Some(store) = &self.store {
            let heat: HashMap<(usize, u32), u64> = self.engine.experts().take_heat();
            store.record_heat(&heat)?;
        }
        Ok(())
    }
}
