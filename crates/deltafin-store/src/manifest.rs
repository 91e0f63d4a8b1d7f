//! The store manifest: what a finished `deltafin setup` wrote and where every byte lives.
//!
//! `manifest.json` is written last, atomically; its presence is what makes a store complete. It
//! is *sealed* (an xxh3 of its exact body text sits beside the body), so one changed digit is an
//! error instead of a wrong offset. It names the checkpoint it holds twice over: `source_id`, a
//! fingerprint of the checkpoint folder taken before setup reads it (headers, sizes, sampled
//! content: see `identity.rs`), and `content_id`, a hash over the checksum of every byte the
//! engine will compute with. Every spine tensor, small file and expert carries its own checksum.
//!
//! A manifest is checked *structurally* against its config before anyone uses it
//! ([`Manifest::validate`]): every `(layer, expert)` exactly once, record layouts that fit the
//! expert shape, spine lengths equal to shape x dtype, homes and files that exist in the lists
//! that index them. A hand-edited or buggy manifest fails there, naming what is wrong.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use deltafin_core::K3Config;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Manifest format tag; bumped on incompatible changes.
pub const FORMAT: &str = "deltafin-store/2";

/// Bytes every pack file entry and spine tensor is aligned to (direct I/O needs 4096).
pub const ALIGN: u64 = 4096;

/// Small files copied into the store; the first two are required.
pub const STORE_FILES: [&str; 4] = ["config.json", "tiktoken.model", "tokenizer_config.json", "generation_config.json"];

/// A spine tensor: where it lies on disk and what its bytes hash to.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct SpineTensor {
    pub dtype: String,
    pub shape: Vec<usize>,
    /// Index into [`Manifest::spine_files`].
    pub file: usize,
    /// Byte offset in that file.
    pub offset: u64,
    pub len: u64,
    /// xxh3-64 of the tensor's bytes, hex.
    pub xxh3: String,
}

/// A small file of the store (config, tokenizer) with its checksum.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileSum {
    pub bytes: u64,
    pub xxh3: String,
}

/// One copy of an expert, or one stripe of it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Copy {
    /// Index into [`Manifest::homes`].
    pub home: usize,
    /// Path relative to the home.
    pub file: String,
    pub offset: u64,
    /// Set when this holds only part of the expert (the striped placement): which bytes, with
    /// their own checksum (so a corrupt stripe is named). `None`: the whole expert.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stripe: Option<Stripe>,
}

/// The part of an expert a stripe holds: bytes `[start, start + len)`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Stripe {
    pub start: u64,
    pub len: u64,
    /// xxh3-64 of the stripe's bytes, hex.
    pub xxh3: String,
}

impl Copy {
    /// A copy of the whole expert.
    pub fn whole(home: usize, file: String, offset: u64) -> Copy {
        Copy { home, file, offset, stripe: None }
    }

    /// The expert bytes this copy holds, `(start, len)`, for an expert of `len` bytes.
    pub fn range(&self, len: u64) -> (u64, u64) {
        self.stripe.as_ref().map_or((0, len), |s| (s.start, s.len))
    }
}

impl ExpertEntry {
    /// Whether the expert is striped over drives (each byte on one drive), not held whole.
    pub fn is_striped(&self) -> bool {
        self.copies.iter().any(|c| c.stripe.is_some())
    }
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

/// The arguments a store was set up with: what `doctor --repair` re-runs, and what a resumed
/// setup must match.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SetupRecord {
    /// The checkpoint folder (absolute).
    pub source: PathBuf,
    /// Fingerprint of that folder when setup began.
    pub source_id: String,
    /// `packs` or `in-place`.
    pub layout: String,
    /// Homes as given (absolute; empty = the store folder).
    pub homes: Vec<PathBuf>,
    pub copies: usize,
    /// How experts are spread over the homes: `round-robin`, `striped` or `weighted`
    /// (`setup/placement.rs`). Stores made before placements existed are round-robin.
    #[serde(default = "round_robin")]
    pub placement: String,
    /// The fraction of expert bytes each home holds (striped and weighted), fixed when the plan
    /// was made (from capacities and read rates), so a resumed or repaired setup places every
    /// byte exactly where the first run did.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shares: Vec<f64>,
    /// The capacities and rates stated for the homes, by position (what the shares were made
    /// from; unstated ones were found at setup).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drives: Vec<crate::setup::DriveFacts>,
}

