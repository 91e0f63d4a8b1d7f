//! The store manifest: what a finished `deltafin setup` wrote and where every expert lives.
//!
//! `manifest.json` is written last, atomically; its presence is what makes a store complete.
//! It ties the store to one model (hash of `config.json`) and records, for every routed expert,
//! its length, checksum and each copy's home, file and offset.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Manifest format tag; bumped on incompatible changes.
pub const FORMAT: &str = "deltafin-store/1";

/// Bytes every pack file entry and spine tensor is aligned to (direct I/O needs 4096).
pub const ALIGN: u64 = 4096;

/// A spine tensor in `spine.bin`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SpineTensor {
    pub dtype: String,
    pub shape: Vec<usize>,
    pub offset: u64,
    pub len: u64,
}

/// One copy of an expert.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Copy {
    /// Index into [`Manifest::homes`].
    pub home: usize,
    /// Path relative to the home.
    pub file: String,
    pub offset: u64,
}

/// One routed expert.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExpertEntry {
    pub layer: usize,
    pub expert: usize,
    pub len: u64,
    /// xxh3-64 of the expert's bytes, hex.
    pub xxh3: String,
    pub copies: Vec<Copy>,
}

/// Everything a store holds.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub format: String,
    /// xxh3-64 of `config.json`, hex: ties the store to its model.
    pub model_hash: String,
    /// `in-place` (experts read from the checkpoint shards) or `packs` (aligned pack files).
    pub layout: String,
    /// Absolute paths of the homes (one per drive).
    pub homes: Vec<PathBuf>,
    pub spine_file: String,
    pub spine_bytes: u64,
    pub spine: std::collections::BTreeMap<String, SpineTensor>,
    /// Record offsets within an expert span, per MoE layer (layer, offsets).
    pub layouts: Vec<(usize, [usize; 6])>,
    pub experts: Vec<ExpertEntry>,
}

impl Manifest {
    /// Reads `STORE/manifest.json`, with a clear error if the folder is not a finished store.
    pub fn read(store: &Path) -> Result<Manifest> {
        let p = store.join("manifest.json");
        let text = std::fs::read_to_string(&p).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                Error::format(&p, "no manifest: not a Deltafin store, or `deltafin setup` did not finish (re-run it to resume)")
            }
            _ => Error::Io { path: p.clone(), source: e },
        })?;
        let m: Manifest = serde_json::from_str(&text).map_err(|e| Error::format(&p, format!("bad manifest: {e}")))?;
        if m.format != FORMAT {
            return Err(Error::format(&p, format!("store format {:?}, this build reads {FORMAT:?}; re-run setup", m.format)));
        }
        Ok(m)
    }

    /// Absolute path of a copy.
    pub fn copy_path(&self, c: &Copy) -> PathBuf {
        self.homes[c.home].join(&c.file)
    }
}

/// xxh3-64 of bytes as 16 hex digits.
pub fn checksum(bytes: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

/// Rounds up to [`ALIGN`].
pub fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

/// Writes `bytes` to `path` via a synced temporary file and a rename: never a half file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = tmp_path(path);
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp).map_err(Error::io(&tmp))?;
        f.write_all(bytes).map_err(Error::io(&tmp))?;
        f.sync_all().map_err(Error::io(&tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(Error::io(path))
}

/// The temporary name a file is written under before it is complete.
pub fn tmp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".partial");
    PathBuf::from(s)
}
