//! The experts of a stream store: fetched from the hub the first time they are read, published
//! to a local cache only complete and checked, and evicted coldest-first under a disk budget.
//!
//! **Publishing.** A fetched expert is written to a temporary file, synced, and renamed into
//! `deltafin-cache/SHARD/OFFSET.XXH3` (the directory synced too): the name carries the checksum
//! of the bytes, so presence and checksum appear together, and a crash leaves either nothing or a
//! whole expert. Every later read checks the file against its name; a damaged one is deleted and
//! fetched again.
//!
//! **The hub's hashes.** The hub publishes one SHA-256 per shard, not per expert. A shard of at
//! most [`WHOLE_SHARD_FETCH`] bytes is downloaded whole at setup and checked against its SHA-256
//! (its experts then have checksums in the manifest and are read from it like a full store's).
//! A larger shard's experts are published after the exact transport checks (status,
//! `Content-Range`, length), and the shard is checked (`verify.rs`) as soon as all its bytes are
//! local, or when asked (`--verified-only`, a fill, `doctor`), fetching what is not local. Until
//! a shard is checked, its spine bytes and experts are *unverified*: the engine counts every such
//! byte it is handed ([`DriveIo::unverified_bytes`]) and runs say so. Once checked, every expert
//! of the shard is held to the xxh3 the check recorded, whenever it is read or fetched again.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::SystemTime;

use deltafin_fetch::{Hub, HubConfig, Priority as FetchPriority, RepoRef};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::manifest::{checksum, rename_synced, Manifest};
use crate::memory::BUF_ALIGN;
use crate::reader::aligned_window;
use crate::streaming::DriveIo;

mod verify;
pub use verify::{VerifiedShards, VERIFIED_RECORD};

/// Folder of a stream store holding fetched experts.
pub const CACHE_DIR: &str = "deltafin-cache";
/// Folder of a stream store holding the repository's small files and shard skeletons (headers
/// and spine bytes; the expert regions are sparse).
pub const HUB_DIR: &str = "hub";
/// Sealed record of where a stream store's bytes come from.
pub const HUB_RECORD: &str = "hub.json";

/// A shard of at most this many bytes is downloaded whole at setup and checked against its
/// SHA-256 before anything of it is used.
pub const WHOLE_SHARD_FETCH: u64 = 64 << 20;

/// The home (index in the manifest) of experts read from whole, verified shards in [`HUB_DIR`].
pub const WHOLE_SHARD_HOME: usize = 1;

/// Adjacent missing experts of one shard fetched in one range request: at most this many...
pub const RUN_EXPERTS_MAX: usize = 32;
/// ...and at most this many bytes (the hub's CDN serves 64 MiB ranges well).
pub const RUN_BYTES_MAX: u64 = 64 << 20;
/// Experts this close in their shard still join one run (the bytes between are fetched and
/// dropped: a header or spine tensor in between costs less than another request).
const RUN_GAP_MAX: u64 = 64 << 10;

/// Adjacent experts of one shard, fetched as one range.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Run {
    shard: String,
    /// `(offset, len)` of each expert, ascending.
    experts: Vec<(u64, u64)>,
}

impl Run {
    fn start(&self) -> u64 {
        self.experts[0].0
    }
    fn end(&self) -> u64 {
        self.experts.last().map_or(0, |(o, l)| o + l)
    }
}