fn round_robin() -> String {
    "round-robin".into()
}

impl SetupRecord {
    /// The `deltafin setup` command line that installs this record into `store`.
    pub fn command(&self, store: &Path) -> String {
        if self.layout == LAYOUT_STREAM {
            return format!("deltafin setup --stream --from {} --out {}", self.source.display(), store.display());
        }
        let mut c = format!("deltafin setup --full --from {} --out {}", self.source.display(), store.display());
        if self.layout == LAYOUT_IN_PLACE {
            c.push_str(" --in-place");
        }
        for (i, h) in self.homes.iter().enumerate() {
            c.push_str(&format!(" --home {}", h.display()));
            let f = self.drives.get(i).copied().unwrap_or_default();
            match (f.capacity, f.rate) {
                (None, None) => {}
                (cap, rate) => {
                    c.push(':');
                    if let Some(cap) = cap {
                        c.push_str(&cap.to_string());
                    }
                    if let Some(rate) = rate {
                        c.push_str(&format!(":{rate}/s"));
                    }
                }
            }
        }
        if self.copies != 1 {
            c.push_str(&format!(" --copies {}", self.copies));
        }
        // Over several homes the default placement depends on the arguments (striped with one
        // copy): name it, so the command reproduces this store whatever the default.
        if self.homes.len() > 1 || self.placement != "round-robin" {
            c.push_str(&format!(" --placement {}", self.placement));
        }
        c
    }
}

/// Layout tag of stores whose experts (and spine) are read from the checkpoint's shards.
pub const LAYOUT_IN_PLACE: &str = "in-place";
/// Layout tag of stores with their own spine file and aligned expert packs.
pub const LAYOUT_PACKS: &str = "packs";
/// Layout tag of stores whose experts are fetched from a hub on first use (`hub_cache.rs`); the
/// manifest cannot know their checksums, which the cache records as it publishes each one.
pub const LAYOUT_STREAM: &str = "stream";

/// Everything a store holds.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub format: String,
    /// Fingerprint of the checkpoint folder installed (see `identity.rs`).
    pub source_id: String,
    /// xxh3-128 over every checksum below: the identity of the bytes the engine computes with.
    pub content_id: String,
    /// `in-place` or `packs`.
    pub layout: String,
    /// How the store was made.
    pub setup: SetupRecord,
    /// Absolute paths of the homes (one per drive).
    pub homes: Vec<PathBuf>,
    /// Small files in the store folder (config, tokenizer) by name.
    pub files: BTreeMap<String, FileSum>,
    /// Files holding spine tensors: relative to the store folder, or absolute (in place).
    pub spine_files: Vec<PathBuf>,
    /// Bytes the spine takes in RAM (each tensor aligned to [`ALIGN`], in name order).
    pub spine_bytes: u64,
    pub spine: BTreeMap<String, SpineTensor>,
    /// Record offsets within an expert span, per MoE layer (layer, offsets).
    pub layouts: Vec<(usize, [usize; 6])>,
    pub experts: Vec<ExpertEntry>,
}

/// A sealed JSON file: the body's exact text and its xxh3, so any changed byte is found.
#[derive(Deserialize)]
struct Sealed<'a> {
    xxh3: String,
    #[serde(borrow)]
    body: &'a serde_json::value::RawValue,
}

/// The exact text of a sealed file with this body.
fn sealed_text(body: &str) -> String {
    format!("{{\"xxh3\": \"{}\",\n\"body\": {body}}}\n", checksum(body.as_bytes()))
}

/// Writes `value` sealed to `path` (atomically, directory synced).
pub fn write_sealed<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let body = serde_json::to_string_pretty(value).expect("serializable");
    write_atomic(path, sealed_text(&body).as_bytes())
}

