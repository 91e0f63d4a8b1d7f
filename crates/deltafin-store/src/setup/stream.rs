//! `deltafin setup --stream`: a store that starts small. The revision is pinned to a commit;
//! config, tokenizer and index are downloaded whole (resumable, checked against the hub's
//! hashes); each shard gets a local *skeleton* (its header, its spine tensors' bytes, and sparse
//! holes where its experts lie), so the spine is read in place from it; experts are fetched on
//! first use into the cache (`hub_cache.rs`). `fill` fetches the rest.
//!
//! Re-running the same command resumes: downloaded files are kept when they still match their
//! hashes, and a shard's spine bytes are fetched again unless that shard is recorded as done
//! (after its bytes were synced). The revision stays pinned to the commit of the first run.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use deltafin_fetch::{DownloadProgress, Hub, HubConfig, Priority as FetchPriority, RemoteFile, RepoRef};

use super::{copy_small_files, previous, remove_if_present, Install, LocalFiles, Progress, SpanSource, SETUP_RECORD};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::hub_cache::{HubFile, HubRecord, CACHE_DIR, HUB_DIR, HUB_RECORD, WHOLE_SHARD_HOME};
use crate::lock::DirLock;
use crate::manifest::{
    checksum, read_sealed, sync_dir, write_atomic, write_sealed, Copy, ExpertEntry, Manifest, SetupRecord, FORMAT, LAYOUT_STREAM,
};

/// What to stream from where.
#[derive(Clone, Debug)]
pub struct StreamOptions {
    /// `hf://OWNER/REPO[@REVISION]`.
    pub from: String,
    pub out: PathBuf,
    /// Bytes the expert cache may take on disk.
    pub disk_budget: Option<u64>,
    /// Folders on drives to spread the expert cache over (default: the store's own folder).
    pub homes: Vec<PathBuf>,
    /// Fetch every expert now (the store becomes a full one).
    pub fill: bool,
    pub reinstall: bool,
    /// How to reach the hub (default: from the environment).
    pub hub: HubConfig,
    /// Shards of at most this many bytes are downloaded whole and checked at once.
    pub whole_shard_max: u64,
}

impl StreamOptions {
    /// Streams `from` (`hf://OWNER/REPO[@REV]`) into `out`, the hub as the environment says.
    pub fn new(from: impl Into<String>, out: impl Into<PathBuf>) -> StreamOptions {
        StreamOptions {
            from: from.into(),
            out: out.into(),
            disk_budget: None,
            homes: Vec::new(),
            fill: false,
            reinstall: false,
            hub: HubConfig::from_env(),
            whole_shard_max: crate::hub_cache::WHOLE_SHARD_FETCH,
        }
    }
}

/// Files fetched whole besides the shards (those the repository has).
const EAGER: [&str; 5] =
    ["config.json", "generation_config.json", "tiktoken.model", "tokenizer_config.json", "model.safetensors.index.json"];

/// Spine bytes coalesced into one request at most.
const SPINE_RUN: u64 = 64 << 20;

/// Shards whose every non-expert byte is on disk, one name per line (appended after a sync).
/// Named for what it promises: skeletons of earlier versions logged only the spine tensors in
/// `spine.done`, and must not count as complete.
const SPINE_DONE: &str = "skeleton.done";

struct Bytes<'p>(&'p dyn Progress);
impl DownloadProgress for Bytes<'_> {
    fn advance(&self, n: u64) {
        self.0.advance(n);
    }
}

fn to_hub_file(f: &RemoteFile) -> HubFile {
    HubFile { path: f.path.clone(), size: f.size, sha256: f.sha256.clone(), git_oid: f.git_oid.clone() }
}

fn to_remote(f: &HubFile) -> RemoteFile {
    RemoteFile { path: f.path.clone(), size: f.size, sha256: f.sha256.clone(), git_oid: f.git_oid.clone() }
}