/// Writes `bytes` to the temporary file `tmp` (renamed into place by the caller) and syncs it: with direct I/O where the buffer and
/// length allow (buffered writes of fetched experts took two thirds of a 2-core machine's CPU at
/// 150 MB/s, measured with perf: kernel page-cache copies), else through the page cache.
fn write_synced(tmp: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let aligned = (bytes.as_ptr() as usize).is_multiple_of(BUF_ALIGN) && bytes.len().is_multiple_of(BUF_ALIGN);
    #[cfg(target_os = "linux")]
    if aligned {
        use std::os::unix::fs::OpenOptionsExt;
        let direct = std::fs::OpenOptions::new().write(true).create(true).truncate(true).custom_flags(libc::O_DIRECT).open(tmp);
        match direct {
            Ok(mut f) => {
                f.write_all(bytes)?;
                return f.sync_all();
            }
            // File systems without direct I/O (tmpfs) refuse it: write through the cache.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(e),
        }
    }
    let _ = aligned;
    let mut f = std::fs::File::create(tmp)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// A buffer whose bytes start on a page boundary (inside an over-allocated `Vec`, reused
/// across fetches), so an expert fetched into it can be written with direct I/O.
struct PageAligned {
    v: Vec<u8>,
    at: usize,
    len: usize,
}

impl PageAligned {
    fn new(mut v: Vec<u8>, len: usize) -> PageAligned {
        if v.len() < len + BUF_ALIGN {
            v.resize(len + BUF_ALIGN, 0);
        }
        let at = v.as_ptr().align_offset(BUF_ALIGN);
        PageAligned { v, at, len }
    }
    fn bytes(&self) -> &[u8] {
        &self.v[self.at..self.at + self.len]
    }
}

impl AsMut<[u8]> for PageAligned {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.v[self.at..self.at + self.len]
    }
}

/// Most threads publishing fetched experts at once (each mostly waits for its fsync).
const PUBLISHERS_MAX: usize = 4;

/// Groups `(shard, offset, len)` experts into runs of at most `experts_max` experts (and
/// [`RUN_EXPERTS_MAX`]) and `bytes_max` bytes; one expert always makes a run.
fn coalesce(mut want: Vec<(String, u64, u64)>, experts_max: usize, bytes_max: u64) -> Vec<Run> {
    want.sort();
    want.dedup();
    let mut runs: Vec<Run> = Vec::new();
    for (shard, off, len) in want {
        if let Some(r) = runs.last_mut() {
            let fits = r.shard == shard
                && off >= r.end()
                && off - r.end() <= RUN_GAP_MAX
                && r.experts.len() < experts_max.min(RUN_EXPERTS_MAX)
                && off + len - r.start() <= bytes_max;
            if fits {
                r.experts.push((off, len));
                continue;
            }
        }
        runs.push(Run { shard, experts: vec![(off, len)] });
    }
    runs
}

/// The runs that fetch `want` over `connections`: as many equal runs per connection as the
/// [`RUN_BYTES_MAX`] cap needs (experts are all one size), largest first, so the connections
/// finish together instead of a last run or two fetched alone at one connection's rate.
fn plan_runs(want: Vec<(String, u64, u64)>, connections: usize) -> Vec<Run> {
    let total: u64 = want.iter().map(|w| w.2).sum();
    let conns = connections.max(1) as u64;
    let rounds = total.div_ceil(conns * RUN_BYTES_MAX).max(1);
    let per_run = (want.len() as u64).div_ceil(conns * rounds).max(1) as usize;
    let mut runs = coalesce(want, per_run, RUN_BYTES_MAX);
    runs.sort_by_key(|r| std::cmp::Reverse(r.end() - r.start()));
    runs
}

/// Runs `work` on every job over `workers` threads (one per hub connection), each with its own
/// buffer; after the first error no new job starts, and that error is returned.
pub(crate) fn drain<J: Send>(jobs: Vec<J>, workers: usize, work: impl Fn(J, &mut Vec<u8>) -> Result<()> + Sync) -> Result<()> {
    let queue = Mutex::new(std::collections::VecDeque::from(jobs));
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..workers.max(1) {
            scope.spawn(|| {
                let mut buf = Vec::new();
                while first_error.lock().expect("poisoned").is_none() {
                    let Some(job) = queue.lock().expect("poisoned").pop_front() else { return };
                    if let Err(e) = work(job, &mut buf) {
                        first_error.lock().expect("poisoned").get_or_insert(e);
                    }
                }
            });
        }
    });
    first_error.into_inner().expect("poisoned").map_or(Ok(()), Err)
}

/// A file of the repository as the hub listed it at setup.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct HubFile {
    pub path: String,
    pub size: u64,
    pub sha256: Option<String>,
    pub git_oid: Option<String>,
}

