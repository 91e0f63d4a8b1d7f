//! Opening a model: a builder that turns a folder and a few knobs into a ready [`LoadedModel`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use deltafin_core::{ChatFormat, Model, Tokenizer, K3_PATTERN};
use deltafin_store::{Checkpoint, ExpertSource, MappedExperts};

use crate::engine::{Engine, EngineOptions};
use crate::error::Result;
use crate::sequence::Sequence;

/// Default context limit (tokens) when none is given.
pub const DEFAULT_CONTEXT: usize = 4096;

/// Configures how a model is opened.
#[derive(Clone, Debug)]
pub struct EngineBuilder {
    path: PathBuf,
    options: EngineOptions,
    context: usize,
}

impl EngineBuilder {
    /// Starts from a checkpoint folder.
    pub fn new(path: impl AsRef<Path>) -> EngineBuilder {
        EngineBuilder {
            path: path.as_ref().to_path_buf(),
            options: EngineOptions::default(),
            context: DEFAULT_CONTEXT,
        }
    }
    /// Prefetch next-layer experts guessed by the router (no effect on output).
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
    /// Opens the model: parses the config, checks every spine tensor, resolves expert spans.
    pub fn open(self) -> Result<LoadedModel> {
        let ckpt = Arc::new(Checkpoint::open(&self.path)?);
        let tokenizer = Tokenizer::from_tiktoken(
            &ckpt.tiktoken_text()?,
            ckpt.tokenizer_config_text()?.as_deref(),
            K3_PATTERN,
        )?;
        let model = Model::load(ckpt.config().clone(), ckpt.as_ref())?;
        let experts: Arc<dyn ExpertSource> = Arc::new(MappedExperts::new(ckpt.clone())?);
        Ok(LoadedModel {
            engine: Engine::new(model, experts, self.options),
            tokenizer,
            context: self.context,
            _checkpoint: ckpt,
        })
    }
}

/// A model ready to generate: engine, tokenizer and the data they borrow.
pub struct LoadedModel {
    engine: Engine,
    tokenizer: Tokenizer,
    context: usize,
    _checkpoint: Arc<Checkpoint>,
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
    /// The chat renderer.
    pub fn chat(&self) -> Result<ChatFormat<'_>> {
        Ok(ChatFormat::new(&self.tokenizer)?)
    }
    /// A fresh sequence at this model's context limit.
    pub fn new_sequence(&self) -> Sequence {
        Sequence::new(self.engine.model(), self.context)
    }
}