/// What went wrong reading a sealed file.
#[derive(Debug)]
pub enum SealError {
    /// No such file.
    Missing,
    /// Present but unreadable, unparsable or not matching its seal: the reason.
    Bad(String),
}

/// Reads a sealed file written by [`write_sealed`].
pub fn read_sealed<T: for<'de> Deserialize<'de>>(path: &Path) -> std::result::Result<T, SealError> {
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(SealError::Missing),
        Err(e) => return Err(SealError::Bad(e.to_string())),
    };
    let sealed: Sealed = serde_json::from_slice(&text).map_err(|e| SealError::Bad(format!("not a sealed deltafin file: {e}")))?;
    // Byte for byte: even a change outside the body (whitespace around it) means the file was
    // touched, and doctor must be able to say so.
    if checksum(sealed.body.get().as_bytes()) != sealed.xxh3 || sealed_text(sealed.body.get()).as_bytes() != text.as_slice() {
        return Err(SealError::Bad("its checksum does not match its contents (the file was changed or damaged)".into()));
    }
    serde_json::from_str(sealed.body.get()).map_err(|e| SealError::Bad(format!("unexpected contents: {e}")))
}

impl Manifest {
    /// Reads and unseals `STORE/manifest.json`, with a clear error if the folder is not a finished
    /// store or the manifest was changed. Does not validate it against a config: see
    /// [`Manifest::validate`].
    pub fn read(store: &Path) -> Result<Manifest> {
        let p = store.join("manifest.json");
        let m: Manifest =
            match read_sealed(&p) {
                Ok(m) => m,
                Err(SealError::Missing) => return Err(Error::format(
                    &p,
                    "no manifest: not a Deltafin store, or `deltafin setup` did not finish (re-run it with the same arguments to resume)",
                )),
                Err(SealError::Bad(why)) => {
                    let format = std::fs::read_to_string(&p)
                        .ok()
                        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok()?.get("format")?.as_str().map(str::to_string));
                    let why = match format {
                        Some(f) => format!("store format {f:?}, this build reads {FORMAT:?} (stores now carry checksums of every byte)"),
                        None => why,
                    };
                    return Err(Error::BadStore { path: p, why, advice: repair_advice(store) });
                }
            };
        if m.format != FORMAT {
            return Err(Error::BadStore {
                path: p,
                why: format!("store format {:?}, this build reads {FORMAT:?}", m.format),
                advice: repair_advice(store),
            });
        }
        Ok(m)
    }

    /// Writes the manifest into `store`, sealed.
    pub fn write(&self, store: &Path) -> Result<()> {
        write_sealed(&store.join("manifest.json"), self)
    }

    /// Absolute path of a copy.
    pub fn copy_path(&self, c: &Copy) -> PathBuf {
        self.homes[c.home].join(&c.file)
    }

    /// Absolute path of spine file `i` of the store at `store`.
    pub fn spine_path(&self, store: &Path, i: usize) -> PathBuf {
        store.join(&self.spine_files[i])
    }

    /// What to do when something of this store is wrong (its bytes, not a drive).
    pub fn advice(&self, store: &Path) -> String {
        if self.layout == LAYOUT_IN_PLACE {
            format!(
                "this store reads the checkpoint at {} in place, and that checkpoint changed since setup: restore its original files, \
                 or install it as it is now with `{} --reinstall`",
                self.setup.source.display(),
                self.setup.command(store)
            )
        } else {
            repair_advice(store)
        }
    }

    /// RAM offset of each spine tensor (name order, each aligned), and the total.
    pub fn spine_placement(spine: &BTreeMap<String, SpineTensor>) -> (BTreeMap<String, u64>, u64) {
        let mut at = BTreeMap::new();
        let mut off = 0u64;
        for (name, t) in spine {
            at.insert(name.clone(), off);
            off = align_up(off + t.len);
        }
        (at, off)
    }

    /// Checks the manifest's structure against `cfg`: every routed expert exactly once with a
    /// length and layout that fit the expert shape, every index in range, spine lengths equal to
    /// shape x dtype. `path` names the manifest in errors.
    pub fn validate(&self, cfg: &K3Config, store: &Path) -> Result<()> {
        let bad = |why: String| Error::BadStore { path: store.join("manifest.json"), why, advice: repair_advice(store) };
        if ![LAYOUT_PACKS, LAYOUT_IN_PLACE, LAYOUT_STREAM].contains(&self.layout.as_str()) {
            return Err(bad(format!("unknown layout {:?}", self.layout)));
        }
        if self.homes.is_empty() {
            return Err(bad("no homes".into()));
        }
        for f in &STORE_FILES[..2] {
            if !self.files.contains_key(*f) {
                return Err(bad(format!("{f} has no checksum")));
            }
        }
        let shape = cfg.expert_shape();
        let total = shape.total_bytes();
        let (pb, sb) = (shape.packed_bytes(), shape.scale_bytes());
        let record_lens = [pb, sb, pb, sb, pb, sb];
        let moe: BTreeSet<usize> = cfg.moe_layers().into_iter().collect();
        let mut seen_layouts = BTreeSet::new();
        for (l, offsets) in &self.layouts {
            if !moe.contains(l) || !seen_layouts.insert(*l) {
                return Err(bad(format!("record layout for layer {l}: not an MoE layer of this config, or listed twice")));
            }
            let mut spans: Vec<(usize, usize)> = offsets.iter().zip(record_lens).map(|(&o, n)| (o, o + n)).collect();
            spans.sort_unstable();
            if spans.iter().any(|&(_, end)| end > total) || spans.windows(2).any(|w| w[0].1 > w[1].0) {
                return Err(bad(format!("record layout {offsets:?} of layer {l} does not fit a {total}-byte expert")));
            }
        }
        if seen_layouts != moe {
            return Err(bad(format!("record layouts cover layers {seen_layouts:?}, the config's MoE layers are {moe:?}")));
        }
        let mut seen = BTreeSet::new();
        for e in &self.experts {
            let name = format!("expert {}/{}", e.layer, e.expert);
            if !moe.contains(&e.layer) || e.expert >= cfg.num_experts {
                return Err(bad(format!("{name} is not an expert of this config")));
            }
            if !seen.insert((e.layer, e.expert)) {
                return Err(bad(format!("{name} is listed twice")));
            }
            if e.len != total as u64 {
                return Err(bad(format!("{name} is {} bytes, experts of this config are {total}", e.len)));
            }
            let unknown_ok = self.layout == LAYOUT_STREAM && e.xxh3.is_empty();
            if !unknown_ok && !is_hex(&e.xxh3, 16) {
                return Err(bad(format!("{name} has a malformed checksum {:?}", e.xxh3)));
            }
            if e.copies.is_empty() {
                return Err(bad(format!("{name} has no copy")));
            }
            for c in &e.copies {
                if c.home >= self.homes.len() || !is_relative_plain(&c.file) {
                    return Err(bad(format!("{name}: copy names home {} / file {:?}", c.home, c.file)));
                }
                if self.layout == LAYOUT_PACKS && c.offset % ALIGN != 0 {
                    return Err(bad(format!("{name}: pack offset {} is not {ALIGN}-aligned", c.offset)));
                }
                c.offset.checked_add(e.len).ok_or_else(|| bad(format!("{name}: offset {} overflows", c.offset)))?;
            }
            if e.is_striped() {
                check_stripes(e).map_err(|why| bad(format!("{name}: {why}")))?;
            }
        }
        let want = moe.len() * cfg.num_experts;
        if seen.len() != want {
            return Err(bad(format!("{} experts listed, this config has {want}", seen.len())));
        }
        for (name, t) in &self.spine {
            let size = match t.dtype.as_str() {
                "Bf16" => 2,
                "F32" => 4,
                "U8" => 1,
                other => return Err(bad(format!("spine tensor {name}: unknown dtype {other:?}"))),
            };
            let numel = t.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d as u64));
            if numel.and_then(|n| n.checked_mul(size)) != Some(t.len) {
                return Err(bad(format!("spine tensor {name}: {} bytes for {} {:?}", t.len, t.dtype, t.shape)));
            }
            if t.file >= self.spine_files.len() || !is_hex(&t.xxh3, 16) || t.offset.checked_add(t.len).is_none() {
                return Err(bad(format!("spine tensor {name}: bad file index, offset or checksum")));
            }
        }
        if Manifest::spine_placement(&self.spine).1 != self.spine_bytes {
            return Err(bad(format!("spine_bytes {} does not match its tensors", self.spine_bytes)));
        }
        Ok(())
    }

    /// xxh3-128 over every checksum the manifest records (files, spine, experts): the identity
    /// of the weights a store holds.
    pub fn compute_content_id(&self) -> String {
        let mut h = crate::checksum::Xxh3Wide::new();
        for (n, f) in &self.files {
            h.update(format!("file {n} {} {}\n", f.bytes, f.xxh3).as_bytes());
        }
        for (n, t) in &self.spine {
            h.update(format!("spine {n} {} {:?} {}\n", t.dtype, t.shape, t.xxh3).as_bytes());
        }
        for (l, o) in &self.layouts {
            h.update(format!("layout {l} {o:?}\n").as_bytes());
        }
        for e in &self.experts {
            h.update(format!("expert {} {} {} {}\n", e.layer, e.expert, e.len, e.xxh3).as_bytes());
        }
        format!("{:032x}", h.digest128())
    }
}