/// Where a stream store's bytes come from (`hub.json`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct HubRecord {
    pub endpoint: String,
    pub repo: String,
    pub commit: String,
    pub files: Vec<HubFile>,
    /// Bytes the expert cache may take on disk (`None`: no limit).
    pub disk_budget: Option<u64>,
    /// Folders on the drives (`--home`) the cached experts are spread over, each expert in one
    /// chosen by its position; empty: the store's own `deltafin-cache/`.
    #[serde(default)]
    pub cache_dirs: Vec<PathBuf>,
    /// Shards of at most this many bytes were downloaded whole (`None`: records made before it
    /// was kept, when it was always [`WHOLE_SHARD_FETCH`]).
    #[serde(default)]
    pub whole_shard_max: Option<u64>,
}

impl HubRecord {
    /// Connects to the record's repository at its pinned commit (no request is made until bytes
    /// are needed). `HF_ENDPOINT`, when set, overrides the endpoint recorded at setup.
    pub fn connect(&self) -> Result<Hub> {
        let mut cfg = HubConfig::from_env();
        if std::env::var_os("HF_ENDPOINT").is_none() {
            cfg.endpoint = self.endpoint.clone();
        }
        Hub::open(cfg, &RepoRef { repo: self.repo.clone(), revision: self.commit.clone() }).map_err(Error::from)
    }
}

/// What the cache holds of one expert.
struct Cached {
    xxh3: String,
    len: u64,
    last_use: u64,
}

#[derive(Default)]
struct CacheState {
    entries: HashMap<(String, u64), Cached>,
    bytes: u64,
    clock: u64,
}

/// Counters of a stream cache.
#[derive(Debug, Default)]
pub struct HubCacheStats {
    pub fetched_bytes: AtomicU64,
    pub fetches: AtomicU64,
    pub evicted: AtomicU64,
    pub shards_verified: AtomicU64,
    pub shard_mismatches: AtomicU64,
    /// Bytes of experts handed to the engine from shards not yet checked against the hub's hash.
    pub unverified_expert_bytes: AtomicU64,
}

/// The stream store's expert cache: a [`DriveIo`] whose misses are fetched from the hub.
pub struct HubCache {
    /// Where cached experts live (one folder per drive), each expert in [`HubCache::dir_of`].
    dirs: Vec<PathBuf>,
    skeleton: PathBuf,
    hub: Hub,
    files: HashMap<String, HubFile>,
    /// Every expert span of each shard: offset -> length.
    spans: HashMap<String, BTreeMap<u64, u64>>,
    state: Mutex<CacheState>,
    disk_budget: Option<u64>,
    pub stats: HubCacheStats,
    tmp_counter: AtomicU64,
    /// Set to end a fill early (the engine it filled for was dropped).
    stop: std::sync::atomic::AtomicBool,
    /// The store's folder (its manifest is resealed when a spine tensor is repaired).
    store: PathBuf,
    /// Spine tensors that lie in streamed shards.
    spine: Vec<verify::SpineSpan>,
    /// Shards checked against the hub's SHA-256 (`hub/verified.json`).
    verified: Mutex<VerifiedShards>,
    /// One shard check at a time.
    checking: Mutex<()>,
    /// Set when a check found bytes this process may already have computed with: every later
    /// read fails with it.
    tainted: Mutex<Option<String>>,
}