/// Sets up (or resumes) a stream store; returns its manifest.
pub fn setup_stream(opts: &StreamOptions, progress: &dyn Progress) -> Result<Manifest> {
    let r = RepoRef::parse(&opts.from)?;
    let out = &opts.out;
    std::fs::create_dir_all(out).map_err(Error::io(out))?;
    let _lock = DirLock::acquire(out)?;
    let out_abs = std::fs::canonicalize(out).map_err(Error::io(out))?;
    // A resumed setup keeps the commit the first run pinned.
    let earlier: Option<HubRecord> = read_sealed(&out.join(HUB_RECORD)).ok().filter(|h: &HubRecord| h.repo == r.repo);
    let revision = match &earlier {
        Some(h) if !opts.reinstall && (r.revision == "main" || h.commit.starts_with(&r.revision)) => h.commit.clone(),
        _ => r.revision.clone(),
    };
    let hub = Hub::open(opts.hub.clone(), &RepoRef { repo: r.repo.clone(), revision })?;
    let files: Vec<HubFile> = match (&earlier, hub.offline()) {
        (Some(h), _) if h.commit == hub.commit() => h.files.clone(),
        _ => hub.list_files()?.iter().map(to_hub_file).collect(),
    };
    let source = PathBuf::from(format!("hf://{}@{}", r.repo, hub.commit()));
    let mut id = crate::checksum::Xxh3Wide::new();
    id.update(source.to_string_lossy().as_bytes());
    for f in &files {
        id.update(format!("{} {} {:?} {:?}\n", f.path, f.size, f.sha256, f.git_oid).as_bytes());
    }
    let mut homes = Vec::new();
    for h in &opts.homes {
        std::fs::create_dir_all(h).map_err(Error::io(h))?;
        homes.push(std::fs::canonicalize(h).map_err(Error::io(h))?);
    }
    // Each store its own folder in a home, so two stores never evict each other's experts.
    let store_key = format!("{}-{:016x}", r.repo.replace('/', "--"), crate::checksum::xxh3_64(out_abs.as_os_str().as_encoded_bytes()));
    let cache_dirs: Vec<PathBuf> = homes.iter().map(|h| h.join(CACHE_DIR).join(&store_key)).collect();
    let record = SetupRecord {
        source,
        source_id: format!("{:032x}", id.digest128()),
        layout: LAYOUT_STREAM.into(),
        homes,
        copies: 1,
        placement: "round-robin".into(),
        shares: Vec::new(),
        drives: Vec::new(),
    };
    let earlier_spine: HashMap<String, String> =
        previous(out, &record, opts.reinstall)?.iter().flat_map(|m| m.spine.iter().map(|(n, t)| (n.clone(), t.xxh3.clone()))).collect();
    write_sealed(&out.join(SETUP_RECORD), &record)?;
    remove_if_present(&out.join("manifest.json"))?;
    sync_dir(out)?;
    write_atomic(&out.join(crate::store::STORE_MARKER), FORMAT.as_bytes())?;
    let hub_record = HubRecord {
        endpoint: opts.hub.endpoint.clone(),
        repo: r.repo.clone(),
        commit: hub.commit().into(),
        files: files.clone(),
        disk_budget: opts.disk_budget,
        cache_dirs,
        whole_shard_max: Some(opts.whole_shard_max),
    };
    write_sealed(&out.join(HUB_RECORD), &hub_record)?;

    // Small files, whole.
    let dir = out_abs.join(HUB_DIR);
    std::fs::create_dir_all(&dir).map_err(Error::io(&dir))?;
    let by_name: HashMap<&str, &HubFile> = files.iter().map(|f| (f.path.as_str(), f)).collect();
    for name in ["config.json", "tiktoken.model", "model.safetensors.index.json"] {
        if !by_name.contains_key(name) {
            return Err(Error::format(
                &dir,
                format!("{} at {} has no {name}: is it a Kimi K3 checkpoint in the release layout?", r.repo, hub.commit()),
            ));
        }
    }
    let eager: Vec<&HubFile> = EAGER.iter().filter_map(|n| by_name.get(n).copied()).collect();
    progress.begin("config and tokenizer", eager.iter().map(|f| f.size).sum());
    for f in eager {
        let dest = dir.join(&f.path);
        let remote = to_remote(f);
        if hub.is_downloaded(&remote, &dest)? {
            progress.advance(f.size);
        } else {
            hub.download(&remote, &dest, &Bytes(progress))?;
        }
    }
    progress.end();

    // Shard skeletons: header and size, then the spine's bytes.
    let index: serde_json::Value = {
        let p = dir.join("model.safetensors.index.json");
        let text = std::fs::read(&p).map_err(Error::io(&p))?;
        serde_json::from_slice(&text).map_err(|e| Error::format(&p, e.to_string()))?
    };
    let shards: BTreeSet<String> = index
        .get("weight_map")
        .and_then(|m| m.as_object())
        .map(|m| m.values().filter_map(|v| v.as_str().map(str::to_string)).collect())
        .unwrap_or_default();
    // Small shards whole (checked against their SHA-256), the others as skeletons.
    let mut whole = BTreeSet::new();
    let small: u64 = shards.iter().filter_map(|s| by_name.get(s.as_str())).filter(|f| f.size <= opts.whole_shard_max).map(|f| f.size).sum();
    progress.begin("small shards", small);
    for s in &shards {
        let f = by_name
            .get(s.as_str())
            .ok_or_else(|| Error::format(&dir, format!("the index names {s}, which the repository does not have")))?;
        if f.size <= opts.whole_shard_max {
            let remote = to_remote(f);
            let dest = dir.join(s);
            if hub.is_downloaded(&remote, &dest)? {
                progress.advance(f.size);
            } else {
                remove_if_present(&dest)?;
                hub.download(&remote, &dest, &Bytes(progress))?;
            }
            whole.insert(s.clone());
        } else {
            skeleton(&hub, f, &dir.join(s))?;
        }
    }
    progress.end();
    let ckpt = Checkpoint::open(&dir)?;
    fetch_spine(&hub, &ckpt, &dir, &by_name, &whole, &earlier_spine, progress)?;
    drop(earlier_spine);
    ckpt.validate()?;

    // The manifest: the spine in place in the skeletons, experts in the cache (checksums unknown
    // until fetched).
    let cache = out_abs.join(CACHE_DIR);
    std::fs::create_dir_all(&cache).map_err(Error::io(&cache))?;
    // Every spine byte was just fetched (whole shards checked against their SHA-256) or just
    // compared with the earlier manifest (`fetch_spine`): the hub, not an earlier run, is the
    // reference, and a skeleton repaired from it must not read as a changed checkpoint.
    remove_if_present(&out.join("inplace-spine.json"))?;
    let plan = Install {
        ckpt: &ckpt,
        out,
        record: record.clone(),
        homes: vec![cache.clone(), dir.clone()],
        pack_dirs: vec![],
        earlier_spine: HashMap::new(),
        earlier_experts: HashMap::new(),
        src: LocalFiles::new(),
        spine_dir: dir.clone(),
        layout: super::Layout::new(super::Placement::RoundRobin, 1, vec![1.0], &ckpt.config().moe_layers(), ckpt.config().num_experts),
    };
    let files_sums = copy_small_files(&plan)?;
    let (spine_files, spine) = super::spine::in_place_spine(&plan, progress)?;
    let mut layouts = Vec::new();
    let mut experts = Vec::new();
    for l in ckpt.config().moe_layers() {
        let (layout, spans) = ckpt.expert_spans(l)?;
        layouts.push((l, layout.offsets));
        let mut buf = Vec::new();
        for (e, s) in spans.iter().enumerate() {
            let file = s.file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let entry = if whole.contains(&file) {
                // A verified whole shard: its experts' checksums are known now.
                buf.resize(s.len as usize, 0);
                plan.src.read_span(&s.file, s.offset, &mut buf)?;
                let copy = Copy::whole(WHOLE_SHARD_HOME, file, s.offset);
                ExpertEntry { layer: l, expert: e, len: s.len, xxh3: checksum(&buf), copies: vec![copy] }
            } else {
                ExpertEntry { layer: l, expert: e, len: s.len, xxh3: String::new(), copies: vec![Copy::whole(0, file, s.offset)] }
            };
            experts.push(entry);
        }
    }
    let mut manifest = Manifest {
        format: FORMAT.into(),
        source_id: record.source_id.clone(),
        content_id: String::new(),
        layout: LAYOUT_STREAM.into(),
        setup: record,
        homes: vec![cache, dir.clone()],
        files: files_sums,
        spine_files,
        spine_bytes: 0,
        spine,
        layouts,
        experts,
    };
    super::seal(&mut manifest, ckpt.config(), out)?;
    if opts.fill {
        crate::hub_cache::HubCache::open(&out_abs, &manifest, &hub_record)?.fill(progress)?;
    }
    Ok(manifest)
}

