//! `deltafin setup`: install a checkpoint into a store.
//!
//! The spine goes into one aligned `spine.bin` (fast to load in one read). Experts are either
//! used in place (each is one contiguous span of a shard) or copied into aligned pack files, one
//! per MoE layer per home, spread over the homes (one home per drive) with `copies` replicas.
//!
//! **Crash safety.** Every file is written under a `.partial` name, synced and renamed; each
//! finished pack gets a sidecar listing its experts' offsets and checksums, written the same way.
//! A re-run skips every layer whose sidecars are complete and redoes the rest, so an interrupted
//! setup resumes where it stopped, and a half-written file never carries a final name. The
//! manifest is written last.
//!
//! **Sources.** Bytes come through [`SpanSource`]; a local checkpoint folder is one, and the hub
//! (stream mode) is meant to be another, fetching spans by HTTP range.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use deltafin_core::LM_PREFIX;
use serde::{Deserialize, Serialize};

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::manifest::{align_up, checksum, tmp_path, write_atomic, Copy, ExpertEntry, Manifest, SpineTensor, FORMAT};

/// Reports progress of long work (the CLI draws bars from it).
pub trait Progress: Send + Sync {
    /// A new phase of `total` bytes begins.
    fn begin(&self, phase: &str, total: u64);
    /// `bytes` more are done.
    fn advance(&self, bytes: u64);
    /// The phase is over.
    fn end(&self) {}
}

/// Progress that goes nowhere.
pub struct NoProgress;
impl Progress for NoProgress {
    fn begin(&self, _: &str, _: u64) {}
    fn advance(&self, _: u64) {}
}

/// Where expert bytes come from during setup.
pub trait SpanSource {
    /// Reads `buf.len()` bytes of `file` (relative to the source) at `offset`.
    fn read_span(&self, file: &Path, offset: u64, buf: &mut [u8]) -> Result<()>;
}

/// A local checkpoint folder as a span source.
pub struct LocalFiles {
    open: std::sync::Mutex<HashMap<PathBuf, std::sync::Arc<File>>>,
}

impl LocalFiles {
    pub fn new() -> LocalFiles {
        LocalFiles { open: Default::default() }
    }
}

impl Default for LocalFiles {
    fn default() -> Self {
        Self::new()
    }
}

impl SpanSource for LocalFiles {
    fn read_span(&self, file: &Path, offset: u64, buf: &mut [u8]) -> Result<()> {
        let f = {
            let mut open = self.open.lock().expect("poisoned");
            match open.get(file) {
                Some(f) => f.clone(),
                None => {
                    let f = std::sync::Arc::new(File::open(file).map_err(Error::io(file))?);
                    open.insert(file.to_path_buf(), f.clone());
                    f
                }
            }
        };
        f.read_exact_at(buf, offset).map_err(Error::io(file))
    }
}

/// How experts are laid out in the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertLayoutKind {
    /// Read experts from the checkpoint's shards where they are.
    InPlace,
    /// Copy experts into aligned pack files spread over the homes.
    Packs,
}

/// What to install and where.
#[derive(Clone, Debug)]
pub struct SetupOptions {
    pub source: PathBuf,
    pub out: PathBuf,
    /// One folder per drive; empty = the store folder itself.
    pub homes: Vec<PathBuf>,
    pub layout: ExpertLayoutKind,
    /// How many homes hold each expert (packs only), at most the number of homes.
    pub copies: usize,
}

/// Sidecar of one finished pack file.
#[derive(Serialize, Deserialize)]
struct PackSidecar {
    model_hash: String,
    bytes: u64,
    /// expert -> (offset, len, xxh3)
    experts: BTreeMap<usize, (u64, u64, String)>,
}

/// Sidecar of the finished spine file.
#[derive(Serialize, Deserialize)]
struct SpineSidecar {
    model_hash: String,
    bytes: u64,
    tensors: BTreeMap<String, SpineTensor>,
}

