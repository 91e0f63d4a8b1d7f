//! Which drafter a model gets: `ngram` (prompt lookup), a draft model's folder, or `auto`.
//!
//! A draft model is loaded once, when the model opens ([`crate::EngineBuilder::draft`]), and
//! its weights and cache come out of the RAM budget; each generation gets its own drafter over
//! it ([`crate::LoadedModel::drafter`]), so sequences never share a draft cache.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use deltafin_core::{Backend, Tokenizer};
use deltafin_spec::{DraftModel, Drafter, ModelDrafter, NgramDrafter, Qwen3, Qwen3Config};
use deltafin_store::DraftCheckpoint;

use crate::error::{Error, Result};

/// The folder inside a model folder or store that `auto` looks for a draft model in.
pub const AUTO_DRAFT_DIR: &str = "draft";

/// What drafts tokens for K3 to verify.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DraftWith {
    /// Prompt lookup over the sequence so far (free).
    Ngram,
    /// A Qwen3 draft model's Hugging Face folder.
    Model(PathBuf),
    /// The draft model in the model's `draft/` folder if there is one, else prompt lookup.
    Auto,
}

impl std::str::FromStr for DraftWith {
    type Err = std::convert::Infallible;
    /// `ngram`, `auto`, or a path.
    fn from_str(s: &str) -> std::result::Result<DraftWith, Self::Err> {
        Ok(match s {
            "ngram" => DraftWith::Ngram,
            "auto" => DraftWith::Auto,
            path => DraftWith::Model(PathBuf::from(path)),
        })
    }
}

/// The drafter a model was opened with.
#[derive(Clone)]
pub(crate) enum Drafting {
    Ngram,
    Model(Arc<DraftModel>),
}

impl Drafting {
    /// Resolves `with` for the model at `model_dir`, loading a draft model if one is named.
    pub(crate) fn open(with: &DraftWith, model_dir: &Path, k3: &Tokenizer, backend: Arc<dyn Backend>) -> Result<Drafting> {
        let dir = match with {
            DraftWith::Ngram => return Ok(Drafting::Ngram),
            DraftWith::Auto => {
                let d = model_dir.join(AUTO_DRAFT_DIR);
                if !DraftCheckpoint::is_draft_folder(&d) {
                    return Ok(Drafting::Ngram);
                }
                d
            }
            DraftWith::Model(p) => p.clone(),
        };
        let bad = |e: String| Error::Invalid(format!("draft model {}: {e} (or use --draft ngram)", dir.display()));
        let ckpt = DraftCheckpoint::open(&dir).map_err(|e| bad(e.to_string()))?;
        let cfg = Qwen3Config::from_json(ckpt.config_text()).map_err(|e| bad(e.to_string()))?;
        let model = Qwen3::load(cfg, &ckpt, backend).map_err(|e| bad(e.to_string()))?;
        let draft = DraftModel::new(model, ckpt.tokenizer_json(), k3).map_err(|e| bad(e.to_string()))?;
        Ok(Drafting::Model(Arc::new(draft)))
    }

    /// Bytes it holds for `sequences` sequences drafting at once, each a context of `context`
    /// tokens: the weights once, a draft cache per sequence.
    pub(crate) fn memory_bytes(&self, context: usize, sequences: usize) -> u64 {
        match self {
            Drafting::Ngram => 0,
            Drafting::Model(m) => m.memory_bytes(context, sequences),
        }
    }

    /// A fresh drafter for one generation or conversation.
    pub(crate) fn drafter(&self, k3: &Arc<Tokenizer>) -> Box<dyn Drafter + Send> {
        match self {
            Drafting::Ngram => Box::new(NgramDrafter::default()),
            Drafting::Model(m) => Box::new(ModelDrafter::new(m.clone(), k3.clone())),
        }
    }

    /// A short description for logs and stats.
    pub(crate) fn describe(&self) -> String {
        match self {
            Drafting::Ngram => "prompt lookup (ngram)".into(),
            Drafting::Model(m) => {
                let c = m.model().config();
                format!(
                    "Qwen3 draft ({} layers, {} wide, {:.1} MB{})",
                    c.num_hidden_layers,
                    c.hidden_size,
                    m.model().weight_bytes() as f64 / 1e6,
                    if m.is_direct() { ", K3's vocabulary" } else { ", re-tokenized" }
                )
            }
        }
    }
}
