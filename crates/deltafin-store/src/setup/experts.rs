//! Routed experts of a store: aligned pack files over the homes, or spans of the checkpoint's
//! shards (in place), one MoE layer at a time, each layer finished by a sealed sidecar per file.
//!
//! A layer whose sidecars are complete is read back and checked, never skipped on trust: a
//! damaged pack is rewritten from the checkpoint (packs) or reported as a changed checkpoint
//! (in place, where the shards are the store).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::placement::Slot;
use super::{crash_point, ExpertLayoutKind, Install, Progress, SpanSource, PACKS_DIR};
use crate::checkpoint::ExpertSpan;
use crate::error::{Error, Result};
use crate::manifest::{align_up, checksum, read_sealed, rename_synced, tmp_path, write_sealed, Copy, ExpertEntry, Stripe};

/// A layer's record offsets within an expert span.
type RecordLayout = (usize, [usize; 6]);

/// expert -> (offset, len, xxh3)
type Table = BTreeMap<usize, (u64, u64, String)>;

/// Sidecar of one finished pack file (or of one in-place layer).
#[derive(Serialize, Deserialize)]
struct LayerSidecar {
    source_id: String,
    /// The pack folder and home index this pack was written for (empty and 0 in place).
    pack_dir: String,
    home: usize,
    bytes: u64,
    experts: Table,
    /// For experts this file holds a stripe of: the whole expert's checksum (the table has the
    /// stripe's).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    whole: BTreeMap<usize, String>,
}

/// Installs every MoE layer's experts; returns the record layouts and the manifest entries.
pub(super) fn install(plan: &Install, kind: ExpertLayoutKind, progress: &dyn Progress) -> Result<(Vec<RecordLayout>, Vec<ExpertEntry>)> {
    let cfg = plan.ckpt.config();
    let moe = cfg.moe_layers();
    // Striped and weighted layouts hold one copy of every byte (their `copies` is 1).
    let copies = match kind {
        ExpertLayoutKind::InPlace => 1,
        ExpertLayoutKind::Packs => plan.layout.copies,
    };
    let per_layer = cfg.expert_shape().total_bytes() as u64 * (cfg.num_experts * copies) as u64;
    progress.begin("experts", per_layer * moe.len() as u64);
    let mut layouts = Vec::new();
    let mut entries = Vec::new();
    for (done, &l) in moe.iter().enumerate() {
        let (layout, spans) = plan.ckpt.expert_spans(l)?;
        layouts.push((l, layout.offsets));
        entries.extend(match kind {
            ExpertLayoutKind::InPlace => in_place_layer(plan, l, &spans, progress)?,
            ExpertLayoutKind::Packs => pack_layer(plan, l, &spans, progress)?,
        });
        crash_point(done + 1);
    }
    progress.end();
    Ok((layouts, entries))
}

fn in_place_layer(plan: &Install, l: usize, spans: &[ExpertSpan], progress: &dyn Progress) -> Result<Vec<ExpertEntry>> {
    let side_path = plan.out.join(format!("inplace-L{l:03}.json"));
    let side: Option<LayerSidecar> = read_sealed(&side_path).ok().filter(|s: &LayerSidecar| s.source_id == plan.record.source_id);
    let home = &plan.homes[0];
    let mut table = Table::new();
    let mut entries = Vec::new();
    let mut buf = Vec::new();
    for (e, s) in spans.iter().enumerate() {
        let rel = s.file.strip_prefix(plan.ckpt.dir()).unwrap_or(&s.file).to_path_buf();
        let file = home.join(&rel);
        let sum = plan.src.span_checksum(&file, s.offset, s.len, &mut buf)?;
        let recorded =
            side.as_ref().and_then(|t| t.experts.get(&e)).map(|x| x.2.clone()).or_else(|| plan.earlier_expert(l, e).map(str::to_string));
        plan.check_source(&format!("expert {l}/{e}"), &file, &sum, recorded.as_deref())?;
        progress.advance(s.len);
        table.insert(e, (s.offset, s.len, sum.clone()));
        let copy = Copy::whole(0, rel.to_string_lossy().into_owned(), s.offset);
        entries.push(ExpertEntry { layer: l, expert: e, len: s.len, xxh3: sum, copies: vec![copy] });
    }
    let bytes = spans.iter().map(|s| s.len).sum();
    write_sealed(
        &side_path,
        &LayerSidecar {
            source_id: plan.record.source_id.clone(),
            pack_dir: String::new(),
            home: 0,
            bytes,
            experts: table,
            whole: BTreeMap::new(),
        },
    )?;
    Ok(entries)
}

