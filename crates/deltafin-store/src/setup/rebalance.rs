//! `deltafin setup --rebalance`: lay an installed store's experts out again over other homes (a
//! drive added or removed) or another placement, reading them from the store itself, so neither
//! the checkpoint nor a reinstall is needed; the spine and small files stay as they are.
//!
//! **Crash safety.** The store as it was is saved sealed (`rebalance-from.json`) and the new plan
//! recorded (`setup.json`) before anything moves; the manifest is removed until the end. Layer by
//! layer, the new packs are written like setup's (temporary names, sealed sidecars), and only
//! once they are sealed are that layer's old packs removed. A re-run reads the saved store, finds
//! the layers already moved intact (read back against their sidecars) and goes on; a layer whose
//! old copy is gone or unreadable is read from the checkpoint if it is still where it was. At
//! most one layer is held twice, which the free-space check before starting accounts for.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::experts::{write_layer_packs, PackTarget};
use super::placement::{Layout, Placement};
use super::{check_copies, crash_point, pack_dir_name, plan, seal, stated, Progress, SetupOptions, PACKS_DIR, SETUP_RECORD};
use crate::error::{Error, Result};
use crate::lock::DirLock;
use crate::manifest::{checksum, read_sealed, sync_dir, write_sealed, ExpertEntry, Manifest, SealError, SetupRecord, LAYOUT_PACKS};
use crate::reader::{open_for_read, read_aligned, CacheMode};

/// The store as it was when a rebalance began.
const REBALANCE_FROM: &str = "rebalance-from.json";

