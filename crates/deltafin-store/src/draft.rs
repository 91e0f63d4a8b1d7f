//! A draft model's folder in the Hugging Face layout (`config.json`, safetensors, `tokenizer.json`),
//! lent to the core like a K3 checkpoint. The store only reads it; what the architecture means
//! is the drafter's business (`deltafin-spec`).
//!
//! A draft only guesses: K3 verifies every token it proposes, so a damaged draft can slow a
//! generation down but never change its output. Its headers are still checked against the files
//! (a truncated shard is an error naming the tensor), as for any checkpoint.

use std::path::{Path, PathBuf};

use deltafin_core::{TensorBytes, TensorSource};

use crate::error::{Error, Result};
use crate::safetensors::Shards;

/// An opened draft-model folder.
pub struct DraftCheckpoint {
    dir: PathBuf,
    config_text: String,
    tokenizer_json: Vec<u8>,
    shards: Shards,
}

impl DraftCheckpoint {
    /// Whether `dir` looks like a draft-model folder (has a `config.json`).
    pub fn is_draft_folder(dir: &Path) -> bool {
        dir.join("config.json").is_file()
    }

    /// Opens `dir`: its `config.json`, `tokenizer.json` and every shard header.
    pub fn open(dir: &Path) -> Result<DraftCheckpoint> {
        if !dir.is_dir() {
            return Err(Error::format(dir, "no such folder: give a draft model's folder (config.json, safetensors, tokenizer.json)"));
        }
        let cfg = dir.join("config.json");
        let config_text = std::fs::read_to_string(&cfg).map_err(Error::io(&cfg))?;
        let tok = dir.join("tokenizer.json");
        let tokenizer_json = std::fs::read(&tok).map_err(Error::io(&tok))?;
        let shards = Shards::open(dir)?;
        Ok(DraftCheckpoint { dir: dir.to_path_buf(), config_text, tokenizer_json, shards })
    }
    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The raw `config.json` text.
    pub fn config_text(&self) -> &str {
        &self.config_text
    }
    /// The bytes of `tokenizer.json`.
    pub fn tokenizer_json(&self) -> &[u8] {
        &self.tokenizer_json
    }
    /// Bytes of all its tensors (what it adds to the resident set once used).
    pub fn weight_bytes(&self) -> u64 {
        self.shards.tensor_bytes()
    }
}

impl TensorSource for DraftCheckpoint {
    fn tensor(&self, name: &str) -> deltafin_core::Result<TensorBytes> {
        self.shards.tensor(name)
    }
}
