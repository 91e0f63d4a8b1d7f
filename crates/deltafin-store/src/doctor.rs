//! `deltafin doctor`: checks a store against its manifest, and repairs it.
//!
//! Without `verify`: the manifest's seal and structure, the small files' checksums, every file
//! present and long enough. With `verify`: also every spine tensor's and expert copy's bytes,
//! and the sidecars setup resumes from. [`repair`] re-runs setup with the arguments the store
//! recorded, which re-verifies everything and rewrites what is wrong.

use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::error::{Error, Result};
use crate::manifest::{checksum, read_sealed, Manifest, SealError, SetupRecord};
use crate::setup::{ExpertLayoutKind, Progress, SetupOptions};

/// What doctor found.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct DoctorReport {
    pub experts_checked: usize,
    pub copies_checked: usize,
    pub spine_tensors_checked: usize,
    /// One line per problem, naming what and where.
    pub problems: Vec<String>,
    /// What to run to fix them.
    pub advice: String,
    /// A stream store's cache: experts cached, experts fetched on use, bytes cached.
    pub stream_cache: Option<(usize, usize, u64)>,
    /// A stream store's large shards not yet checked against the hub's SHA-256 (not a problem:
    /// their bytes are trusted on transport checks alone until they are).
    pub unverified_shards: Vec<String>,
}