/// Which homes hold expert `e` of layer `l`: `copies` consecutive homes from a rotating start,
/// so every drive gets an equal share of every layer.
pub fn assign_homes(l: usize, e: usize, homes: usize, copies: usize) -> Vec<usize> {
    (0..copies.min(homes)).map(|j| (e + l + j) % homes).collect()
}

fn crash_point(layers_done: usize) {
    // Fault injection for the resume test: simulate a crash after N finished layers.
    if let Ok(n) = std::env::var("DELTAFIN_SETUP_CRASH_AFTER_LAYERS") {
        if n.parse::<usize>().ok() == Some(layers_done) {
            eprintln!("DELTAFIN_SETUP_CRASH_AFTER_LAYERS={n}: aborting to simulate a crash");
            std::process::abort();
        }
    }
}

fn read_json<T: for<'de> Deserialize<'de>>(p: &Path) -> Option<T> {
    serde_json::from_slice(&std::fs::read(p).ok()?).ok()
}

/// Installs `opts.source` into `opts.out`. Returns the manifest. Safe to re-run after a crash.
pub fn setup(opts: &SetupOptions, progress: &dyn Progress) -> Result<Manifest> {
    let ckpt = Checkpoint::open(&opts.source)?;
    let cfg = ckpt.config().clone();
    let model_hash = checksum(ckpt.config_text().as_bytes());
    let out = &opts.out;
    std::fs::create_dir_all(out).map_err(Error::io(out))?;
    if let Ok(m) = Manifest::read(out) {
        if m.model_hash != model_hash {
            return Err(Error::WrongModel { path: out.clone(), found: m.model_hash, expected: model_hash });
        }
    }
    write_atomic(&out.join(crate::store::STORE_MARKER), FORMAT.as_bytes())?;
    for f in ["config.json", "tiktoken.model", "tokenizer_config.json", "generation_config.json"] {
        let p = opts.source.join(f);
        if p.exists() {
            let bytes = std::fs::read(&p).map_err(Error::io(&p))?;
            write_atomic(&out.join(f), &bytes)?;
        }
    }
    let src = LocalFiles::new();

    // Spine.
    let spine_path = out.join("spine.bin");
    let sidecar_path = out.join("spine.bin.json");
    let spine_names: Vec<&String> = {
        let mut v: Vec<&String> =
            ckpt.tensors().keys().filter(|n| n.starts_with(LM_PREFIX) && !n.contains(".block_sparse_moe.experts.")).collect();
        v.sort();
        v
    };
    let done: Option<SpineSidecar> = read_json(&sidecar_path);
    let spine = match done {
        Some(s) if s.model_hash == model_hash && std::fs::metadata(&spine_path).map(|m| m.len()).ok() == Some(s.bytes) => s,
        _ => {
            let mut tensors = BTreeMap::new();
            let mut off = 0u64;
            for n in &spine_names {
                let t = &ckpt.tensors()[*n];
                tensors
                    .insert((*n).clone(), SpineTensor { dtype: format!("{:?}", t.dtype), shape: t.shape.clone(), offset: off, len: t.len });
                off = align_up(off + t.len);
            }
            progress.begin("spine", off);
            let tmp = tmp_path(&spine_path);
            let f = File::create(&tmp).map_err(Error::io(&tmp))?;
            f.set_len(off).map_err(Error::io(&tmp))?;
            let mut buf = Vec::new();
            for n in &spine_names {
                let t = &ckpt.tensors()[*n];
                buf.resize(t.len as usize, 0);
                src.read_span(&ckpt.shards()[t.shard], t.offset, &mut buf)?;
                f.write_all_at(&buf, tensors[*n].offset).map_err(Error::io(&tmp))?;
                progress.advance(t.len);
            }
            f.sync_all().map_err(Error::io(&tmp))?;
            drop_cache(&f);
            std::fs::rename(&tmp, &spine_path).map_err(Error::io(&spine_path))?;
            let s = SpineSidecar { model_hash: model_hash.clone(), bytes: off, tensors };
            write_atomic(&sidecar_path, &serde_json::to_vec(&s).expect("serializable"))?;
            progress.end();
            s
        }
    };

    // Experts.
    let homes: Vec<PathBuf> = match opts.layout {
        ExpertLayoutKind::InPlace => {
            vec![std::fs::canonicalize(&opts.source).map_err(Error::io(&opts.source))?]
        }
        ExpertLayoutKind::Packs => {
            let hs = if opts.homes.is_empty() { vec![out.clone()] } else { opts.homes.clone() };
            let mut abs = Vec::new();
            for h in hs {
                let d = h.join("deltafin-experts").join(&model_hash[..12]);
                std::fs::create_dir_all(&d).map_err(Error::io(&d))?;
                abs.push(std::fs::canonicalize(&h).map_err(Error::io(&h))?);
            }
            abs
        }
    };
    let copies = opts.copies.clamp(1, homes.len());
    if opts.copies > homes.len() {
        return Err(Error::format(out, format!("{} copies asked but only {} homes given", opts.copies, homes.len())));
    }
    let moe = cfg.moe_layers();
    let expert_bytes = cfg.expert_shape().total_bytes() as u64;
    let per_layer = match opts.layout {
        ExpertLayoutKind::InPlace => expert_bytes * cfg.num_experts as u64,
        ExpertLayoutKind::Packs => expert_bytes * (cfg.num_experts * copies) as u64,
    };
    progress.begin("experts", per_layer * moe.len() as u64);
    let mut entries = Vec::new();
    let mut layouts = Vec::new();
    for (done_layers, &l) in moe.iter().enumerate() {
        let (layout, spans) = ckpt.expert_spans(l)?;
        layouts.push((l, layout.offsets));
        let layer_entries = match opts.layout {
            ExpertLayoutKind::InPlace => in_place_layer(out, &model_hash, l, &spans, &homes[0], &src, progress)?,
            ExpertLayoutKind::Packs => pack_layer(&model_hash, l, &spans, &homes, copies, &src, progress)?,
        };
        entries.extend(layer_entries);
        crash_point(done_layers + 1);
    }
    progress.end();
    let manifest = Manifest {
        format: FORMAT.into(),
        model_hash,
        layout: match opts.layout {
            ExpertLayoutKind::InPlace => "in-place".into(),
            ExpertLayoutKind::Packs => "packs".into(),
        },
        homes,
        spine_file: "spine.bin".into(),
        spine_bytes: spine.bytes,
        spine: spine.tensors,
        layouts,
        experts: entries,
    };
    write_atomic(&out.join("manifest.json"), &serde_json::to_vec_pretty(&manifest).expect("serializable"))?;
    Ok(manifest)
}