/// Makes `path` the skeleton of shard `f`: its header bytes and its full size, the rest sparse.
fn skeleton(hub: &Hub, f: &HubFile, path: &Path) -> Result<()> {
    if std::fs::metadata(path).is_ok_and(|m| m.len() == f.size) {
        return Ok(());
    }
    let mut len8 = [0u8; 8];
    hub.fetch_range(&f.path, 0, &mut len8, FetchPriority::Demand)?;
    let n = u64::from_le_bytes(len8);
    if n > 100 << 20 || 8 + n > f.size {
        return Err(Error::format(path, format!("the hub's {} starts with a header length of {n} bytes: not a safetensors file", f.path)));
    }
    let mut header = vec![0u8; n as usize];
    hub.fetch_range(&f.path, 8, &mut header, FetchPriority::Demand)?;
    super::write_file_atomically(path, f.size, |file| {
        file.write_all_at(&len8, 0).map_err(Error::io(path))?;
        file.write_all_at(&header, 8).map_err(Error::io(path))
    })
}

/// Fetches every byte of each skeleton that is not an expert's (the spine, and any tensor the
/// engine does not use, which the shard's SHA-256 covers all the same), shard by shard,
/// checking a shard that holds no experts against its SHA-256 at once (its bytes are then all
/// local).
fn fetch_spine(
    hub: &Hub,
    ckpt: &Checkpoint,
    dir: &Path,
    files: &HashMap<&str, &HubFile>,
    whole: &BTreeSet<String>,
    earlier: &HashMap<String, String>,
    progress: &dyn Progress,
) -> Result<()> {
    let done_path = dir.join(SPINE_DONE);
    let done: BTreeSet<String> = std::fs::read_to_string(&done_path).unwrap_or_default().lines().map(str::to_string).collect();
    let names = super::spine::spine_names(ckpt);
    let mut names_of: BTreeMap<usize, Vec<&String>> = BTreeMap::new();
    for n in &names {
        names_of.entry(ckpt.tensors()[n].shard).or_default().push(n);
    }
    // Expert spans per shard: the bytes left sparse.
    let mut expert_spans: BTreeMap<usize, Vec<(u64, u64)>> = BTreeMap::new();
    for l in ckpt.config().moe_layers() {
        for s in ckpt.expert_spans(l)?.1 {
            let shard =
                ckpt.shards().iter().position(|p| *p == s.file).ok_or_else(|| Error::format(&s.file, "an expert outside the shards"))?;
            expert_spans.entry(shard).or_default().push((s.offset, s.len));
        }
    }
    let has_experts: BTreeSet<usize> = expert_spans.keys().copied().collect();
    let mut per_shard: BTreeMap<usize, Vec<(u64, u64)>> = BTreeMap::new();
    for (shard, path) in ckpt.shards().iter().enumerate() {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let size = files.get(name.as_str()).map_or(0, |f| f.size);
        let mut head = [0u8; 8];
        std::fs::File::open(path).and_then(|f| f.read_exact_at(&mut head, 0)).map_err(Error::io(path))?;
        let mut at = 8 + u64::from_le_bytes(head);
        let mut spans = expert_spans.remove(&shard).unwrap_or_default();
        spans.sort_unstable();
        let gaps = per_shard.entry(shard).or_default();
        for (o, l) in spans.into_iter().chain([(size, 0)]) {
            if o > at {
                gaps.push((at, o - at));
            }
            at = at.max(o + l);
        }
    }
    // A shard's spine bytes fetched by an earlier run are kept only if they still match the
    // checksums that run's manifest recorded.
    let intact = |shard: usize| -> bool {
        let path = &ckpt.shards()[shard];
        let Ok(f) = std::fs::File::open(path) else { return false };
        names_of.get(&shard).into_iter().flatten().all(|n| {
            let t = &ckpt.tensors()[*n];
            let mut b = vec![0u8; t.len as usize];
            f.read_exact_at(&mut b, t.offset).is_ok() && earlier.get(*n).is_some_and(|want| *want == checksum(&b))
        })
    };
    progress.begin("spine", per_shard.values().flatten().map(|r| r.1).sum());
    for (shard, mut ranges) in per_shard {
        let path = &ckpt.shards()[shard];
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let bytes: u64 = ranges.iter().map(|r| r.1).sum();
        if whole.contains(&name) || (done.contains(&name) && intact(shard)) {
            progress.advance(bytes);
            continue;
        }
        // The gaps between experts are never adjacent: each is split into requests of at most
        // SPINE_RUN bytes, spread over the hub's connections.
        ranges.sort_unstable();
        let runs: Vec<(u64, u64)> = ranges
            .iter()
            .flat_map(|&(o, l)| (0..l.div_ceil(SPINE_RUN)).map(move |i| (o + i * SPINE_RUN, (l - i * SPINE_RUN).min(SPINE_RUN))))
            .collect();
        let file = std::fs::OpenOptions::new().write(true).open(path).map_err(Error::io(path))?;
        crate::hub_cache::drain(runs, hub.connections(), |(o, l), buf| {
            buf.resize(l as usize, 0);
            hub.fetch_range(&name, o, buf, FetchPriority::Demand)?;
            file.write_all_at(buf, o).map_err(Error::io(path))?;
            progress.advance(l);
            Ok(())
        })?;
        file.sync_all().map_err(Error::io(path))?;
        if !has_experts.contains(&shard) {
            if let Some(want) = files.get(name.as_str()).and_then(|f| f.sha256.clone()) {
                let got = deltafin_fetch::sha256_file(path)?;
                if got != want.to_ascii_lowercase() {
                    return Err(Error::format(
                        path,
                        format!("the bytes fetched for this shard hash to SHA-256 {got}, the hub published {want}; run setup again to refetch them"),
                    ));
                }
            }
        }
        let mut log = std::fs::OpenOptions::new().create(true).append(true).open(&done_path).map_err(Error::io(&done_path))?;
        writeln!(log, "{name}").and_then(|_| log.sync_all()).map_err(Error::io(&done_path))?;
    }
    progress.end();
    Ok(())
}
