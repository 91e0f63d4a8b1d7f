//! An installed store: its manifest, its spine (read into RAM once, every tensor checked against
//! its checksum) and its experts.
//!
//! Opening checks everything that is cheap to check before any math runs: the manifest's seal,
//! the config's and tokenizer's checksums, and the manifest's structure against the config.
//! Loading the spine checks every spine tensor. Experts are checked as they are read.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use deltafin_core::{Bytes, DType, K3Config, TensorBytes, TensorSource};

use crate::error::{Error, Result};
use crate::manifest::{checksum, Manifest};
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
    /// RAM offset of each spine tensor in `spine`.
    placement: std::collections::BTreeMap<String, u64>,
}

impl Store {
    /// Whether `dir` looks like a store (has a manifest) rather than a checkpoint folder.
    pub fn is_store(dir: &Path) -> bool {
        dir.join("manifest.json").exists() || dir.join(STORE_MARKER).exists()
    }

    /// Opens the store at `dir`: unseals the manifest, checks the config against its checksum
    /// and the manifest's structure against the config.
    pub fn open(dir: &Path) -> Result<Store> {
        let manifest = Manifest::read(dir)?;
        let config_text = String::from_utf8(Store::small_file(dir, &manifest, "config.json")?)
            .map_err(|_| Error::format(dir.join("config.json"), "not UTF-8"))?;
        let cfg_path = dir.join("config.json");
        let config = K3Config::from_json(&config_text).map_err(|e| Error::format(&cfg_path, e.to_string()))?;
        manifest.validate(&config, dir)?;
        Store::check_extents(dir, &manifest)?;
        let (placement, _) = Manifest::spine_placement(&manifest.spine);
        Ok(Store { dir: dir.to_path_buf(), manifest, config_text, config, spine: None, placement })
    }

    /// Every spine tensor and at least one copy of every expert lie inside an existing file
    /// (one `stat` per file): a missing drive or a truncated file is an error before the spine is
    /// loaded, not halfway through a generation. An expert with one good copy left runs (reads
    /// fail over), so only experts with none are errors.
    fn check_extents(dir: &Path, m: &Manifest) -> Result<()> {
        let mut lens: HashMap<PathBuf, Option<u64>> = HashMap::new();
        let mut len_of = |p: PathBuf| *lens.entry(p.clone()).or_insert_with(|| std::fs::metadata(&p).ok().map(|md| md.len()));
        for (name, t) in &m.spine {
            let p = m.spine_path(dir, t.file);
            match len_of(p.clone()) {
                Some(n) if n >= t.offset + t.len => {}
                found => {
                    return Err(Error::BadStore {
                        path: p,
                        why: match found {
                            None => format!("spine file missing (spine tensor `{name}` lives there)"),
                            Some(n) => format!("{n} bytes, spine tensor `{name}` ends at {} (truncated)", t.offset + t.len),
                        },
                        advice: m.advice(dir),
                    })
                }
            }
        }
        // A stream store's experts are fetched when first needed.
        let experts = if m.layout == crate::manifest::LAYOUT_STREAM { &[][..] } else { &m.experts[..] };
        for e in experts {
            let mut why = Vec::new();
            for c in &e.copies {
                let p = m.copy_path(c);
                let end = c.offset + c.range(e.len).1;
                match len_of(p.clone()) {
                    // A whole copy is enough; a striped expert needs every stripe.
                    Some(n) if n >= end && c.stripe.is_none() => {
                        why.clear();
                        break;
                    }
                    Some(n) if n >= end => {}
                    Some(n) => why.push(format!("{} is {n} bytes, the expert ends at {end} (truncated)", p.display())),
                    None => why.push(format!("{} is missing (drive not mounted?)", p.display())),
                }
                if c.stripe.is_some() && !why.is_empty() {
                    break;
                }
            }
            if !why.is_empty() {
                return Err(Error::BadStore {
                    path: dir.to_path_buf(),
                    why: format!("expert {}/{} has no readable copy: {}", e.layer, e.expert, why.join("; ")),
                    advice: m.advice(dir),
                });
            }
        }
        Ok(())
    }