/// A striped expert's copies are stripes only, in order, page-aligned, covering every byte once,
/// each with its own checksum: a reader then never reads past the expert or leaves a gap.
fn check_stripes(e: &ExpertEntry) -> std::result::Result<(), String> {
    let mut at = 0u64;
    for c in &e.copies {
        let Some(s) = &c.stripe else { return Err("mixes whole copies and stripes".into()) };
        if s.start != at || s.len == 0 || s.start % ALIGN != 0 || !is_hex(&s.xxh3, 16) {
            return Err(format!(
                "stripe at {} of {} bytes does not continue at {at} (or is empty, unaligned or unchecked)",
                s.start, s.len
            ));
        }
        at += s.len;
    }
    if at != e.len {
        return Err(format!("stripes cover {at} of its {} bytes", e.len));
    }
    Ok(())
}

/// The advice for a store whose own bytes are wrong.
pub fn repair_advice(store: &Path) -> String {
    format!("run `deltafin doctor --repair --model {}` to repair it from its checkpoint", store.display())
}

fn is_hex(s: &str, n: usize) -> bool {
    s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn is_relative_plain(file: &str) -> bool {
    let p = Path::new(file);
    !file.is_empty() && p.is_relative() && p.components().all(|c| matches!(c, std::path::Component::Normal(_)))
}

/// xxh3-64 of bytes as 16 hex digits.
pub fn checksum(bytes: &[u8]) -> String {
    format!("{:016x}", crate::checksum::xxh3_64(bytes))
}

/// Rounds up to [`ALIGN`].
pub fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

/// Writes `bytes` to `path` via a synced temporary file, a rename and a synced directory: never
/// a half file, and a power cut cannot lose the rename once this returns.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = tmp_path(path);
    let written = (|| {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::Io { path: tmp, err: e });
    }
    rename_synced(&tmp, path)
}

/// Renames `from` to `to` and syncs `to`'s directory.
pub fn rename_synced(from: &Path, to: &Path) -> Result<()> {
    std::fs::rename(from, to).map_err(Error::io(to))?;
    sync_dir(to.parent().unwrap_or(Path::new(".")))
}

/// Syncs a directory, so the renames and removals in it survive a power cut.
pub fn sync_dir(dir: &Path) -> Result<()> {
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(Error::io(dir))
}

/// The temporary name a file is written under before it is complete.
pub fn tmp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".partial");
    PathBuf::from(s)
}
