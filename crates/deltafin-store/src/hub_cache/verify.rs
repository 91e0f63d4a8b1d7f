//! Checking a large shard of a stream store against the SHA-256 the hub publishes for it, and
//! repairing what was corrupted in transit.
//!
//! The hub publishes one hash per shard, so a byte of a large shard (its spine tensors in the
//! skeleton, its experts in the cache) is only known right once every byte of the shard has been
//! hashed. A check walks the shard in order: the skeleton's bytes, cached experts, and the experts
//! not cached fetched from the hub (kept when the disk budget has room, else only hashed), so
//! a store under a disk budget can be checked too. A shard that checks is recorded in
//! `hub/verified.json` with the xxh3 of every one of its experts: from then on every expert of it
//! is checked against that record whenever it is read or fetched again, and the shard's spine
//! bytes are the manifest's checksummed ones.
//!
//! A shard that does not check is fetched again whole from the hub and compared part by part. If
//! the fresh bytes match the published hash, what differs locally was corrupted in transit: a
//! spine region is rewritten in the skeleton (and its tensors' checksums in the manifest
//! resealed), a wrong cached expert replaced, and the error names each part. If the fresh bytes do
//! not match either, the hub serves wrong bytes: every cached expert of the shard is discarded
//! and the error says so. Either way the run that met the mismatch fails, since it may have
//! computed with the wrong bytes.

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::Ordering;

use deltafin_fetch::Priority as FetchPriority;
use serde::{Deserialize, Serialize};
use sha2::Digest as _;

use super::HubCache;
use crate::error::{Error, Result};
use crate::manifest::checksum;

/// The record of checked shards, under the store's [`super::HUB_DIR`].
pub const VERIFIED_RECORD: &str = "verified.json";

/// Bytes fetched or read at once while a shard is walked.
const PIECE: u64 = 64 << 20;

/// Shards checked against the hub's SHA-256: each with the xxh3 of every expert it holds, by
/// offset.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct VerifiedShards {
    pub shards: BTreeMap<String, BTreeMap<u64, String>>,
}

impl VerifiedShards {
    /// The record at `path` (none yet: empty; damaged: empty, so the shards are checked again).
    pub fn read(path: &Path) -> VerifiedShards {
        crate::manifest::read_sealed(path).unwrap_or_default()
    }
}

/// A region of a shard: a stretch of the skeleton (header, spine) or one expert.
#[derive(Clone, Copy, Debug)]
enum Region {
    Skeleton { at: u64, len: u64 },
    Expert { at: u64, len: u64 },
}

/// How a shard's regions were obtained in a pass.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// Local bytes where they are, the rest fetched.
    Local,
    /// Everything fetched again.
    Fresh,
}

impl HubCache {
    /// The shard's regions in order, covering every byte once.
    fn regions(&self, shard: &str) -> Vec<Region> {
        let size = self.files.get(shard).map_or(0, |f| f.size);
        let mut out = Vec::new();
        let mut pos = 0;
        for (&at, &len) in &self.spans[shard] {
            if at > pos {
                out.push(Region::Skeleton { at: pos, len: at - pos });
            }
            out.push(Region::Expert { at, len });
            pos = at + len;
        }
        if size > pos {
            out.push(Region::Skeleton { at: pos, len: size - pos });
        }
        out
    }

    /// Whether `shard` is checked against the hub's hash (shards fetched whole at setup are, and
    /// are not among the streamed ones).
    pub fn is_verified(&self, shard: &str) -> bool {
        !self.spans.contains_key(shard) || self.verified.lock().expect("poisoned").shards.contains_key(shard)
    }

    /// The xxh3 the check recorded for an expert of a verified shard.
    pub(super) fn verified_xxh3(&self, shard: &str, offset: u64) -> Option<String> {
        self.verified.lock().expect("poisoned").shards.get(shard)?.get(&offset).cloned()
    }

    /// Streamed shards not yet checked.
    pub fn unverified_shards(&self) -> Vec<String> {
        let v = self.verified.lock().expect("poisoned");
        let mut s: Vec<String> = self.spans.keys().filter(|s| !v.shards.contains_key(*s)).cloned().collect();
        s.sort();
        s
    }