fn in_place_layer(
    out: &Path,
    hash: &str,
    l: usize,
    spans: &[crate::checkpoint::ExpertSpan],
    home: &Path,
    src: &dyn SpanSource,
    progress: &dyn Progress,
) -> Result<Vec<ExpertEntry>> {
    let side = out.join(format!("inplace-L{l:03}.json"));
    let total: u64 = spans.iter().map(|s| s.len).sum();
    let done: Option<PackSidecar> = read_json(&side);
    let sums = match done {
        Some(s) if s.model_hash == hash && s.experts.len() == spans.len() => {
            progress.advance(total);
            s.experts
        }
        _ => {
            let mut map = BTreeMap::new();
            let mut buf = Vec::new();
            for (e, s) in spans.iter().enumerate() {
                buf.resize(s.len as usize, 0);
                src.read_span(&s.file, s.offset, &mut buf)?;
                map.insert(e, (s.offset, s.len, checksum(&buf)));
                progress.advance(s.len);
            }
            write_atomic(
                &side,
                &serde_json::to_vec(&PackSidecar { model_hash: hash.into(), bytes: total, experts: map.clone() }).expect("serializable"),
            )?;
            map
        }
    };
    Ok(spans
        .iter()
        .enumerate()
        .map(|(e, s)| {
            let rel = s
                .file
                .strip_prefix(home)
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_else(|_| s.file.file_name().expect("shard name").to_string_lossy().into_owned());
            ExpertEntry {
                layer: l,
                expert: e,
                len: s.len,
                xxh3: sums[&e].2.clone(),
                copies: vec![Copy { home: 0, file: rel, offset: s.offset }],
            }
        })
        .collect())
}

