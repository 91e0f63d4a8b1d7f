//! A checkpoint folder in the Hugging Face release layout: `config.json`,
//! `model.safetensors.index.json` and its shards, `tiktoken.model`, `tokenizer_config.json`.
//!
//! Opening reads only the headers. Every tensor's extent is checked against its shard's length
//! up front, so a truncated shard is an error naming the tensor and the file before any math
//! runs. Spine tensors are lent to the core from read-only memory maps (nothing is copied);
//! expert spans are described by file and offset so readers can fetch them with one read each.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use deltafin_core::{Bytes, DType, ExpertLayout, K3Config, TensorBytes, TensorSource, LM_PREFIX};

use crate::error::{Error, Result};
use crate::safetensors::Shards;
pub use crate::safetensors::{read_header, TensorEntry};

/// Where one routed expert's six records sit: one contiguous span of a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertSpan {
    pub file: PathBuf,
    pub offset: u64,
    pub len: u64,
}

/// An opened checkpoint folder.
pub struct Checkpoint {
    dir: PathBuf,
    config_text: String,
    config: K3Config,
    shards: Shards,
}

impl Checkpoint {
    /// Opens `dir`, parsing the config, the index and every shard header.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let cfg_path = dir.join("config.json");
        let config_text = match std::fs::read_to_string(&cfg_path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && dir.is_dir() => {
                return Err(Error::format(
                    dir,
                    "not a model folder: it has no config.json. A model folder is a K3 checkpoint in the release layout \
                     (config.json, tiktoken.model, tokenizer_config.json and model-*.safetensors shards with their index), \
                     a store made by `deltafin setup`, or hf://OWNER/REPO for a model in the Hugging Face cache",
                ))
            }
            Err(e) => return Err(Error::Io { path: cfg_path, err: e }),
        };
        let config = K3Config::from_json(&config_text).map_err(|e| Error::format(&cfg_path, e.to_string()))?;
        let shards = Shards::open(dir)?;
        Ok(Checkpoint { dir: dir.to_path_buf(), config_text, config, shards })
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The validated config.
    pub fn config(&self) -> &K3Config {
        &self.config
    }
    /// The raw `config.json` text (hashed to tie stores to their model).
    pub fn config_text(&self) -> &str {
        &self.config_text
    }
    /// Shard files.
    pub fn shards(&self) -> &[PathBuf] {
        self.shards.paths()
    }
    /// All tensors by name.
    pub fn tensors(&self) -> &HashMap<String, TensorEntry> {
        self.shards.tensors()
    }

    /// Name of tensor `rest` of expert `e` in layer `l`.
    pub fn expert_tensor_name(l: usize, e: usize, rest: &str) -> String {
        format!("{LM_PREFIX}model.layers.{l}.block_sparse_moe.experts.{e}.{rest}")
    }

    /// The contiguous span and record layout of every routed expert of MoE layer `l`, checking
    /// dtypes, shapes and contiguity; every expert must share one layout.
    pub fn expert_spans(&self, l: usize) -> Result<(ExpertLayout, Vec<ExpertSpan>)> {
        let shape = self.config.expert_shape();
        let (s, pb, sb) = (shape, shape.packed_bytes() as u64, shape.scale_bytes() as u64);
        let records: [(&str, [usize; 2], u64); 6] = [
            ("w1.weight_packed", [s.inter, s.latent / 2], pb),
            ("w1.weight_scale", [s.inter, s.latent / s.group], sb),
            ("w2.weight_packed", [s.latent, s.inter / 2], pb),
            ("w2.weight_scale", [s.latent, s.inter / s.group], sb),
            ("w3.weight_packed", [s.inter, s.latent / 2], pb),
            ("w3.weight_scale", [s.inter, s.latent / s.group], sb),
        ];
        let mut layout: Option<ExpertLayout> = None;
        let mut spans = Vec::with_capacity(self.config.num_experts);
        for e in 0..self.config.num_experts {
            let mut found = Vec::with_capacity(6);
            for (rest, dims, len) in records {
                let name = Self::expert_tensor_name(l, e, rest);
                let t = self.tensors().get(&name).ok_or_else(|| deltafin_core::Error::MissingTensor { name: name.clone() })?;
                if t.dtype != DType::U8 || t.shape != dims || t.len != len {
                    return Err(deltafin_core::Error::BadTensor {
                        name,
                        file: self.shards()[t.shard].display().to_string(),
                        expected: format!("U8 {dims:?}"),
                        found: format!("{:?} {:?}", t.dtype, t.shape),
                    }
                    .into());
                }
                found.push(t);
            }
            let shard = found[0].shard;
            let start = found.iter().map(|t| t.offset).min().expect("six records");
            let end = found.iter().map(|t| t.offset + t.len).max().expect("six records");
            let path = &self.shards()[shard];
            if found.iter().any(|t| t.shard != shard) || end - start != shape.total_bytes() as u64 {
                return Err(Error::format(path, format!("expert {l}/{e}: its six records are not one contiguous span in one shard")));
            }
            let mut offsets = [0usize; 6];
            for (i, t) in found.iter().enumerate() {
                offsets[i] = (t.offset - start) as usize;
            }
            let this = ExpertLayout { offsets, shape };
            match layout {
                None => layout = Some(this),
                Some(ref l0) if *l0 != this => {
                    return Err(Error::format(path, format!("expert {l}/{e}: record order differs from expert 0 of the layer")));
                }
                Some(_) => {}
            }
            spans.push(ExpertSpan { file: path.clone(), offset: start, len: end - start });
        }
        let layout = layout.ok_or_else(|| Error::format(&self.dir, format!("layer {l} has no experts")))?;
        Ok((layout, spans))
    }

    /// Checks the checkpoint the way a run uses it: every spine tensor the model loads (name,
    /// dtype, shape), every routed expert's six records, and the tokenizer. Setup calls this
    /// first, so it never installs a checkpoint that `run` would refuse.
    pub fn validate(&self) -> Result<()> {
        deltafin_core::Model::load(self.config.clone(), self)?;
        for l in self.config.moe_layers() {
            self.expert_spans(l)?;
        }
        let (ranks, config) = self.tokenizer_texts()?;
        deltafin_core::Tokenizer::from_tiktoken(&ranks, config.as_deref(), deltafin_core::K3_PATTERN)?;
        Ok(())
    }

    /// Expert bytes straight from the memory map (the in-RAM path; tests and small models).
    pub fn mapped_bytes(&self, span: &ExpertSpan) -> Result<Bytes> {
        self.shards.bytes(&span.file, span.offset, span.len)
    }

    /// The texts of `tiktoken.model` and, if present, `tokenizer_config.json`.
    pub fn tokenizer_texts(&self) -> Result<(String, Option<String>)> {
        tokenizer_texts(&self.dir)
    }
}

impl TensorSource for Checkpoint {
    fn tensor(&self, name: &str) -> deltafin_core::Result<TensorBytes> {
        self.shards.tensor(name)
    }
}

/// Reads `tiktoken.model` and the optional `tokenizer_config.json` of a model folder.
pub(crate) fn tokenizer_texts(dir: &Path) -> Result<(String, Option<String>)> {
    let p = dir.join("tiktoken.model");
    let ranks = std::fs::read_to_string(&p).map_err(Error::io(&p))?;
    let c = dir.join("tokenizer_config.json");
    let config = if c.exists() { Some(std::fs::read_to_string(&c).map_err(Error::io(&c))?) } else { None };
    Ok((ranks, config))
}