    /// Bytes of spine tensors that lie in shards not yet checked (the engine loads them all).
    pub fn unverified_spine_bytes(&self) -> u64 {
        self.spine.iter().filter(|t| !self.is_verified(&t.shard)).map(|t| t.len).sum()
    }

    /// Checks every streamed shard not checked yet, fetching what is not local (see the module
    /// doc). Returns the parts repaired, if any (the manifest was resealed: reopen it).
    pub fn verify_all(&self, progress: &dyn crate::setup::Progress) -> Result<Vec<String>> {
        let todo = self.unverified_shards();
        let total: u64 = todo.iter().filter_map(|s| self.files.get(s)).map(|f| f.size).sum();
        progress.begin("checking shards against the hub's SHA-256", total);
        let mut repaired = Vec::new();
        for shard in todo {
            if self.stop.load(Ordering::Relaxed) {
                break;
            }
            match self.check_shard(&shard) {
                Ok(()) => {}
                Err(Error::Repaired { parts, .. }) => repaired.extend(parts),
                Err(e) => {
                    progress.end();
                    return Err(e);
                }
            }
            progress.advance(self.files.get(&shard).map_or(0, |f| f.size));
        }
        progress.end();
        Ok(repaired)
    }

    /// For `doctor`: whether the local bytes of a shard not checked yet match the hub's SHA-256,
    /// without fetching anything (`None`: not all of it is local, or the hub published no hash).
    pub fn local_check(&self, shard: &str) -> Result<Option<bool>> {
        let want = self.files.get(shard).and_then(|f| f.sha256.clone()).map(|w| w.to_ascii_lowercase());
        let Some(want) = want.filter(|_| self.missing(shard).is_empty()) else { return Ok(None) };
        Ok(Some(self.hash_shard(shard, Pass::Local, &mut |_, _| Ok(()))?.0 == want))
    }

    /// For `doctor`: the cached experts of verified shards whose files no longer hold the bytes
    /// the check recorded, as `(shard, offset)` (each file read whole).
    pub fn damaged_verified_experts(&self) -> Vec<(String, u64)> {
        let entries: Vec<((String, u64), String)> = {
            let st = self.state.lock().expect("poisoned");
            st.entries.iter().map(|(k, c)| (k.clone(), c.xxh3.clone())).collect()
        };
        let mut bad = Vec::new();
        for ((shard, offset), name_sum) in entries {
            let Some(want) = self.verified_xxh3(&shard, offset) else { continue };
            let read = std::fs::read(self.expert_path(&shard, offset, &name_sum)).ok();
            if name_sum != want || read.is_none_or(|b| checksum(&b) != want) {
                bad.push((shard, offset));
            }
        }
        bad.sort();
        bad
    }

