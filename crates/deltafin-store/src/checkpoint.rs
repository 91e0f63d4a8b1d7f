//! A checkpoint folder in the Hugging Face release layout: `config.json`,
//! `model.safetensors.index.json` and its shards, `tiktoken.model`, `tokenizer_config.json`.
//!
//! Opening reads only the headers. Every tensor's extent is checked against its shard's length
//! up front, so a truncated shard is an error naming the tensor and the file before any math
//! runs. Spine tensors are lent to the core from read-only memory maps (nothing is copied);
//! expert spans are described by file and offset so readers can fetch them with one read each.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use deltafin_core::{ByteOwner, Bytes, DType, ExpertLayout, K3Config, TensorBytes, TensorSource, LM_PREFIX};

use crate::error::{Error, Result};

/// One tensor's place in a shard.
#[derive(Clone, Debug)]
pub struct TensorEntry {
    pub shard: usize,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Absolute byte offset in the shard file.
    pub offset: u64,
    pub len: u64,
}

/// Where one routed expert's six records sit: one contiguous span of a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertSpan {
    pub file: PathBuf,
    pub offset: u64,
    pub len: u64,
}

/// A memory-mapped shard, lent to the core as [`Bytes`].
struct MappedFile(memmap2::Mmap);

impl ByteOwner for MappedFile {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// An opened checkpoint folder.
pub struct Checkpoint {
    dir: PathBuf,
    config_text: String,
    config: K3Config,
    shards: Vec<PathBuf>,
    maps: Vec<OnceLock<Arc<MappedFile>>>,
    tensors: HashMap<String, TensorEntry>,
}

impl Checkpoint {
    /// Opens `dir`, parsing the config, the index and every shard header.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let cfg_path = dir.join("config.json");
        let config_text = std::fs::read_to_string(&cfg_path).map_err(Error::io(&cfg_path))?;
        let config = K3Config::from_json(&config_text).map_err(|e| Error::format(&cfg_path, e.to_string()))?;
        let idx_path = dir.join("model.safetensors.index.json");
        let shard_names: Vec<String> = if idx_path.exists() {
            let text = std::fs::read_to_string(&idx_path).map_err(Error::io(&idx_path))?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::format(&idx_path, e.to_string()))?;
            let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| Error::format(&idx_path, "no `weight_map` object"))?;
            let mut names: Vec<String> = map.values().filter_map(|s| s.as_str().map(str::to_string)).collect();
            names.sort();
            names.dedup();
            names
        } else if dir.join("model.safetensors").exists() {
            vec!["model.safetensors".to_string()]
        } else {
            return Err(Error::format(dir, "no model.safetensors.index.json or model.safetensors: is this a checkpoint folder?"));
        };
        let mut tensors = HashMap::new();
        let mut shards = Vec::new();
        for (i, name) in shard_names.iter().enumerate() {
            let path = dir.join(name);
            for (tname, entry) in read_header(&path, i)? {
                tensors.insert(tname, entry);
            }
            shards.push(path);
        }
        let maps = shards.iter().map(|_| OnceLock::new()).collect();
        Ok(Checkpoint { dir: dir.to_path_buf(), config_text, config, shards, maps, tensors })
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
        &self.shards
    }
    /// All tensors by name.
    pub fn tensors(&self) -> &HashMap<String, TensorEntry> {
        &self.tensors
    }

    fn map(&self, shard: usize) -> Result<Arc<MappedFile>> {
        if let Some(m) = self.maps[shard].get() {
            return Ok(m.clone());
        }
        let path = &self.shards[shard];
        let file = File::open(path).map_err(Error::io(path))?;
        // SAFETY: the shard is opened read-only; the store never writes to checkpoint files, and
        // a concurrent external writer would be a user error we cannot prevent with any API.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(Error::io(path))?;
        let _ = self.maps[shard].set(Arc::new(MappedFile(map)));
        Ok(self.maps[shard].get().expect("just set").clone())
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
                let t = self.tensors.get(&name).ok_or_else(|| deltafin_core::Error::MissingTensor { name: name.clone() })?;
                if t.dtype != DType::U8 || t.shape != dims || t.len != len {
                    return Err(deltafin_core::Error::BadTensor {
                        name,
                        file: self.shards[t.shard].display().to_string(),
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
            let path = &self.shards[shard];
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
        let shard =
            self.shards.iter().position(|p| *p == span.file).ok_or_else(|| Error::format(&span.file, "not a shard of this checkpoint"))?;
        let map = self.map(shard)?;
        Ok(Bytes::new(map, span.offset as usize, span.len as usize))
    }

    /// The texts of `tiktoken.model` and, if present, `tokenizer_config.json`.
    pub fn tokenizer_texts(&self) -> Result<(String, Option<String>)> {
        tokenizer_texts(&self.dir)
    }
}

impl TensorSource for Checkpoint {
    fn tensor(&self, name: &str) -> deltafin_core::Result<TensorBytes> {
        let t = self.tensors.get(name).ok_or_else(|| deltafin_core::Error::MissingTensor { name: name.to_string() })?;
        let file = self.shards[t.shard].display().to_string();
        let map = self.map(t.shard).map_err(|e| deltafin_core::Error::BadTensor {
            name: name.into(),
            file: file.clone(),
            expected: "a readable shard".into(),
            found: e.to_string(),
        })?;
        Ok(TensorBytes {
            name: name.to_string(),
            file,
            dtype: t.dtype,
            shape: t.shape.clone(),
            bytes: Bytes::new(map, t.offset as usize, t.len as usize),
        })
    }
}

/// Parses a safetensors header and checks every tensor fits in the file.
pub fn read_header(path: &Path, shard: usize) -> Result<BTreeMap<String, TensorEntry>> {
    let mut f = File::open(path).map_err(Error::io(path))?;
    let file_len = f.metadata().map_err(Error::io(path))?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|_| Error::format(path, "shorter than a safetensors header (truncated?)"))?;
    let hlen = u64::from_le_bytes(n);
    if hlen > 100 << 20 || 8 + hlen > file_len {
        return Err(Error::format(
            path,
            format!("safetensors header length {hlen} does not fit the file ({file_len} bytes): truncated or not safetensors"),
        ));
    }
    let mut h = vec![0u8; hlen as usize];
    f.read_exact(&mut h).map_err(Error::io(path))?;
    let v: serde_json::Value =
        serde_json::from_slice(&h).map_err(|e| Error::format(path, format!("safetensors header is not JSON: {e}")))?;
    let obj = v.as_object().ok_or_else(|| Error::format(path, "safetensors header is not an object"))?;
    let base = 8 + hlen;
    let mut out = BTreeMap::new();
    for (name, t) in obj {
        if name == "__metadata__" {
            continue;
        }
        let bad = |why: &str| Error::format(path, format!("tensor `{name}`: {why}"));
        let dtype = match t.get("dtype").and_then(|d| d.as_str()) {
            Some("BF16") => DType::Bf16,
            Some("F32") => DType::F32,
            Some("U8") => DType::U8,
            Some(other) => return Err(bad(&format!("dtype {other} is not one of BF16, F32, U8"))),
            None => return Err(bad("no dtype")),
        };
        let shape: Vec<usize> = t
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| bad("no shape"))?
            .iter()
            .map(|x| x.as_u64().unwrap_or(0) as usize)
            .collect();
        let off = t.get("data_offsets").and_then(|s| s.as_array()).ok_or_else(|| bad("no data_offsets"))?;
        let (a, b) = match (off.first().and_then(|x| x.as_u64()), off.get(1).and_then(|x| x.as_u64())) {
            (Some(a), Some(b)) if b >= a => (a, b),
            _ => return Err(bad("bad data_offsets")),
        };
        let numel: usize = shape.iter().product();
        if (numel * dtype.size()) as u64 != b - a {
            return Err(bad(&format!("{} bytes for shape {shape:?} {dtype:?}", b - a)));
        }
        if base + b > file_len {
            return Err(Error::Truncated { tensor: name.clone(), path: path.to_path_buf(), have: file_len, need: base + b });
        }
        out.insert(name.clone(), TensorEntry { shard, dtype, shape, offset: base + a, len: b - a });
    }
    Ok(out)
}

/// Reads `tiktoken.model` and the optional `tokenizer_config.json` of a model folder.
pub(crate) fn tokenizer_texts(dir: &Path) -> Result<(String, Option<String>)> {
    let p = dir.join("tiktoken.model");
    let ranks = std::fs::read_to_string(&p).map_err(Error::io(&p))?;
    let c = dir.join("tokenizer_config.json");
    let config = if c.exists() { Some(std::fs::read_to_string(&c).map_err(Error::io(&c))?) } else { None };
    Ok((ranks, config))
}