fn pack_layer(
    hash: &str,
    l: usize,
    spans: &[crate::checkpoint::ExpertSpan],
    homes: &[PathBuf],
    copies: usize,
    src: &dyn SpanSource,
    progress: &dyn Progress,
) -> Result<Vec<ExpertEntry>> {
    let n = homes.len();
    let rel = format!("deltafin-experts/{}/L{l:03}.pack", &hash[..12]);
    let paths: Vec<PathBuf> = homes.iter().map(|h| h.join(&rel)).collect();
    let sides: Vec<PathBuf> = paths.iter().map(|p| PathBuf::from(format!("{}.json", p.display()))).collect();
    let existing: Vec<Option<PackSidecar>> = (0..n)
        .map(|h| {
            read_json::<PackSidecar>(&sides[h])
                .filter(|s| s.model_hash == hash && std::fs::metadata(&paths[h]).map(|m| m.len()).ok() == Some(s.bytes))
        })
        .collect();
    let assigned: Vec<Vec<usize>> =
        (0..n).map(|h| (0..spans.len()).filter(|&e| assign_homes(l, e, n, copies).contains(&h)).collect()).collect();
    let complete = (0..n).all(|h| existing[h].as_ref().is_some_and(|s| s.experts.keys().copied().eq(assigned[h].iter().copied())));
    let tables: Vec<BTreeMap<usize, (u64, u64, String)>> = if complete {
        progress.advance(spans.iter().map(|s| s.len).sum::<u64>() * copies as u64);
        existing.into_iter().map(|s| s.expect("complete").experts).collect()
    } else {
        let mut files = Vec::new();
        let mut offsets = vec![0u64; n];
        for p in &paths {
            let tmp = tmp_path(p);
            files.push(File::create(&tmp).map_err(Error::io(&tmp))?);
        }
        let mut tables = vec![BTreeMap::new(); n];
        let mut buf = Vec::new();
        for (e, s) in spans.iter().enumerate() {
            buf.resize(s.len as usize, 0);
            src.read_span(&s.file, s.offset, &mut buf)?;
            let sum = checksum(&buf);
            for h in assign_homes(l, e, n, copies) {
                let tmp = tmp_path(&paths[h]);
                files[h].write_all_at(&buf, offsets[h]).map_err(Error::io(&tmp))?;
                tables[h].insert(e, (offsets[h], s.len, sum.clone()));
                offsets[h] = align_up(offsets[h] + s.len);
                progress.advance(s.len);
            }
        }
        for h in 0..n {
            let tmp = tmp_path(&paths[h]);
            files[h].set_len(offsets[h]).map_err(Error::io(&tmp))?;
            files[h].flush().map_err(Error::io(&tmp))?;
            files[h].sync_all().map_err(Error::io(&tmp))?;
            drop_cache(&files[h]);
            std::fs::rename(&tmp, &paths[h]).map_err(Error::io(&paths[h]))?;
            let side = PackSidecar { model_hash: hash.into(), bytes: offsets[h], experts: tables[h].clone() };
            write_atomic(&sides[h], &serde_json::to_vec(&side).expect("serializable"))?;
        }
        tables
    };
    Ok((0..spans.len())
        .map(|e| {
            let hs = assign_homes(l, e, n, copies);
            let (_, len, sum) = tables[hs[0]][&e].clone();
            ExpertEntry {
                layer: l,
                expert: e,
                len,
                xxh3: sum,
                copies: hs.iter().map(|&h| Copy { home: h, file: rel.clone(), offset: tables[h][&e].0 }).collect(),
            }
        })
        .collect())
}

/// Evicts a file from the page cache so later reads (and benchmarks) hit the drive.
pub fn drop_cache(f: &File) {
    use std::os::fd::AsRawFd;
    #[cfg(target_os = "linux")]
    // SAFETY: advisory call on a valid descriptor.
    unsafe {
        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = f.as_raw_fd();
}