    /// Reads a small file of the store and checks it against the manifest's checksum.
    pub(crate) fn small_file(dir: &Path, manifest: &Manifest, name: &str) -> Result<Vec<u8>> {
        let p = dir.join(name);
        let bad = |why: String| Error::BadStore { path: p.clone(), why, advice: crate::manifest::repair_advice(dir) };
        let sum = manifest.files.get(name).ok_or_else(|| bad("the manifest has no checksum for it".into()))?;
        let bytes = std::fs::read(&p).map_err(|e| bad(e.to_string()))?;
        if bytes.len() as u64 != sum.bytes || checksum(&bytes) != sum.xxh3 {
            return Err(bad("its contents differ from what setup installed (checksum mismatch)".into()));
        }
        Ok(bytes)
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
    /// Bytes of the spine in RAM once loaded.
    pub fn spine_bytes(&self) -> u64 {
        self.manifest.spine_bytes
    }

    /// Reads every spine tensor into RAM (then drops the files from the page cache, so the spine
    /// is held once), checking each against its checksum.
    pub fn load_spine(&mut self) -> Result<()> {
        self.load_spine_resident(&|_| true, &crate::NoProgress)
    }

    /// [`Store::load_spine`] for the tensors `keep` names only (the others are read per pass with
    /// [`Store::read_layer_spine`]), reporting the bytes read and checked to `progress` (a full
    /// K3's spine is over 100 GB).
    pub fn load_spine_resident(&mut self, keep: &dyn Fn(&str) -> bool, progress: &dyn crate::Progress) -> Result<()> {
        let names: Vec<&str> = self.manifest.spine.keys().map(String::as_str).filter(|n| keep(n)).collect();
        let (bytes, placement) = self.read_spine_tensors(&names, progress)?;
        self.spine = Some(bytes);
        self.placement = placement;
        Ok(())
    }

    /// Bytes of spine tensor `name` (0 if there is none).
    pub fn spine_tensor_bytes(&self, name: &str) -> u64 {
        self.manifest.spine.get(name).map_or(0, |t| t.len)
    }

    /// The spine tensor `name` (a BF16 table of `rows` rows) read by row, checked whole now and
    /// each row as it is read (see [`RowReader`](crate::RowReader)).
    pub fn spine_rows(&self, name: &str, rows: usize) -> Result<crate::RowReader> {
        let m = &self.manifest;
        let t = m.spine.get(name).ok_or_else(|| Error::format(self.dir.join("manifest.json"), format!("no spine tensor `{name}`")))?;
        let row_bytes = (t.len as usize) / rows.max(1);
        crate::RowReader::open(name, m.spine_path(&self.dir, t.file), t.offset, rows, row_bytes, &t.xxh3, m.advice(&self.dir))
    }

    /// Bytes of layer `l`'s spine tensors (its routed experts aside).
    pub fn layer_spine_bytes(&self, l: usize) -> u64 {
        let prefix = deltafin_core::Model::layer_prefix(l);
        self.manifest.spine.range(prefix.clone()..).take_while(|(n, _)| n.starts_with(&prefix)).map(|(_, t)| t.len).sum()
    }

    /// Reads layer `l`'s spine tensors, each checked against its checksum, for
    /// [`deltafin_core::Model::load_layer`].
    pub fn read_layer_spine(&self, l: usize) -> Result<LayerSpine> {
        let prefix = deltafin_core::Model::layer_prefix(l);
        let names: Vec<&str> =
            self.manifest.spine.range(prefix.clone()..).map(|(n, _)| n.as_str()).take_while(|n| n.starts_with(&prefix)).collect();
        let (bytes, placement) = self.read_spine_tensors(&names, &crate::NoProgress)?;
        Ok(LayerSpine {
            store: self.dir.clone(),
            manifest_spine: names.iter().map(|n| (n.to_string(), self.manifest.spine[*n].clone())).collect(),
            files: self.manifest.spine_files.clone(),
            bytes,
            placement,
        })
    }

    /// Reads the spine tensors `names` into one buffer, checking each; returns the buffer and
    /// each tensor's offset in it.
    fn read_spine_tensors(
        &self,
        names: &[&str],
        progress: &dyn crate::Progress,
    ) -> Result<(Bytes, std::collections::BTreeMap<String, u64>)> {
        let (pages, placement) = crate::spine_read::read_spine_tensors(&self.dir, &self.manifest, names, progress)?;
        let len = deltafin_core::ByteOwner::bytes(&pages).len();
        Ok((Bytes::new(std::sync::Arc::new(pages), 0, len), placement))
    }

    /// The texts of `tiktoken.model` and, if the store has one, `tokenizer_config.json`, both
    /// checked against their checksums.
    pub fn tokenizer_texts(&self) -> Result<(String, Option<String>)> {
        let text = |name: &str| -> Result<String> {
            String::from_utf8(Store::small_file(&self.dir, &self.manifest, name)?)
                .map_err(|_| Error::format(self.dir.join(name), "not UTF-8"))
        };
        let config = if self.manifest.files.contains_key("tokenizer_config.json") { Some(text("tokenizer_config.json")?) } else { None };
        Ok((text("tiktoken.model")?, config))
    }

    /// Starts streaming this store's experts.
    pub fn experts(&self, opts: ReaderOptions) -> Result<StreamingExperts> {
        let (m, shape, advice) = (self.manifest.clone(), self.config.expert_shape(), self.manifest.advice(&self.dir));
        if self.manifest.layout == crate::manifest::LAYOUT_STREAM {
            let cache = std::sync::Arc::new(self.hub_cache()?);
            let fill = opts.background_fill.then(|| cache.fill_in_background());
            // Requests in flight to the hub (each its own connection).
            let opts = ReaderOptions { queue_depth: opts.queue_depth.max(4), ..opts };
            return StreamingExperts::start_with(m, shape, opts, advice, Box::new(crate::hub_cache::EngineCache { cache, _fill: fill }));
        }
        StreamingExperts::start(m, shape, opts, advice)
    }

    /// The hub record of a stream store (`None` for other layouts).
    pub fn hub_record(&self) -> Result<Option<crate::hub_cache::HubRecord>> {
        if self.manifest.layout != crate::manifest::LAYOUT_STREAM {
            return Ok(None);
        }
        let p = self.dir.join(crate::hub_cache::HUB_RECORD);
        crate::manifest::read_sealed(&p).map(Some).map_err(|e| Error::BadStore {
            path: p,
            why: format!("{e:?}"),
            advice: self.manifest.advice(&self.dir),
        })
    }

    /// For a stream store: checks every large shard not checked yet against the hub's SHA-256,
    /// fetching what is not local and repairing bytes corrupted in transit, so that every byte the
    /// engine then computes with is verified; refuses what cannot be checked (offline with bytes
    /// missing, a shard the hub publishes no hash for). Other stores check every byte already.
    pub fn verify_streamed(&mut self, progress: &dyn crate::Progress) -> Result<()> {
        if self.manifest.layout != crate::manifest::LAYOUT_STREAM {
            return Ok(());
        }
        let cache = self.hub_cache()?;
        let refuse = |why: String| Error::format(&self.dir, format!("--verified-only: {why}"));
        let repaired =
            cache.verify_all(progress).map_err(|e| refuse(format!("a shard could not be checked against the hub's SHA-256: {e}")))?;
        let left = cache.unverified_shards();
        if !left.is_empty() {
            return Err(refuse(format!("the hub publishes no SHA-256 for {}, so nothing can verify their bytes", left.join(", "))));
        }
        if !repaired.is_empty() {
            eprintln!("deltafin: repaired before use (corrupted in transit): {}", repaired.join(", "));
            self.manifest = Manifest::read(&self.dir)?;
        }
        Ok(())
    }

    /// The expert cache of a stream store.
    pub fn hub_cache(&self) -> Result<crate::hub_cache::HubCache> {
        let record = self.hub_record()?.ok_or_else(|| Error::format(&self.dir, "not a stream store"))?;
        crate::hub_cache::HubCache::open(&self.dir, &self.manifest, &record)
    }

    /// Persisted expert heat (demand counts per layer and expert), if any. Entries that name no
    /// expert of this store are dropped (the file is advisory and unchecked).
    pub fn heat(&self) -> HashMap<(usize, u32), u64> {
        let p = self.dir.join("heat.json");
        let Ok(bytes) = std::fs::read(&p) else {
            return HashMap::new();
        };
        let moe = self.config.moe_layers();
        let v: Vec<(usize, u32, u64)> = serde_json::from_slice(&bytes).unwrap_or_default();
        v.into_iter().filter(|&(l, e, _)| moe.contains(&l) && (e as usize) < self.config.num_experts).map(|(l, e, n)| ((l, e), n)).collect()
    }

    /// Adds demand counts to the persisted heat histogram. Written under a name of its own (runs
    /// on one store may save at once) and renamed over the old file; an error here is for the
    /// caller to report as a warning, never to fail a run with.
    pub fn record_heat(&self, counts: &HashMap<(usize, u32), u64>) -> Result<()> {
        let mut all = self.heat();
        for (k, n) in counts {
            *all.entry(*k).or_default() += n;
        }
        let mut v: Vec<(usize, u32, u64)> = all.into_iter().map(|((l, e), n)| (l, e, n)).collect();
        v.sort_unstable();
        static SAVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SAVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = self.dir.join(format!(".heat.json.{}.{n}.partial", std::process::id()));
        let dst = self.dir.join("heat.json");
        if let Err(e) = std::fs::write(&tmp, serde_json::to_vec(&v).expect("serializable")) {
            let _ = std::fs::remove_file(&tmp);
            return Err(Error::Io { path: tmp, err: e });
        }
        crate::manifest::rename_synced(&tmp, &dst).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
    }
}

impl TensorSource for Store {
    fn tensor(&self, name: &str) -> deltafin_core::Result<TensorBytes> {
        let spine = self.spine.as_ref().expect("load_spine before loading the model");
        spine_tensor(&self.dir, &self.manifest.spine, &self.manifest.spine_files, spine, &self.placement, name)
    }
}

/// One layer's spine tensors read for a pass, checked (see [`Store::read_layer_spine`]).
pub struct LayerSpine {
    store: PathBuf,
    manifest_spine: std::collections::BTreeMap<String, crate::manifest::SpineTensor>,
    files: Vec<PathBuf>,
    bytes: Bytes,
    placement: std::collections::BTreeMap<String, u64>,
}

impl LayerSpine {
    /// Bytes held.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }
    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.bytes.len() == 0
    }
}