impl DoctorReport {
    /// No problem found.
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// The arguments the store at `dir` was set up with, from `setup.json` and the manifest. In every
/// state setup leaves a store in, the two agree or one is absent; when they disagree (one was
/// damaged or replaced), the one naming the checkpoint the spine's sidecar names wins, and if
/// neither does, there is no telling which is right.
pub fn setup_record(dir: &Path) -> Option<SetupRecord> {
    let record = read_sealed::<SetupRecord>(&dir.join("setup.json")).ok();
    let manifest = Manifest::read(dir).ok().map(|m| m.setup);
    match (record, manifest) {
        (Some(r), Some(m)) if r != m => {
            let spine = ["spine.bin.json", "inplace-spine.json"]
                .iter()
                .find_map(|f| read_sealed::<serde_json::Value>(&dir.join(f)).ok())
                .and_then(|v| v.get("source_id").and_then(|s| s.as_str()).map(str::to_string));
            match spine {
                Some(id) if r.source_id == id && m.source_id != id => Some(r),
                Some(id) if m.source_id == id => Some(m),
                _ => None,
            }
        }
        (r, m) => r.or(m),
    }
}

/// Checks the store at `dir`; `verify` also reads every byte and compares checksums.
pub fn doctor(dir: &Path, verify: bool, progress: &dyn Progress) -> Result<DoctorReport> {
    let mut r = DoctorReport { advice: crate::manifest::repair_advice(dir), ..Default::default() };
    if setup_record(dir).is_none() {
        r.advice = format!(
            "this store has no record of how it was made: run `deltafin setup --full --from CHECKPOINT --out {}` with its original --home/--copies/--in-place arguments",
            dir.display()
        );
    }
    let m = match Manifest::read(dir) {
        Ok(m) => m,
        Err(e) => {
            r.problems.push(e.to_string());
            return Ok(r);
        }
    };
    r.advice = m.advice(dir);
    for name in m.files.keys() {
        if let Err(e) = crate::store::Store::small_file(dir, &m, name) {
            r.problems.push(e.to_string());
        }
    }
    let cfg = match std::fs::read_to_string(dir.join("config.json")).ok().and_then(|t| deltafin_core::K3Config::from_json(&t).ok()) {
        Some(c) => c,
        None => {
            r.problems.push(format!("{}: missing or not a valid config", dir.join("config.json").display()));
            return Ok(r);
        }
    };
    if let Err(e) = m.validate(&cfg, dir) {
        r.problems.push(e.to_string());
        return Ok(r);
    }
    let spine_total: u64 = m.spine.values().map(|t| t.len).sum();
    let expert_total: u64 = m.experts.iter().flat_map(|e| e.copies.iter().map(|c| c.range(e.len).1)).sum();
    progress.begin(if verify { "verify" } else { "check" }, spine_total + expert_total);
    let mut buf = Vec::new();
    let files: Vec<Option<std::fs::File>> = (0..m.spine_files.len()).map(|i| std::fs::File::open(m.spine_path(dir, i)).ok()).collect();
    for (i, f) in files.iter().enumerate() {
        if f.is_none() {
            r.problems.push(format!("{}: spine file missing or unreadable", m.spine_path(dir, i).display()));
        }
    }
    for (name, t) in &m.spine {
        r.spine_tensors_checked += 1;
        let path = m.spine_path(dir, t.file);
        let what = format!("spine tensor `{name}` in {} at offset {}", path.display(), t.offset);
        if let Some(f) = &files[t.file] {
            // Always read against its checksum, as opening the store does: a doctor that passes
            // a spine `run` refuses would say OK too soon.
            check_range(f, (t.offset, t.len, &t.xxh3), &what, true, &mut buf, &mut r.problems);
        }
        progress.advance(t.len);
    }
    for e in &m.experts {
        if e.xxh3.is_empty() {
            // A stream store's expert, fetched on use: the cache checks it on every read.
            progress.advance(e.len);
            continue;
        }
        r.experts_checked += 1;
        for c in &e.copies {
            r.copies_checked += 1;
            let path = m.copy_path(c);
            let (len, sum, part) = match &c.stripe {
                Some(s) => (s.len, s.xxh3.as_str(), format!(" (bytes {}..{})", s.start, s.start + s.len)),
                None => (e.len, e.xxh3.as_str(), String::new()),
            };
            let what = format!("expert {}/{}{part} in {} at offset {}", e.layer, e.expert, path.display(), c.offset);
            match std::fs::File::open(&path) {
                Err(err) => r.problems.push(format!("{what}: missing ({err})")),
                Ok(f) => check_range(&f, (c.offset, len, sum), &what, verify, &mut buf, &mut r.problems),
            }
            progress.advance(len);
        }
    }
    progress.end();
    if m.layout == crate::manifest::LAYOUT_STREAM {
        match crate::manifest::read_sealed::<crate::hub_cache::HubRecord>(&dir.join(crate::hub_cache::HUB_RECORD)) {
            Ok(rec) => match crate::hub_cache::HubCache::open(dir, &m, &rec) {
                Ok(cache) => {
                    let (bytes, n) = cache.cached();
                    r.stream_cache = Some((n, m.experts.iter().filter(|e| e.xxh3.is_empty()).count(), bytes));
                    check_stream(&cache, verify, &mut r);
                }
                Err(e) => r.problems.push(e.to_string()),
            },
            Err(e) => r.problems.push(format!("{}: {e:?}", dir.join(crate::hub_cache::HUB_RECORD).display())),
        }
    }
    if verify {
        check_records(dir, &m, &mut r);
        check_padding(dir, &m, &mut r);
    }
    Ok(r)
}

/// A stream store's bytes against the hub's hashes: each shard not checked yet whose bytes are all
/// local is hashed (with `verify`), a mismatch a problem naming it; cached experts of checked
/// shards are held to the xxh3 their check recorded (with `verify`); shards still unchecked are
/// listed.
fn check_stream(cache: &crate::hub_cache::HubCache, verify: bool, r: &mut DoctorReport) {
    for shard in cache.unverified_shards() {
        match verify.then(|| cache.local_check(&shard)) {
            Some(Ok(Some(false))) => r.problems.push(format!(
                "{shard}: its local bytes (spine tensors in the skeleton and cached experts) do not match the SHA-256 the hub publishes: \
                 something was corrupted in transit or on disk"
            )),
            Some(Err(e)) => r.problems.push(format!("{shard}: {e}")),
            Some(Ok(Some(true))) => {}
            Some(Ok(None)) | None => r.unverified_shards.push(shard),
        }
    }
    if verify {
        for (shard, offset) in cache.damaged_verified_experts() {
            r.problems.push(format!("{shard}: the cached expert at offset {offset} differs from the bytes its shard was verified with"));
        }
    }
}

/// Files the store wrote itself (its spine file, its packs) hold nothing but checksummed bytes
/// and zero padding up to the next [`crate::ALIGN`]: a changed padding byte or an appended tail
/// computes nothing wrong, but says the file was touched.
fn check_padding(dir: &Path, m: &Manifest, r: &mut DoctorReport) {
    if m.layout != crate::manifest::LAYOUT_PACKS {
        return;
    }
    let mut files: std::collections::BTreeMap<std::path::PathBuf, Vec<(u64, u64)>> = Default::default();
    for t in m.spine.values() {
        files.entry(m.spine_path(dir, t.file)).or_default().push((t.offset, t.offset + t.len));
    }
    for e in &m.experts {
        for c in &e.copies {
            files.entry(m.copy_path(c)).or_default().push((c.offset, c.offset + c.range(e.len).1));
        }
    }
    for (path, mut used) in files {
        let Ok(f) = std::fs::File::open(&path) else { continue };
        used.sort_unstable();
        let len = f.metadata().map(|md| md.len()).unwrap_or(0);
        let want = crate::manifest::align_up(used.last().map_or(0, |u| u.1));
        if len != want {
            r.problems.push(format!("{}: {len} bytes, setup wrote {want}", path.display()));
            continue;
        }
        let mut at = 0u64;
        let mut gap = Vec::new();
        for (start, end) in used.into_iter().chain([(want, want)]) {
            if start > at {
                gap.resize((start - at) as usize, 0);
                if f.read_exact_at(&mut gap, at).is_err() || gap.iter().any(|&b| b != 0) {
                    r.problems.push(format!("{}: padding at {at}..{start} is not zero (the file was changed)", path.display()));
                }
            }
            at = at.max(end);
        }
    }
}

/// Checks one checksummed range (offset, length, xxh3) of an open file: inside the file, and
/// with `verify` matching its checksum; a problem is pushed naming `what`.
fn check_range(
    f: &std::fs::File,
    (offset, len, sum): (u64, u64, &str),
    what: &str,
    verify: bool,
    buf: &mut Vec<u8>,
    problems: &mut Vec<String>,
) {
    let file_len = f.metadata().map(|md| md.len()).unwrap_or(0);
    if file_len < offset + len {
        problems.push(format!("{what}: truncated (file is {file_len} bytes)"));
    } else if verify {
        buf.resize(len as usize, 0);
        match f.read_exact_at(buf, offset) {
            Err(e) => problems.push(format!("{what}: unreadable ({e})")),
            Ok(()) if checksum(buf) != sum => problems.push(format!("{what}: corrupt (checksum mismatch)")),
            Ok(()) => {}
        }
    }
}

/// The files setup resumes and repairs from: the setup record and every sealed sidecar.
fn check_records(dir: &Path, m: &Manifest, r: &mut DoctorReport) {
    match read_sealed::<SetupRecord>(&dir.join("setup.json")) {
        Ok(rec) if rec == m.setup => {}
        Ok(_) => r.problems.push(format!("{}: does not match the manifest's setup record", dir.join("setup.json").display())),
        Err(SealError::Missing) => r.problems.push(format!("{}: missing", dir.join("setup.json").display())),
        Err(SealError::Bad(why)) => r.problems.push(format!("{}: {why}", dir.join("setup.json").display())),
    }
    let mut sidecars = Vec::new();
    if m.layout == crate::manifest::LAYOUT_PACKS {
        sidecars.push(dir.join("spine.bin.json"));
        let mut packs: Vec<std::path::PathBuf> = m.experts.iter().flat_map(|e| e.copies.iter().map(|c| m.copy_path(c))).collect();
        // Every home has a pack per layer, even one its share left empty (small experts striped
        // over several drives): its sidecar is the store's too.
        let n = m.homes.len();
        for (h, home) in m.homes.iter().enumerate() {
            let dir = home.join(crate::setup::PACKS_DIR).join(crate::setup::pack_dir_name(&m.setup, h, n));
            packs.extend(m.layouts.iter().map(|(l, _)| dir.join(format!("L{l:03}.pack"))));
        }
        packs.sort();
        packs.dedup();
        sidecars.extend(packs.into_iter().map(|p| std::path::PathBuf::from(format!("{}.json", p.display()))));
    } else {
        sidecars.push(dir.join("inplace-spine.json"));
        // A stream store's experts are in its cache, named by their checksums: no layer sidecars.
        if m.layout != crate::manifest::LAYOUT_STREAM {
            sidecars.extend(m.layouts.iter().map(|(l, _)| dir.join(format!("inplace-L{l:03}.json"))));
        }
    }
    for p in sidecars {
        match read_sealed::<serde_json::Value>(&p) {
            Ok(v) if v.get("source_id").and_then(|s| s.as_str()) == Some(m.source_id.as_str()) => {}
            Ok(_) => r.problems.push(format!("{}: sidecar of another checkpoint", p.display())),
            Err(SealError::Missing) => r.problems.push(format!("{}: sidecar missing", p.display())),
            Err(SealError::Bad(why)) => r.problems.push(format!("{}: {why}", p.display())),
        }
    }
}

/// Repairs the store at `dir` by re-running setup with the arguments it recorded: everything is
/// re-verified and whatever is wrong is rewritten from the checkpoint.
pub fn repair(dir: &Path, progress: &dyn Progress) -> Result<Manifest> {
    let rec = setup_record(dir).ok_or_else(|| {
        Error::format(
            dir,
            format!(
                "no record of how this store was made (setup.json and manifest.json are missing, damaged, or disagree): \
                 run `deltafin setup --full --from CHECKPOINT --out {}` with its original --home/--copies/--in-place arguments",
                dir.display()
            ),
        )
    })?;
    if rec.layout == crate::manifest::LAYOUT_STREAM {
        // Everything of a stream store comes from the hub again, at the pinned commit; then
        // every shard not checked yet is checked (fetching what is not cached) and what was
        // corrupted in transit is repaired.
        let from = rec.source.to_string_lossy().into_owned();
        let mut opts = crate::setup::StreamOptions::new(from, dir);
        // The stream store as it was made: its disk budget, cache homes and whole-shard size.
        if let Ok(hub) = read_sealed::<crate::hub_cache::HubRecord>(&dir.join(crate::hub_cache::HUB_RECORD)) {
            opts.disk_budget = hub.disk_budget;
            opts.homes = hub.cache_dirs.iter().filter_map(|d| Some(d.parent()?.parent()?.to_path_buf())).collect();
            opts.whole_shard_max = hub.whole_shard_max.unwrap_or(crate::hub_cache::WHOLE_SHARD_FETCH);
        }
        crate::setup::setup_stream(&opts, progress)?;
        let mut store = crate::store::Store::open(dir)?;
        store.verify_streamed(progress)?;
        return Ok(store.manifest().clone());
    }
    if !rec.source.join("config.json").exists() {
        return Err(Error::format(
            &rec.source,
            format!(
                "the checkpoint this store was installed from is gone; put it back there, or run `{}` from where it is now",
                rec.command(dir)
            ),
        ));
    }
    let opts = SetupOptions::new(&rec.source, dir)
        .homes(rec.homes.clone())
        .layout(if rec.layout == crate::manifest::LAYOUT_IN_PLACE { ExpertLayoutKind::InPlace } else { ExpertLayoutKind::Packs })
        .copies(rec.copies)
        .drives(rec.drives.clone());
    let opts = match crate::setup::Placement::from_tag(&rec.placement) {
        Some(p) => opts.placement(p),
        None => return Err(Error::format(dir, format!("unknown placement {:?} in the setup record", rec.placement))),
    };
    crate::setup::setup(&opts, progress)
}