/// Moves the store at `opts.out` onto `opts.homes` with `opts`' placement.
pub(super) fn rebalance(opts: &SetupOptions, progress: &dyn Progress) -> Result<Manifest> {
    let out = &opts.out;
    let _store_lock = DirLock::acquire(out)?;
    let from_path = out.join(REBALANCE_FROM);
    let resuming = from_path.exists();
    let old: Manifest = match read_sealed(&from_path) {
        Ok(m) => m,
        Err(SealError::Missing) => Manifest::read(out).map_err(|e| {
            Error::format(
                out,
                format!("nothing to rebalance: {e} (rebalance moves a finished store; set one up first with `deltafin setup`)"),
            )
        })?,
        Err(SealError::Bad(why)) => {
            return Err(Error::format(&from_path, format!("{why}; the store as it was before the rebalance cannot be read")))
        }
    };
    if old.layout != LAYOUT_PACKS {
        return Err(Error::format(
            out,
            format!("this store's layout is {}: only copied stores (setup --full without --in-place) have packs to move", old.layout),
        ));
    }
    let cfg_path = out.join("config.json");
    let cfg_text = std::fs::read(&cfg_path).map_err(Error::io(&cfg_path))?;
    if old.files.get("config.json").map(|f| f.xxh3.as_str()) != Some(checksum(&cfg_text).as_str()) {
        return Err(Error::BadStore { path: cfg_path, why: "config.json does not match its checksum".into(), advice: old.advice(out) });
    }
    let cfg =
        deltafin_core::K3Config::from_json(&String::from_utf8_lossy(&cfg_text)).map_err(|e| Error::format(&cfg_path, e.to_string()))?;
    check_copies(opts, out)?;
    let mut homes = Vec::new();
    for h in &opts.homes {
        std::fs::create_dir_all(h).map_err(Error::io(h))?;
        homes.push(std::fs::canonicalize(h).map_err(Error::io(h))?);
    }
    let placement = opts.placement_kind();
    let mut record = SetupRecord {
        homes: homes.clone(),
        copies: opts.copies,
        placement: placement.tag().into(),
        shares: Vec::new(),
        drives: stated(&opts.drives),
        ..old.setup.clone()
    };
    let homes = if homes.is_empty() { vec![std::fs::canonicalize(out).map_err(Error::io(out))?] } else { homes };
    let in_progress = read_sealed::<SetupRecord>(&out.join(SETUP_RECORD)).ok().filter(|_| resuming);
    let recorded = in_progress.as_ref().and_then(|p| {
        let same = p.homes == record.homes && p.copies == record.copies && p.placement == record.placement && p.drives == record.drives;
        same.then(|| p.shares.clone())
    });
    if let (Some(p), None) = (&in_progress, &recorded) {
        return Err(Error::OtherCheckpoint {
            path: out.to_path_buf(),
            why: format!("a rebalance onto another plan is in progress; finish it first with `{} --rebalance`", p.command(out)),
        });
    }
    let layers = cfg.moe_layers();
    let layout = if placement == Placement::RoundRobin {
        Layout::new(placement, record.copies, vec![1.0 / homes.len() as f64; homes.len()], &layers, cfg.num_experts)
    } else {
        let facts = match &recorded {
            Some(_) => homes.iter().map(|_| (u64::MAX, "recorded", 1.0, "recorded")).collect(),
            None => plan::drive_facts(&homes, &opts.drives, &BTreeMap::new(), &plan::held_by_device(&old))?,
        };
        let (planned, layout) = plan::layout_plan(&cfg, placement, record.copies, &homes, &facts, recorded.filter(|s| !s.is_empty()))?;
        record.shares = planned.shares;
        layout
    };
    let same_plan = |p: &SetupRecord| {
        p.homes == record.homes && p.copies == record.copies && p.placement == record.placement && p.shares == record.shares
    };
    if !resuming && same_plan(&old.setup) {
        eprintln!("deltafin setup: the store is already laid out so; nothing to move");
        return Ok(old);
    }
    let pack_dirs: Vec<String> = (0..homes.len()).map(|h| pack_dir_name(&record, h, homes.len())).collect();
    let new_dirs: Vec<PathBuf> = homes.iter().zip(&pack_dirs).map(|(h, d)| h.join(PACKS_DIR).join(d)).collect();
    let old_dirs: BTreeSet<PathBuf> = old
        .experts
        .iter()
        .flat_map(|e| e.copies.iter().map(|c| old.copy_path(c).parent().expect("a pack in a folder").to_path_buf()))
        .collect();
    let mut locks = Vec::new();
    for d in &new_dirs {
        std::fs::create_dir_all(d).map_err(Error::io(d))?;
        locks.push(DirLock::acquire(d)?);
    }
    for d in old_dirs.iter().filter(|d| d.exists() && !new_dirs.contains(d)) {
        locks.push(DirLock::acquire(d)?);
    }
    check_space(&old, &layout, &homes, &new_dirs, &cfg)?;
    if !resuming {
        write_sealed(&from_path, &old)?;
    }
    write_sealed(&out.join(SETUP_RECORD), &record)?;
    super::remove_if_present(&out.join("manifest.json"))?;
    sync_dir(out)?;

    let index: HashMap<(usize, usize), &ExpertEntry> = old.experts.iter().map(|e| ((e.layer, e.expert), e)).collect();
    let earlier: HashMap<(usize, usize), String> = old.experts.iter().map(|e| ((e.layer, e.expert), e.xxh3.clone())).collect();
    let target = PackTarget { source_id: &record.source_id, homes: &homes, pack_dirs: &pack_dirs, layout: &layout, earlier: &earlier };
    let len = cfg.expert_shape().total_bytes() as u64;
    let reader = OldCopies { old: &old, files: Default::default(), checkpoint: Default::default() };
    progress.begin("rebalance", len * (layers.len() * cfg.num_experts) as u64);
    let mut experts = Vec::new();
    for (done, &l) in layers.iter().enumerate() {
        let fetch = |e: usize, buf: &mut Vec<u8>, _: Option<&str>| reader.read(index[&(l, e)], buf);
        let entries = write_layer_packs(&target, l, cfg.num_experts, len, &fetch, progress)?;
        // The new packs of this layer are sealed: the old ones can go.
        let new_files: BTreeSet<PathBuf> = entries.iter().flat_map(|e| e.copies.iter().map(|c| homes[c.home].join(&c.file))).collect();
        for f in old_packs(&old, l).difference(&new_files) {
            super::remove_if_present(f)?;
            super::remove_if_present(&PathBuf::from(format!("{}.json", f.display())))?;
        }
        experts.extend(entries);
        crash_point(done + 1);
    }
    progress.end();
    let mut manifest = Manifest { homes: homes.clone(), setup: record, experts, ..old.clone() };
    seal(&mut manifest, &cfg, out)?;
    super::remove_if_present(&from_path)?;
    drop(locks);
    for d in old_dirs.iter().filter(|d| !new_dirs.contains(d)) {
        if d.exists() {
            std::fs::remove_dir_all(d).map_err(Error::io(d))?;
        }
    }
    sync_dir(out)?;
    Ok(manifest)
}

/// Reads experts from the store as it was: whole copies or stripes (direct I/O), each checked
/// against its checksum; failing that, from the checkpoint if it is still where it was.
struct OldCopies<'a> {
    old: &'a Manifest,
    files: std::sync::Mutex<HashMap<PathBuf, std::sync::Arc<std::fs::File>>>,
    checkpoint: std::sync::OnceLock<Option<crate::checkpoint::Checkpoint>>,
}