impl TensorSource for LayerSpine {
    fn tensor(&self, name: &str) -> deltafin_core::Result<TensorBytes> {
        spine_tensor(&self.store, &self.manifest_spine, &self.files, &self.bytes, &self.placement, name)
    }
}

/// The spine tensor `name` lent from `bytes` (loaded at `placement`).
fn spine_tensor(
    dir: &Path,
    spine: &std::collections::BTreeMap<String, crate::manifest::SpineTensor>,
    files: &[PathBuf],
    bytes: &Bytes,
    placement: &std::collections::BTreeMap<String, u64>,
    name: &str,
) -> deltafin_core::Result<TensorBytes> {
    let t = spine.get(name).ok_or_else(|| deltafin_core::Error::MissingTensor { name: name.to_string() })?;
    let at = *placement.get(name).ok_or_else(|| deltafin_core::Error::MissingTensor { name: format!("{name} (not loaded)") })?;
    let dtype = match t.dtype.as_str() {
        "Bf16" => DType::Bf16,
        "F32" => DType::F32,
        _ => DType::U8,
    };
    Ok(TensorBytes {
        name: name.into(),
        file: dir.join(&files[t.file]).display().to_string(),
        dtype,
        shape: t.shape.clone(),
        bytes: bytes.slice(at as usize, t.len as usize),
    })
}