    /// Checks `shard` against the hub's SHA-256 and records it; repairs and fails on a mismatch
    /// (see the module doc).
    pub(super) fn check_shard(&self, shard: &str) -> Result<()> {
        let _one_at_a_time = self.checking.lock().expect("poisoned");
        if self.is_verified(shard) {
            return Ok(());
        }
        let Some(want) = self.files.get(shard).and_then(|f| f.sha256.clone()).map(|w| w.to_ascii_lowercase()) else {
            // The hub published no hash: nothing can be checked, and the runs keep saying so.
            return Ok(());
        };
        let (got, sums) = self.hash_shard(shard, Pass::Local, &mut |_, _| Ok(()))?;
        self.stats.shards_verified.fetch_add(1, Ordering::Relaxed);
        if got == want {
            return self.record_verified(shard, sums);
        }
        self.stats.shard_mismatches.fetch_add(1, Ordering::Relaxed);
        // Fetch it all again and compare part by part; keep the fresh parts that differ.
        let mut differing: Vec<(Region, Vec<u8>)> = Vec::new();
        let skeleton = self.skeleton.join(shard);
        let (fresh, fresh_sums) = self.hash_shard(shard, Pass::Fresh, &mut |region, bytes| {
            let local = self.local_bytes(shard, region)?;
            if local.as_deref() != Some(bytes) {
                differing.push((region, bytes.to_vec()));
            }
            Ok(())
        })?;
        if fresh != want {
            self.discard_experts(shard);
            self.taint(format!("the hub served shard {shard} twice with bytes that do not match the SHA-256 it publishes"));
            return Err(Error::format(
                &skeleton,
                format!(
                    "the hub served this shard twice with bytes whose SHA-256 ({got}, then {fresh}) is not the one it publishes ({want}): \
                     the hub or a proxy serves wrong bytes; every cached expert of the shard was discarded"
                ),
            ));
        }
        let mut parts = Vec::new();
        let mut resealed = Vec::new();
        for (region, bytes) in &differing {
            match *region {
                Region::Skeleton { at, len } => {
                    let f = std::fs::OpenOptions::new().write(true).open(&skeleton).map_err(Error::io(&skeleton))?;
                    f.write_all_at(bytes, at).and_then(|()| f.sync_all()).map_err(Error::io(&skeleton))?;
                    let names: Vec<String> = self
                        .spine
                        .iter()
                        .filter(|t| t.shard == shard && t.offset < at + len && at < t.offset + t.len)
                        .map(|t| t.name.clone())
                        .collect();
                    if names.is_empty() {
                        parts.push(format!("bytes {at}..{} of {shard} (its header)", at + len));
                    }
                    for n in names {
                        parts.push(format!("spine tensor `{n}` (in {shard})"));
                        resealed.push(n);
                    }
                }
                Region::Expert { at, .. } => {
                    parts.push(format!("the expert at offset {at} of {shard}"));
                    let key = (shard.to_string(), at);
                    let old = self.state.lock().expect("poisoned").entries.get(&key).map(|c| c.xxh3.clone());
                    if let Some(x) = old {
                        self.forget(&key, &x);
                    }
                    self.publish(shard, at, bytes)?;
                }
            }
        }
        if !resealed.is_empty() {
            reseal_spine(&self.store, &resealed)?;
        }
        self.record_verified(shard, fresh_sums)?;
        let why = format!("{} corrupted in transit", parts.join(", "));
        self.taint(format!("{why}; repaired from the hub"));
        Err(Error::Repaired { shard: shard.to_string(), parts, path: skeleton })
    }

    /// Hashes `shard` region by region, handing each region's bytes to `each`; returns the
    /// SHA-256 and each expert's xxh3. Experts fetched in a local pass are kept in the cache when
    /// the disk budget has room for them.
    #[allow(clippy::type_complexity)]
    fn hash_shard(
        &self,
        shard: &str,
        pass: Pass,
        each: &mut dyn FnMut(Region, &[u8]) -> Result<()>,
    ) -> Result<(String, BTreeMap<u64, String>)> {
        let mut h = sha2::Sha256::new();
        let mut sums = BTreeMap::new();
        let mut buf = Vec::new();
        for region in self.regions(shard) {
            match region {
                Region::Skeleton { at, len } => {
                    let mut pos = at;
                    while pos < at + len {
                        let n = (at + len - pos).min(PIECE);
                        buf.resize(n as usize, 0);
                        let piece = Region::Skeleton { at: pos, len: n };
                        match pass {
                            Pass::Local => self.read_skeleton(shard, pos, &mut buf)?,
                            Pass::Fresh => self.hub.fetch_range_split(shard, pos, &mut buf, FetchPriority::Background)?,
                        }
                        h.update(&buf);
                        each(piece, &buf)?;
                        pos += n;
                    }
                }
                Region::Expert { at, len } => {
                    buf.resize(len as usize, 0);
                    let local = pass == Pass::Local && self.read_cached(shard, at, &mut buf);
                    if !local {
                        self.hub.fetch_range_split(shard, at, &mut buf, FetchPriority::Background)?;
                        self.stats.fetched_bytes.fetch_add(len, Ordering::Relaxed);
                        let room = self.disk_budget.is_none_or(|b| self.cached().0 + len <= b);
                        if pass == Pass::Local && room {
                            self.publish(shard, at, &buf)?;
                        }
                    }
                    h.update(&buf);
                    sums.insert(at, checksum(&buf));
                    each(region, &buf)?;
                }
            }
        }
        Ok((h.finalize().iter().map(|b| format!("{b:02x}")).collect(), sums))
    }