/// Whether `path` is exactly the pack `table` describes.
fn pack_is_intact(path: &Path, table: &Table) -> bool {
    let ranges: Vec<(u64, u64, &str)> = table.values().map(|(o, l, s)| (*o, *l, s.as_str())).collect();
    super::readback::is_exact(path, &ranges, &super::NoProgress)
}

/// Fills the buffer with expert `e`'s bytes, checked, and returns their checksum; the argument
/// is the checksum an earlier run recorded for them, if any.
pub(super) type FetchExpert<'a> = dyn Fn(usize, &mut Vec<u8>, Option<&str>) -> Result<String> + 'a;

fn pack_layer(plan: &Install, l: usize, spans: &[ExpertSpan], progress: &dyn Progress) -> Result<Vec<ExpertEntry>> {
    let fetch = |e: usize, buf: &mut Vec<u8>, recorded: Option<&str>| -> Result<String> {
        let s = &spans[e];
        buf.resize(s.len as usize, 0);
        plan.src.read_span(&s.file, s.offset, buf)?;
        let sum = checksum(buf);
        plan.check_source(&format!("expert {l}/{e}"), &s.file, &sum, recorded)?;
        Ok(sum)
    };
    write_layer_packs(&plan.target(), l, spans.len(), spans.first().map_or(0, |s| s.len), &fetch, progress)
}

/// Where a layer's packs go: the homes, their pack folders and the layout over them.
pub(super) struct PackTarget<'a> {
    pub source_id: &'a str,
    pub homes: &'a [PathBuf],
    pub pack_dirs: &'a [String],
    pub layout: &'a super::Layout,
    /// Checksums an earlier run recorded, by (layer, expert).
    pub earlier: &'a HashMap<(usize, usize), String>,
}

impl Install<'_> {
    pub(super) fn target(&self) -> PackTarget<'_> {
        PackTarget {
            source_id: &self.record.source_id,
            homes: &self.homes,
            pack_dirs: &self.pack_dirs,
            layout: &self.layout,
            earlier: &self.earlier_experts,
        }
    }
}

