//! Safetensors shards of a Hugging Face folder (`model.safetensors.index.json` and its shards, or
//! one `model.safetensors`): headers parsed and every tensor's extent checked against its file up
//! front, tensors lent to the core from read-only memory maps (nothing copied). K3 checkpoints
//! and draft models share it.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use deltafin_core::{ByteOwner, Bytes, DType, TensorBytes};

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

/// A memory-mapped shard, lent to the core as [`Bytes`].
struct MappedFile(memmap2::Mmap);

impl ByteOwner for MappedFile {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// The shards of one folder, mapped on first use.
pub(crate) struct Shards {
    paths: Vec<PathBuf>,
    maps: Vec<OnceLock<Arc<MappedFile>>>,
    tensors: HashMap<String, TensorEntry>,
}

impl Shards {
    /// Parses the index (or the single file) and every shard header of `dir`.
    pub(crate) fn open(dir: &Path) -> Result<Shards> {
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
        let mut paths = Vec::new();
        for (i, name) in shard_names.iter().enumerate() {
            let path = dir.join(name);
            for (tname, entry) in read_header(&path, i)? {
                tensors.insert(tname, entry);
            }
            paths.push(path);
        }
        let maps = paths.iter().map(|_| OnceLock::new()).collect();
        Ok(Shards { paths, maps, tensors })
    }

    pub(crate) fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    pub(crate) fn tensors(&self) -> &HashMap<String, TensorEntry> {
        &self.tensors
    }

    fn map(&self, shard: usize) -> Result<Arc<MappedFile>> {
        if let Some(m) = self.maps[shard].get() {
            return Ok(m.clone());
        }
        let path = &self.paths[shard];
        let file = File::open(path).map_err(Error::io(path))?;
        // SAFETY: the shard is opened read-only; the store never writes to checkpoint files, and
        // a concurrent external writer would be a user error we cannot prevent with any API.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(Error::io(path))?;
        let _ = self.maps[shard].set(Arc::new(MappedFile(map)));
        Ok(self.maps[shard].get().expect("just set").clone())
    }

    /// `len` bytes at `offset` of shard file `file`, from its memory map.
    pub(crate) fn bytes(&self, file: &Path, offset: u64, len: u64) -> Result<Bytes> {
        let shard = self.paths.iter().position(|p| p == file).ok_or_else(|| Error::format(file, "not a shard of this checkpoint"))?;
        let map = self.map(shard)?;
        Ok(Bytes::new(map, offset as usize, len as usize))
    }

    /// The tensor called `name`, lent from its shard's map.
    pub(crate) fn tensor(&self, name: &str) -> deltafin_core::Result<TensorBytes> {
        let t = self.tensors.get(name).ok_or_else(|| deltafin_core::Error::MissingTensor { name: name.to_string() })?;
        let file = self.paths[t.shard].display().to_string();
        let map = self.map(t.shard).map_err(|e| deltafin_core::Error::BadTensor {
            name: name.into(),
            file: file.clone(),
            expected: "a readable shard".into(),
            found: e.to_string(),
        })?;
        let bytes = if t.len <= SMALL_TENSOR {
            // Small tensors (norms, biases, conv weights: widened to f32 at load) are read, not
            // touched through the map: a page fault there reads ahead megabytes around each one,
            // 15 s of startup for K3's ~2,400 small tensors (measured on the sparse layout).
            let mut v = vec![0u8; t.len as usize];
            let read = File::open(&self.paths[t.shard]).and_then(|f| std::os::unix::fs::FileExt::read_exact_at(&f, &mut v, t.offset));
            read.map_err(|e| deltafin_core::Error::BadTensor {
                name: name.into(),
                file: file.clone(),
                expected: "a readable shard".into(),
                found: e.to_string(),
            })?;
            Bytes::from_vec(v)
        } else {
            Bytes::new(map, t.offset as usize, t.len as usize)
        };
        Ok(TensorBytes { name: name.to_string(), file, dtype: t.dtype, shape: t.shape.clone(), bytes })
    }

    /// Bytes of all tensors (memory accounting).
    pub(crate) fn tensor_bytes(&self) -> u64 {
        self.tensors.values().map(|t| t.len).sum()
    }
}

/// Tensors up to this size are read from their shard rather than lent from its map.
const SMALL_TENSOR: u64 = 256 << 10;

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
