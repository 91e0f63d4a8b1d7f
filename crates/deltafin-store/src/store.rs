//! An installed store: its manifest, its spine (read into RAM once) and its experts.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use deltafin_core::{Bytes, DType, K3Config, TensorBytes, TensorSource};

use crate::error::{Error, Result};
use crate::manifest::{checksum, Manifest};
use crate::setup::drop_cache;
use crate::streaming::{ReaderOptions, StreamingExperts};

/// File `deltafin setup` writes first, so an unfinished store is recognized as one.
pub const STORE_MARKER: &str = "deltafin-store";

/// An opened store made by `deltafin setup`.
pub struct Store {
    dir: PathBuf,
    manifest: Manifest,
    config_text: String,
    config: K3Config,
    spine: Option<Bytes>,
}

impl Store {
    /// Whether `dir` looks like a store (has a manifest) rather than a checkpoint folder.
    pub fn is_store(dir: &Path) -> bool {
        dir.join("manifest.json").exists() || dir.join(STORE_MARKER).exists()
    }

    /// Opens the store at `dir`, checking its config belongs to its manifest.
    pub fn open(dir: &Path) -> Result<Store> {
        let manifest = Manifest::read(dir)?;
        let cfg_path = dir.join("config.json");
        let config_text = std::fs::read_to_string(&cfg_path).map_err(Error::io(&cfg_path))?;
        let hash = checksum(config_text.as_bytes());
        if hash != manifest.model_hash {
            return Err(Error::WrongModel { path: dir.to_path_buf(), found: manifest.model_hash.clone(), expected: hash });
        }
        let config = K3Config::from_json(&config_text).map_err(|e| Error::format(&cfg_path, e.to_string()))?;
        Ok(Store { dir: dir.to_path_buf(), manifest, config_text, config, spine: None })
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
    /// The validated config.
    pub fn config(&self) -> &K3Config {
        &self.config
    }
    /// The raw config text.
    pub fn config_text(&self) -> &str {
        &self.config_text
    }
    /// Bytes of the spine file (all resident once loaded).
    pub fn spine_bytes(&self) -> u64 {
        self.manifest.spine_bytes
    }

    /// Reads `spine.bin` into RAM in one pass (then drops it from the page cache, so the spine
    /// is held once).
    pub fn load_spine(&mut self) -> Result<()> {
        let p = self.dir.join(&self.manifest.spine_file);
        let mut f = std::fs::File::open(&p).map_err(Error::io(&p))?;
        let len = f.metadata().map_err(Error::io(&p))?.len();
        if len != self.manifest.spine_bytes {
            return Err(Error::format(
                &p,
                format!("spine file is {len} bytes, the manifest says {}: truncated? run `deltafin doctor`", self.manifest.spine_bytes),
            ));
        }
        let mut v = Vec::with_capacity(len as usize);
        f.read_to_end(&mut v).map_err(Error::io(&p))?;
        drop_cache(&f);
        self.spine = Some(Bytes::from_vec(v));
        Ok(())
    }

    /// The texts of `tiktoken.model` and, if present, `tokenizer_config.json`.
    pub fn tokenizer_texts(&self) -> Result<(String, Option<String>)> {
        crate::checkpoint::tokenizer_texts(&self.dir)
    }

    /// Starts streaming this store's experts.
    pub fn experts(&self, opts: ReaderOptions) -> Result<StreamingExperts> {
        StreamingExperts::start(self.manifest.clone(), self.config.expert_shape(), opts)
    }

    /// Persisted expert heat (demand counts per layer and expert), if any.
    pub fn heat(&self) -> HashMap<(usize, u32), u64> {
        let p = self.dir.join("heat.json");
        let Ok(bytes) = std::fs::read(&p) else {
            return HashMap::new();
        };
        let v: Vec<(usize, u32, u64)> = serde_json::from_slice(&bytes).unwrap_or_default();
        v.into_iter().map(|(l, e, n)| ((l, e), n)).collect()
    }

    /// Adds demand counts to the persisted heat histogram (atomic rewrite).
    pub fn record_heat(&self, counts: &HashMap<(usize, u32), u64>) -> Result<()> {
        let mut all = self.heat();
        for (k, n) in counts {
            *all.entry(*k).or_default() += n;
        }
        let mut v: Vec<(usize, u32, u64)> = all.into_iter().map(|((l, e), n)| (l, e, n)).collect();
        v.sort_unstable();
        crate::manifest::write_atomic(&self.dir.join("heat.json"), &serde_json::to_vec(&v).expect("serializable"))
    }
}

impl TensorSource for Store {
    fn tensor(&self, name: &str) -> deltafin_core::Result<TensorBytes> {
        let t = self.manifest.spine.get(name).ok_or_else(|| deltafin_core::Error::MissingTensor { name: name.to_string() })?;
        let spine = self.spine.as_ref().expect("load_spine before loading the model");
        let dtype = match t.dtype.as_str() {
            "Bf16" => DType::Bf16,
            "F32" => DType::F32,
            _ => DType::U8,
        };
        Ok(TensorBytes {
            name: name.into(),
            file: self.dir.join(&self.manifest.spine_file).display().to_string(),
            dtype,
            shape: t.shape.clone(),
            bytes: spine.slice(t.offset as usize, t.len as usize),
        })
    }
}