/// Writes (or finds intact) the packs of MoE layer `l` on every home, as `plan.layout` places
/// its `count` experts of `len` bytes, taking each expert's bytes from `fetch`.
pub(super) fn write_layer_packs(
    plan: &PackTarget<'_>,
    l: usize,
    count: usize,
    len: u64,
    fetch: &FetchExpert<'_>,
    progress: &dyn Progress,
) -> Result<Vec<ExpertEntry>> {
    let n = plan.homes.len();
    let rels: Vec<String> = plan.pack_dirs.iter().map(|d| format!("{PACKS_DIR}/{d}/L{l:03}.pack")).collect();
    let paths: Vec<PathBuf> = plan.homes.iter().zip(&rels).map(|(h, r)| h.join(r)).collect();
    let sides: Vec<PathBuf> = paths.iter().map(|p| PathBuf::from(format!("{}.json", p.display()))).collect();
    let slots: Vec<Vec<Slot>> = (0..count).map(|e| plan.layout.slots(l, e, len)).collect();
    // What each home holds of each expert: (expert, bytes).
    let assigned: Vec<Vec<(usize, u64)>> =
        (0..n).map(|h| (0..count).flat_map(|e| slots[e].iter().filter(|s| s.home == h).map(move |s| (e, s.len))).collect()).collect();
    let existing: Vec<Option<LayerSidecar>> = (0..n)
        .map(|h| {
            read_sealed::<LayerSidecar>(&sides[h]).ok().filter(|s| {
                s.source_id == plan.source_id
                    && s.pack_dir == plan.pack_dirs[h]
                    && s.home == h
                    && s.experts.iter().map(|(e, x)| (*e, x.1)).eq(assigned[h].iter().copied())
            })
        })
        .collect();
    let layer_bytes: u64 = slots.iter().flatten().map(|s| s.len).sum();
    let sizes_match =
        (0..n).all(|h| existing[h].as_ref().is_some_and(|s| std::fs::metadata(&paths[h]).map(|m| m.len()).ok() == Some(s.bytes)));
    // The checksum each home's sidecar records for the whole of expert `e`.
    let whole_sum = |s: &LayerSidecar, e: usize| -> Option<String> { s.whole.get(&e).or_else(|| s.experts.get(&e).map(|x| &x.2)).cloned() };
    // Every home must agree on each expert's checksum (the same checkpoint bytes).
    let agree = (0..count).all(|e| {
        let sums: Vec<String> = existing.iter().flatten().filter_map(|s| whole_sum(s, e)).collect();
        sums.windows(2).all(|w| w[0] == w[1])
    });
    let intact = || (0..n).all(|h| pack_is_intact(&paths[h], &existing[h].as_ref().expect("complete").experts));
    if sizes_match && agree && intact() {
        progress.advance(layer_bytes);
        let sums: Vec<String> =
            (0..count).map(|e| existing.iter().flatten().find_map(|s| whole_sum(s, e)).expect("every expert is on some home")).collect();
        let tables: Vec<&Table> = existing.iter().map(|s| &s.as_ref().expect("complete").experts).collect();
        return Ok(entries(l, &slots, &sums, &rels, |h| tables[h]));
    }
    if existing.iter().any(Option::is_some) {
        eprintln!("deltafin setup: the packs of layer {l} are incomplete or damaged; rewriting them");
    }
    let recorded = |e: usize| -> Option<String> {
        existing.iter().flatten().find_map(|s| whole_sum(s, e)).or_else(|| plan.earlier.get(&(l, e)).cloned())
    };
    let tmps: Vec<PathBuf> = paths.iter().map(|p| tmp_path(p)).collect();
    let written = (|| -> Result<(Vec<Table>, Vec<String>)> {
        let files: Vec<File> = tmps.iter().map(|t| File::create(t).map_err(Error::io(t))).collect::<Result<_>>()?;
        let mut offsets = vec![0u64; n];
        let mut tables = vec![Table::new(); n];
        let mut sums = Vec::with_capacity(count);
        let mut buf = Vec::new();
        for (e, expert_slots) in slots.iter().enumerate() {
            let sum = fetch(e, &mut buf, recorded(e).as_deref())?;
            for s in expert_slots {
                let h = s.home;
                let part = &buf[s.start as usize..(s.start + s.len) as usize];
                files[h].write_all_at(part, offsets[h]).map_err(Error::io(&tmps[h]))?;
                let part_sum = if s.stripe { checksum(part) } else { sum.clone() };
                tables[h].insert(e, (offsets[h], s.len, part_sum));
                offsets[h] = align_up(offsets[h] + s.len);
                progress.advance(s.len);
            }
            sums.push(sum);
        }
        for h in 0..n {
            files[h].set_len(offsets[h]).map_err(Error::io(&tmps[h]))?;
            files[h].sync_all().map_err(Error::io(&tmps[h]))?;
            super::drop_cache(&files[h]);
        }
        Ok((tables, sums))
    })();
    let (tables, sums) = match written {
        Ok(t) => t,
        Err(e) => {
            for t in &tmps {
                let _ = std::fs::remove_file(t);
            }
            return Err(e);
        }
    };
    for h in 0..n {
        rename_synced(&tmps[h], &paths[h])?;
        let bytes = tables[h].values().map(|(o, len, _)| align_up(o + len)).max().unwrap_or(0);
        let whole = slots
            .iter()
            .enumerate()
            .filter(|(_, ss)| ss.iter().any(|s| s.home == h && s.stripe))
            .map(|(e, _)| (e, sums[e].clone()))
            .collect();
        let side = LayerSidecar {
            source_id: plan.source_id.to_string(),
            pack_dir: plan.pack_dirs[h].clone(),
            home: h,
            bytes,
            experts: tables[h].clone(),
            whole,
        };
        write_sealed(&sides[h], &side)?;
    }
    Ok(entries(l, &slots, &sums, &rels, |h| &tables[h]))
}

fn entries<'t>(l: usize, slots: &[Vec<Slot>], sums: &[String], rels: &[String], table: impl Fn(usize) -> &'t Table) -> Vec<ExpertEntry> {
    slots
        .iter()
        .enumerate()
        .map(|(e, ss)| {
            let len = if ss.iter().any(|s| s.stripe) { ss.iter().map(|s| s.len).sum() } else { ss[0].len };
            let copies = ss
                .iter()
                .map(|s| {
                    let (offset, _, part_sum) = table(s.home)[&e].clone();
                    let stripe = s.stripe.then_some(Stripe { start: s.start, len: s.len, xxh3: part_sum });
                    Copy { home: s.home, file: rels[s.home].clone(), offset, stripe }
                })
                .collect();
            ExpertEntry { layer: l, expert: e, len, xxh3: sums[e].clone(), copies }
        })
        .collect()
}