fn other(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

impl HubCache {
    /// Opens the cache of the stream store at `store` (scanning what earlier runs published and
    /// removing temporary files a crash left).
    pub fn open(store: &Path, manifest: &Manifest, record: &HubRecord) -> Result<HubCache> {
        let dirs = if record.cache_dirs.is_empty() { vec![store.join(CACHE_DIR)] } else { record.cache_dirs.clone() };
        for dir in &dirs {
            std::fs::create_dir_all(dir).map_err(|e| Error::Io {
                path: dir.clone(),
                err: std::io::Error::new(e.kind(), format!("{e} (a stream store's expert cache folder: is its drive mounted?)")),
            })?;
        }
        let mut spans: HashMap<String, BTreeMap<u64, u64>> = HashMap::new();
        for e in &manifest.experts {
            for c in e.copies.iter().filter(|c| c.home != WHOLE_SHARD_HOME) {
                spans.entry(c.file.clone()).or_default().insert(c.offset, e.len);
            }
        }
        let mut found: Vec<(SystemTime, String, u64, Cached)> = Vec::new();
        for (shard, d) in spans.keys().flat_map(|s| dirs.iter().map(move |d| (s, d.join(s)))) {
            let Ok(rd) = std::fs::read_dir(&d) else { continue };
            for ent in rd.flatten() {
                let name = ent.file_name().to_string_lossy().into_owned();
                if name.ends_with(".partial") {
                    let _ = std::fs::remove_file(ent.path());
                    continue;
                }
                let parsed = name.split_once('.').and_then(|(o, x)| Some((o.parse::<u64>().ok()?, x.to_string())));
                let Some((offset, xxh3)) = parsed else { continue };
                let Some(&len) = spans[shard].get(&offset) else {
                    // Not an expert of this store (a hand-made file): leave it, never use it.
                    continue;
                };
                let md = ent.metadata().map_err(Error::io(ent.path()))?;
                if md.len() != len {
                    let _ = std::fs::remove_file(ent.path());
                    continue;
                }
                found.push((md.modified().unwrap_or(SystemTime::UNIX_EPOCH), shard.clone(), offset, Cached { xxh3, len, last_use: 0 }));
            }
        }
        found.sort_by_key(|f| f.0);
        let mut st = CacheState::default();
        for (_, shard, offset, mut c) in found {
            st.clock += 1;
            c.last_use = st.clock;
            st.bytes += c.len;
            st.entries.insert((shard, offset), c);
        }
        Ok(HubCache {
            dirs,
            skeleton: store.join(HUB_DIR),
            hub: record.connect()?,
            files: record.files.iter().map(|f| (f.path.clone(), f.clone())).collect(),
            spans,
            state: Mutex::new(st),
            disk_budget: record.disk_budget,
            stats: HubCacheStats::default(),
            tmp_counter: AtomicU64::new(0),
            stop: std::sync::atomic::AtomicBool::new(false),
            store: store.to_path_buf(),
            spine: verify::spine_spans(manifest),
            verified: Mutex::new(VerifiedShards::read(&store.join(HUB_DIR).join(VERIFIED_RECORD))),
            checking: Mutex::new(()),
            tainted: Mutex::new(None),
        })
    }

    fn expert_path(&self, shard: &str, offset: u64, xxh3: &str) -> PathBuf {
        self.dir_of(shard, offset).join(shard).join(format!("{offset}.{xxh3}"))
    }

    /// Every expert this cache streams, as `(shard, offset, len)`, in shard order.
    pub fn streamed(&self) -> Vec<(String, u64, u64)> {
        let mut v: Vec<_> = self.spans.iter().flat_map(|(s, m)| m.iter().map(move |(o, l)| (s.clone(), *o, *l))).collect();
        v.sort();
        v
    }

    /// Bytes of experts cached now, and how many.
    pub fn cached(&self) -> (u64, usize) {
        let st = self.state.lock().expect("poisoned");
        (st.bytes, st.entries.len())
    }

    /// Whether the expert at `offset` of `shard` is cached.
    pub fn contains(&self, shard: &str, offset: u64) -> bool {
        self.state.lock().expect("poisoned").entries.contains_key(&(shard.to_string(), offset))
    }

    /// Reads the cached expert into `dst` if it is there and intact (a damaged file is deleted).
    fn read_cached(&self, shard: &str, offset: u64, dst: &mut [u8]) -> bool {
        let key = (shard.to_string(), offset);
        let xxh3 = {
            let mut st = self.state.lock().expect("poisoned");
            st.clock += 1;
            let clock = st.clock;
            match st.entries.get_mut(&key) {
                Some(c) => {
                    c.last_use = clock;
                    c.xxh3.clone()
                }
                None => return false,
            }
        };
        let path = self.expert_path(shard, offset, &xxh3);
        if self.verified_xxh3(shard, offset).is_some_and(|v| v != xxh3) {
            eprintln!("deltafin: cached expert {} differs from the bytes its shard was verified with; fetching it again", path.display());
            self.forget(&key, &xxh3);
            return false;
        }
        let ok = std::fs::File::open(&path).and_then(|mut f| {
            f.read_exact(dst)?;
            // The file's time is its recency across runs (eviction order).
            let _ = f.set_modified(SystemTime::now());
            Ok(())
        });
        match &ok {
            Ok(()) if checksum(dst) == xxh3 => return true,
            // Not this file's fault (no file handle left, say): keep it, fetch this time.
            Err(e) if !matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::UnexpectedEof) => {
                eprintln!("deltafin: cannot read cached expert {} ({e}{}); fetching it instead", path.display(), crate::error::io_hint(e));
                return false;
            }
            _ => {}
        }
        eprintln!("deltafin: cached expert {} is damaged; fetching it again", path.display());
        self.forget(&key, &xxh3);
        false
    }

    fn forget(&self, key: &(String, u64), xxh3: &str) {
        let mut st = self.state.lock().expect("poisoned");
        if let Some(c) = st.entries.remove(key) {
            st.bytes -= c.len;
        }
        let _ = std::fs::remove_file(self.expert_path(&key.0, key.1, xxh3));
    }

    /// The cache folder of the expert at `offset` of `shard`: one of the drives', by a hash of
    /// its position, so experts (and their reads) spread evenly and each has one place.
    fn dir_of(&self, shard: &str, offset: u64) -> &Path {
        if self.dirs.len() == 1 {
            return &self.dirs[0];
        }
        let h = crate::checksum::xxh3_64_with_seed(shard.as_bytes(), offset);
        &self.dirs[(h % self.dirs.len() as u64) as usize]
    }

    /// Publishes `bytes` as the expert at `offset` of `shard` (see the module doc).
    fn publish(&self, shard: &str, offset: u64, bytes: &[u8]) -> Result<()> {
        let d = self.dir_of(shard, offset).join(shard);
        std::fs::create_dir_all(&d).map_err(Error::io(&d))?;
        let sum = checksum(bytes);
        let n = self.tmp_counter.fetch_add(1, Ordering::Relaxed);
        let tmp = d.join(format!("{offset}.{}.{n}.partial", std::process::id()));
        let written = write_synced(&tmp, bytes);
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            let why = match crate::error::io_hint(&e) {
                hint if !hint.is_empty() => hint,
                _ => " (caching a fetched expert; free space or lower --disk-budget)".to_string(),
            };
            return Err(Error::Io { path: tmp, err: std::io::Error::new(e.kind(), format!("{e}{why}")) });
        }
        rename_synced(&tmp, &self.expert_path(shard, offset, &sum))?;
        let key = (shard.to_string(), offset);
        let mut st = self.state.lock().expect("poisoned");
        st.clock += 1;
        let clock = st.clock;
        if st.entries.insert(key.clone(), Cached { xxh3: sum, len: bytes.len() as u64, last_use: clock }).is_none() {
            st.bytes += bytes.len() as u64;
        }
        // Coldest first, never the expert just published.
        while let Some(budget) = self.disk_budget {
            if st.bytes <= budget {
                break;
            }
            let Some(victim) = st.entries.iter().filter(|(k, _)| **k != key).min_by_key(|(_, c)| c.last_use).map(|(k, _)| k.clone()) else {
                break;
            };
            let c = st.entries.remove(&victim).expect("present");
            st.bytes -= c.len;
            let _ = std::fs::remove_file(self.expert_path(&victim.0, victim.1, &c.xxh3));
            self.stats.evicted.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Missing expert spans of `shard`.
    fn missing(&self, shard: &str) -> Vec<(u64, u64)> {
        let st = self.state.lock().expect("poisoned");
        self.spans[shard].iter().filter(|(o, _)| !st.entries.contains_key(&(shard.to_string(), **o))).map(|(o, l)| (*o, *l)).collect()
    }

    /// Fetches the expert at `offset` of `shard` into `dst` and publishes it; checks the shard
    /// once all its bytes are local.
    pub fn fetch(&self, shard: &str, offset: u64, dst: &mut [u8], priority: FetchPriority) -> Result<()> {
        self.hub.fetch_range_split(shard, offset, dst, priority)?;
        self.stats.fetches.fetch_add(1, Ordering::Relaxed);
        self.stats.fetched_bytes.fetch_add(dst.len() as u64, Ordering::Relaxed);
        self.check_against_record(shard, offset, dst)?;
        self.publish(shard, offset, dst)?;
        if self.missing(shard).is_empty() {
            self.check_shard(shard)?;
        }
        Ok(())
    }

    /// An expert fetched again for a verified shard must be the bytes the check recorded.
    fn check_against_record(&self, shard: &str, offset: u64, bytes: &[u8]) -> Result<()> {
        match self.verified_xxh3(shard, offset) {
            Some(want) if want != checksum(bytes) => Err(Error::format(
                self.skeleton.join(shard),
                format!(
                    "the hub served the expert at offset {offset} with bytes that differ from those this shard was verified with                      against its SHA-256 (corrupted in transit, or the hub changed): not used; run again to fetch it again"
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Fetches one run as one range, handing each expert to `publish` as soon as it is whole
    /// (buffers come from `spare`, where the publishers put them back).
    fn fetch_run(&self, run: &Run, priority: FetchPriority, spare: &Mutex<Vec<Vec<u8>>>, publish: &dyn Fn(u64, PageAligned)) -> Result<()> {
        let (start, end) = (run.start(), run.end());
        let buffer = |len: u64| PageAligned::new(spare.lock().expect("poisoned").pop().unwrap_or_default(), len as usize);
        // Each expert, and any gap between two (fetched and dropped), as its own part.
        let (mut parts, mut offsets, mut at) = (Vec::new(), Vec::new(), start);
        for &(off, len) in &run.experts {
            if off > at {
                parts.push(buffer(off - at));
                offsets.push(None);
            }
            parts.push(buffer(len));
            offsets.push(Some(off));
            at = off + len;
        }
        self.hub.fetch_range_parts(&run.shard, start, parts, priority, &mut |i, part| match offsets[i] {
            Some(off) => publish(off, part),
            None => spare.lock().expect("poisoned").push(part.v),
        })?;
        self.stats.fetches.fetch_add(1, Ordering::Relaxed);
        self.stats.fetched_bytes.fetch_add(end - start, Ordering::Relaxed);
        Ok(())
    }

    /// Fetches those of `want` (`(shard, offset, len)` of experts of this store) not cached yet:
    /// adjacent ones coalesced into runs, the runs spread over the hub's connections, each
    /// expert published by a pool of publishers as soon as it has arrived (writing and syncing
    /// it on the fetching thread would idle that connection meanwhile). `progress` gets a phase
    /// of the missing bytes. The first error stops the rest and is returned (what was published
    /// before it stays: each expert is whole and checked on its own).
    pub fn fetch_many(
        &self,
        want: Vec<(String, u64, u64)>,
        priority: FetchPriority,
        phase: &str,
        progress: &dyn crate::setup::Progress,
    ) -> Result<()> {
        let want: Vec<_> = want.into_iter().filter(|(s, o, _)| self.spans.contains_key(s) && !self.contains(s, *o)).collect();
        progress.begin(phase, want.iter().map(|t| t.2).sum());
        let connections = self.hub.connections();
        let runs = plan_runs(want, connections);
        let spare = Mutex::new(Vec::new());
        let failed: Mutex<Option<Error>> = Mutex::new(None);
        // Bounded, so fetched experts wait in RAM for at most one per connection.
        let (tx, rx) = std::sync::mpsc::sync_channel::<(std::sync::Arc<str>, u64, PageAligned)>(connections);
        let rx = Mutex::new(rx);
        let result = std::thread::scope(|scope| {
            for _ in 0..connections.clamp(1, PUBLISHERS_MAX) {
                scope.spawn(|| loop {
                    let Ok((shard, off, bytes)) = rx.lock().expect("poisoned").recv() else { return };
                    if failed.lock().expect("poisoned").is_none() {
                        let published = self
                            .check_against_record(&shard, off, bytes.bytes())
                            .and_then(|()| self.publish(&shard, off, bytes.bytes()))
                            .and_then(|()| match self.missing(&shard).is_empty() {
                                true => self.check_shard(&shard),
                                false => Ok(()),
                            });
                        match published {
                            Ok(()) => progress.advance(bytes.len as u64),
                            Err(e) => drop(failed.lock().expect("poisoned").get_or_insert(e)),
                        }
                    }
                    spare.lock().expect("poisoned").push(bytes.v);
                });
            }
            let fetched = drain(runs, connections, |run, _| {
                if failed.lock().expect("poisoned").is_some() || self.stop.load(Ordering::Relaxed) {
                    // The publishers' error is returned below; or the fill was called off.
                    return Ok(());
                }
                let shard: std::sync::Arc<str> = run.shard.as_str().into();
                self.fetch_run(&run, priority, &spare, &|off, bytes| {
                    // A send fails only once every publisher has ended, which they do only
                    // after this returns.
                    let _ = tx.send((shard.clone(), off, bytes));
                })
            });
            drop(tx);
            fetched
        });
        progress.end();
        result.and(failed.into_inner().expect("poisoned").map_or(Ok(()), Err))
    }

    /// Fetches every expert not cached yet (a stream store becomes a full one) at background
    /// priority, so demand reads of a running engine go first.
    pub fn fill(&self, progress: &dyn crate::setup::Progress) -> Result<()> {
        let mut todo: Vec<(String, u64, u64)> =
            self.spans.keys().flat_map(|s| self.missing(s).into_iter().map(move |(o, l)| (s.clone(), o, l))).collect();
        if let Some(budget) = self.disk_budget {
            // Under a disk budget smaller than the model, fill up to it and stop: fetching past
            // it would only evict what was just fetched.
            let mut room = budget.saturating_sub(self.cached().0);
            todo.sort();
            todo.retain(|t| match room.checked_sub(t.2) {
                Some(r) => {
                    room = r;
                    true
                }
                None => false,
            });
        }
        self.fetch_many(todo, FetchPriority::Background, "fill", progress)?;
        // Shards the disk budget keeps partly cached are checked by streaming what is missing.
        let repaired = self.verify_all(progress)?;
        match repaired.is_empty() {
            true => Ok(()),
            false => Err(Error::Repaired { shard: "(several)".into(), parts: repaired, path: self.skeleton.clone() }),
        }
    }

    /// Fills in the background with spare bandwidth (the hub admits demand requests first)
    /// until the store is full, its disk budget reached, or the returned guard dropped. A fill
    /// error is reported and ends the fill; runs go on fetching on demand.
    pub fn fill_in_background(self: &std::sync::Arc<Self>) -> FillGuard {
        let cache = self.clone();
        std::thread::spawn(move || {
            if let Err(e) = cache.fill(&crate::setup::NoProgress) {
                if !cache.stop.load(Ordering::Relaxed) {
                    eprintln!("deltafin: background fill stopped: {e}; experts are still fetched as runs need them");
                }
            }
        });
        FillGuard(self.clone())
    }
}

/// Ends a background fill when dropped (runs already fetching finish and are published).
pub struct FillGuard(std::sync::Arc<HubCache>);

impl Drop for FillGuard {
    fn drop(&mut self) {
        self.0.stop.store(true, Ordering::Relaxed);
    }
}

/// The cache as the engine reads it, with the background fill (if any) that ends with it.
pub(crate) struct EngineCache {
    pub cache: std::sync::Arc<HubCache>,
    /// Held only to end the fill with the engine.
    pub _fill: Option<FillGuard>,
}

impl DriveIo for EngineCache {
    fn read(&self, home: usize, path: &Path, offset: u64, len: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        self.cache.read(home, path, offset, len, buf)
    }
    fn self_checked(&self) -> bool {
        self.cache.self_checked()
    }
    fn unverified_bytes(&self) -> u64 {
        self.cache.unverified_bytes()
    }
}

impl DriveIo for HubCache {
    fn read(&self, home: usize, path: &Path, offset: u64, len: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        if let Some(why) = self.tainted.lock().expect("poisoned").clone() {
            return Err(other(format!("{why}: this process may have computed with the wrong bytes; run again")));
        }
        if home == WHOLE_SHARD_HOME {
            // A verified whole shard: read like a full store's file (the manifest has checksums).
            let (file, _) = crate::reader::open_for_read(path, crate::reader::CacheMode::Buffered)?;
            return crate::reader::read_aligned(&file, offset, len, buf);
        }
        let shard = path.file_name().map(|n| n.to_string_lossy().into_owned()).ok_or_else(|| other("no shard name"))?;
        let (start, _) = aligned_window(offset, len);
        let at = (offset - start) as usize;
        let dst = &mut buf[at..at + len as usize];
        if !self.read_cached(&shard, offset, dst) {
            self.fetch(&shard, offset, dst, FetchPriority::Demand).map_err(other)?;
        }
        if !self.is_verified(&shard) {
            self.stats.unverified_expert_bytes.fetch_add(len, Ordering::Relaxed);
        }
        Ok(at)
    }

    fn unverified_bytes(&self) -> u64 {
        self.unverified_spine_bytes() + self.stats.unverified_expert_bytes.load(Ordering::Relaxed)
    }

    fn self_checked(&self) -> bool {
        // A cached expert is checked against the checksum in its name, a fetched one published
        // with the checksum of exactly the bytes handed back.
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(s: &str, o: u64, l: u64) -> (String, u64, u64) {
        (s.to_string(), o, l)
    }

    #[test]
    fn runs_join_adjacent_experts_of_one_shard_within_limits() {
        let runs = coalesce(
            vec![e("b", 0, 10), e("a", 20, 10), e("a", 10, 10), e("a", 10, 10), e("a", 30 + RUN_GAP_MAX + 1, 10)],
            usize::MAX,
            RUN_BYTES_MAX,
        );
        let got: Vec<(&str, Vec<(u64, u64)>)> = runs.iter().map(|r| (r.shard.as_str(), r.experts.clone())).collect();
        assert_eq!(got, vec![("a", vec![(10, 10), (20, 10)]), ("a", vec![(31 + RUN_GAP_MAX, 10)]), ("b", vec![(0, 10)])]);
        // Count and byte caps split long runs.
        let many: Vec<_> = (0..(RUN_EXPERTS_MAX as u64 + 1)).map(|i| e("s", i * 4, 4)).collect();
        assert_eq!(coalesce(many, usize::MAX, RUN_BYTES_MAX).iter().map(|r| r.experts.len()).collect::<Vec<_>>(), vec![RUN_EXPERTS_MAX, 1]);
        let big = RUN_BYTES_MAX / 2 + 1;
        assert_eq!(coalesce(vec![e("s", 0, big), e("s", big, big)], usize::MAX, RUN_BYTES_MAX).len(), 2);
        let four: Vec<_> = (0..4).map(|i| e("s", i * 10, 10)).collect();
        assert_eq!(coalesce(four.clone(), usize::MAX, 20).len(), 2);
        assert_eq!(coalesce(four.clone(), 3, 1000).len(), 2);
        assert_eq!(coalesce(four, 1, 1000).len(), 4);
    }

    #[test]
    fn page_aligned_buffers_are_written_exactly_direct_or_not() {
        let t = tempfile::tempdir().unwrap();
        let mut spare = Vec::new();
        for (i, len) in [BUF_ALIGN * 3, BUF_ALIGN * 3 + 5, 7].into_iter().enumerate() {
            let mut b = PageAligned::new(std::mem::take(&mut spare), len);
            assert_eq!(b.bytes().as_ptr() as usize % BUF_ALIGN, 0);
            b.as_mut().iter_mut().enumerate().for_each(|(j, x)| *x = (j * 7 + i) as u8);
            let path = t.path().join(format!("e{i}"));
            write_synced(&path, b.bytes()).unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), b.bytes());
            spare = b.v;
        }
    }

    #[test]
    fn planned_runs_give_every_connection_the_same_work_largest_first() {
        const X: u64 = 17_547_264;
        let experts = |n: u64| -> Vec<_> { (0..n).map(|i| e("s", i * X, X)).collect() };
        let sizes = |runs: &[Run]| runs.iter().map(|r| r.experts.len()).collect::<Vec<_>>();
        // 16 experts over 4 connections: 4 per run would pass 64 MiB, so 8 runs of 2, not
        // 3 + 3 + 3 + 3 + 3 + 1 (one connection fetching the last alone).
        assert_eq!(sizes(&plan_runs(experts(16), 4)), vec![2; 8]);
        assert_eq!(sizes(&plan_runs(experts(32), 8)), vec![2; 16]);
        assert_eq!(sizes(&plan_runs(experts(6), 8)), vec![1; 6]);
        // A lone expert elsewhere comes after the larger runs.
        let mut w = experts(6);
        w.push(e("a", 0, X));
        assert_eq!(sizes(&plan_runs(w, 2)), vec![3, 3, 1]);
    }
}