    fn read_skeleton(&self, shard: &str, at: u64, buf: &mut [u8]) -> Result<()> {
        let p = self.skeleton.join(shard);
        std::fs::File::open(&p).and_then(|f| f.read_exact_at(buf, at)).map_err(Error::io(&p))
    }

    /// The bytes of `region` as they are locally (`None`: an expert not cached).
    fn local_bytes(&self, shard: &str, region: Region) -> Result<Option<Vec<u8>>> {
        match region {
            Region::Skeleton { at, len } => {
                let mut b = vec![0u8; len as usize];
                self.read_skeleton(shard, at, &mut b)?;
                Ok(Some(b))
            }
            Region::Expert { at, len } => {
                if !self.contains(shard, at) {
                    return Ok(None);
                }
                let mut b = vec![0u8; len as usize];
                Ok(self.read_cached(shard, at, &mut b).then_some(b))
            }
        }
    }

    fn record_verified(&self, shard: &str, sums: BTreeMap<u64, String>) -> Result<()> {
        let mut v = self.verified.lock().expect("poisoned");
        v.shards.insert(shard.to_string(), sums);
        crate::manifest::write_sealed(&self.skeleton.join(VERIFIED_RECORD), &*v)
    }

    /// Every cached expert of `shard` removed.
    pub(super) fn discard_experts(&self, shard: &str) {
        let keys: Vec<(String, u64, String)> = {
            let st = self.state.lock().expect("poisoned");
            st.entries.iter().filter(|(k, _)| k.0 == shard).map(|(k, c)| (k.0.clone(), k.1, c.xxh3.clone())).collect()
        };
        for (s, o, x) in keys {
            self.forget(&(s, o), &x);
        }
    }

    /// Marks this cache's engine as having met wrong bytes: every later read fails with `why`.
    fn taint(&self, why: String) {
        self.tainted.lock().expect("poisoned").get_or_insert(why);
    }
}

/// A spine tensor of a streamed shard, as the manifest places it.
#[derive(Clone, Debug)]
pub(super) struct SpineSpan {
    pub name: String,
    pub shard: String,
    pub offset: u64,
    pub len: u64,
}

/// The spine tensors of `manifest` that lie in skeletons of the hub folder.
pub(super) fn spine_spans(manifest: &crate::manifest::Manifest) -> Vec<SpineSpan> {
    manifest
        .spine
        .iter()
        .filter_map(|(name, t)| {
            let file = Path::new(&manifest.spine_files[t.file]);
            let in_hub = file.parent().is_some_and(|p| p.ends_with(super::HUB_DIR));
            let shard = file.file_name()?.to_string_lossy().into_owned();
            in_hub.then(|| SpineSpan { name: name.clone(), shard, offset: t.offset, len: t.len })
        })
        .collect()
}

/// Recomputes the checksums of the spine tensors `names` from their files and reseals the store's
/// manifest and its spine sidecar, which a re-run of setup compares the skeletons with (after
/// their bytes were repaired in place).
fn reseal_spine(store: &Path, names: &[String]) -> Result<()> {
    let mut m = crate::manifest::Manifest::read(store)?;
    let side_path = store.join("inplace-spine.json");
    let mut side: Option<serde_json::Value> = crate::manifest::read_sealed(&side_path).ok();
    for n in names {
        let Some(t) = m.spine.get(n).cloned() else { continue };
        let p = m.spine_path(store, t.file);
        let mut b = vec![0u8; t.len as usize];
        std::fs::File::open(&p).and_then(|f| f.read_exact_at(&mut b, t.offset)).map_err(Error::io(&p))?;
        let sum = checksum(&b);
        if let Some(entry) = side.as_mut().and_then(|v| v.get_mut("tensors")).and_then(|ts| ts.get_mut(n)) {
            entry["xxh3"] = serde_json::Value::String(sum.clone());
        }
        m.spine.get_mut(n).expect("present").xxh3 = sum;
    }
    if let Some(side) = &side {
        crate::manifest::write_sealed(&side_path, side)?;
    }
    let cfg_path = store.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(Error::io(&cfg_path))?;
    let cfg = deltafin_core::K3Config::from_json(&text).map_err(|e| Error::format(&cfg_path, e.to_string()))?;
    crate::setup::seal(&mut m, &cfg, store)
}