impl OldCopies<'_> {
    fn read(&self, e: &ExpertEntry, buf: &mut Vec<u8>) -> Result<String> {
        let mut why = Vec::new();
        let attempts: Vec<Vec<&crate::manifest::Copy>> =
            if e.is_striped() { vec![e.copies.iter().collect()] } else { e.copies.iter().map(|c| vec![c]).collect() };
        for parts in attempts {
            buf.resize(e.len as usize, 0);
            match parts.iter().try_for_each(|c| self.read_part(c, e.len, buf)) {
                Ok(()) if checksum(buf) == e.xxh3 => return Ok(e.xxh3.clone()),
                Ok(()) => why.push(format!("{}: checksum mismatch", self.old.copy_path(parts[0]).display())),
                Err(err) => why.push(err),
            }
        }
        // From the checkpoint, if it is still there and unchanged for this expert.
        let ckpt = self.checkpoint.get_or_init(|| crate::checkpoint::Checkpoint::open(&self.old.setup.source).ok());
        if let Some(ckpt) = ckpt {
            if let Ok((_, spans)) = ckpt.expert_spans(e.layer) {
                let s = &spans[e.expert];
                buf.resize(s.len as usize, 0);
                let read = std::fs::File::open(&s.file).and_then(|f| std::os::unix::fs::FileExt::read_exact_at(&f, buf, s.offset));
                if read.is_ok() && checksum(buf) == e.xxh3 {
                    eprintln!("deltafin setup: expert {}/{} read from the checkpoint ({})", e.layer, e.expert, why.join("; "));
                    return Ok(e.xxh3.clone());
                }
            }
        }
        Err(Error::Unavailable {
            layer: e.layer,
            expert: e.expert,
            last: format!(
                "{}; and the checkpoint at {} cannot supply it: put the drive or the checkpoint back and re-run the rebalance",
                why.join("; "),
                self.old.setup.source.display()
            ),
        })
    }

    fn read_part(&self, c: &crate::manifest::Copy, len: u64, buf: &mut [u8]) -> std::result::Result<(), String> {
        let path = self.old.copy_path(c);
        let (start, n) = c.range(len);
        let file = {
            let mut files = self.files.lock().expect("poisoned");
            match files.get(&path) {
                Some(f) => f.clone(),
                None => {
                    let f = std::sync::Arc::new(open_for_read(&path, CacheMode::Direct).map_err(|e| format!("{}: {e}", path.display()))?.0);
                    files.insert(path.clone(), f.clone());
                    f
                }
            }
        };
        let (a, b) = crate::reader::aligned_window(c.offset, n);
        let mut window = vec![0u8; (b - a) as usize + crate::memory::BUF_ALIGN];
        let skew = window.as_ptr().align_offset(crate::memory::BUF_ALIGN);
        let at = read_aligned(&file, c.offset, n, &mut window[skew..]).map_err(|e| format!("{}: {e}", path.display()))?;
        buf[start as usize..(start + n) as usize].copy_from_slice(&window[skew + at..skew + at + n as usize]);
        Ok(())
    }
}

/// Checks each file system has room for the move: layer by layer, the new packs of a layer are
/// written before its old ones are removed, so the peak is the largest running excess of new
/// over old bytes. Files already moved (a resumed rebalance) need nothing.
fn check_space(old: &Manifest, layout: &Layout, homes: &[PathBuf], new_dirs: &[PathBuf], cfg: &deltafin_core::K3Config) -> Result<()> {
    let len = cfg.expert_shape().total_bytes() as u64;
    let dev = |p: &Path| -> Result<u64> {
        let at = plan::existing(p);
        Ok(std::fs::metadata(&at).map_err(Error::io(&at))?.dev())
    };
    /// One file system: a folder on it, bytes added so far less bytes freed, and the peak.
    struct Fs {
        path: PathBuf,
        running: i128,
        peak: i128,
    }
    let mut by_dev: BTreeMap<u64, Fs> = BTreeMap::new();
    for l in cfg.moe_layers() {
        // This layer's new packs (not yet in place) are written, then its old packs go.
        let mut added: BTreeMap<u64, (PathBuf, i128)> = BTreeMap::new();
        for (h, b) in layout.layer_bytes(l, len).into_iter().enumerate() {
            let have = std::fs::metadata(new_dirs[h].join(format!("L{l:03}.pack"))).map(|m| m.len()).ok();
            added.entry(dev(&homes[h])?).or_insert((homes[h].clone(), 0)).1 += if have == Some(b) { 0 } else { b as i128 };
        }
        let mut freed: BTreeMap<u64, i128> = BTreeMap::new();
        for f in old_packs(old, l) {
            if let Ok(md) = std::fs::metadata(&f) {
                *freed.entry(md.dev()).or_default() += md.len() as i128;
                added.entry(md.dev()).or_insert((f, 0));
            }
        }
        for (d, (path, add)) in added {
            let fs = by_dev.entry(d).or_insert(Fs { path, running: 0, peak: 0 });
            fs.running += add;
            fs.peak = fs.peak.max(fs.running);
            fs.running -= freed.get(&d).copied().unwrap_or(0);
        }
    }
    for fs in by_dev.into_values() {
        let free = super::space::free_bytes(&plan::existing(&fs.path))?;
        if fs.peak > free as i128 {
            return Err(Error::NoSpace { path: fs.path, need: fs.peak as u64, free });
        }
    }
    Ok(())
}

/// The pack files of layer `l` in the store as it was.
fn old_packs(old: &Manifest, l: usize) -> BTreeSet<PathBuf> {
    old.experts.iter().filter(|e| e.layer == l).flat_map(|e| e.copies.iter().map(|c| old.copy_path(c))).collect()
}
