//! Routed experts of a store: aligned pack files over the homes, or spans of the checkpoint's
//! shards (in place), one MoE layer at a time, each layer finished by a sealed sidecar per file.
//!
//! A layer whose sidecars are complete is read back and checked, never skipped on trust: a
//! damaged pack is rewritten from the checkpoint (packs) or reported as a changed checkpoint
//! (in place, where the shards are the store).

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{assign_homes, crash_point, ExpertLayoutKind, Install, Progress, SpanSource, PACKS_DIR};
use crate::checkpoint::ExpertSpan;
use crate::error::{Error, Result};
use crate::manifest::{align_up, checksum, read_sealed, rename_synced, tmp_path, write_sealed, Copy, ExpertEntry};

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
}

/// Installs every MoE layer's experts; returns the record layouts and the manifest entries.
pub(super) fn install(plan: &Install, kind: ExpertLayoutKind, progress: &dyn Progress) -> Result<(Vec<RecordLayout>, Vec<ExpertEntry>)> {
    let cfg = plan.ckpt.config();
    let moe = cfg.moe_layers();
    let copies = match kind {
        ExpertLayoutKind::InPlace => 1,
        ExpertLayoutKind::Packs => plan.record.copies,
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
        let copy = Copy { home: 0, file: rel.to_string_lossy().into_owned(), offset: s.offset };
        entries.push(ExpertEntry { layer: l, expert: e, len: s.len, xxh3: sum, copies: vec![copy] });
    }
    let bytes = spans.iter().map(|s| s.len).sum();
    write_sealed(
        &side_path,
        &LayerSidecar { source_id: plan.record.source_id.clone(), pack_dir: String::new(), home: 0, bytes, experts: table },
    )?;
    Ok(entries)
}

/// Whether `path` is exactly the pack `table` describes.
fn pack_is_intact(path: &Path, table: &Table) -> bool {
    let ranges: Vec<(u64, u64, &str)> = table.values().map(|(o, l, s)| (*o, *l, s.as_str())).collect();
    super::readback::is_exact(path, &ranges, &super::NoProgress)
}

fn pack_layer(plan: &Install, l: usize, spans: &[ExpertSpan], progress: &dyn Progress) -> Result<Vec<ExpertEntry>> {
    let n = plan.homes.len();
    let copies = plan.record.copies;
    let rels: Vec<String> = plan.pack_dirs.iter().map(|d| format!("{PACKS_DIR}/{d}/L{l:03}.pack")).collect();
    let paths: Vec<PathBuf> = plan.homes.iter().zip(&rels).map(|(h, r)| h.join(r)).collect();
    let sides: Vec<PathBuf> = paths.iter().map(|p| PathBuf::from(format!("{}.json", p.display()))).collect();
    let assigned: Vec<Vec<usize>> =
        (0..n).map(|h| (0..spans.len()).filter(|&e| assign_homes(l, e, n, copies).contains(&h)).collect()).collect();
    let existing: Vec<Option<LayerSidecar>> = (0..n)
        .map(|h| {
            read_sealed::<LayerSidecar>(&sides[h]).ok().filter(|s| {
                s.source_id == plan.record.source_id
                    && s.pack_dir == plan.pack_dirs[h]
                    && s.home == h
                    && s.experts.keys().copied().eq(assigned[h].iter().copied())
            })
        })
        .collect();
    let layer_bytes = spans.iter().map(|s| s.len).sum::<u64>() * copies as u64;
    let sizes_match =
        (0..n).all(|h| existing[h].as_ref().is_some_and(|s| std::fs::metadata(&paths[h]).map(|m| m.len()).ok() == Some(s.bytes)));
    // Every copy of an expert must carry the same checksum (the same checkpoint bytes).
    let agree = (0..spans.len()).all(|e| {
        let sums: Vec<&String> = existing.iter().flatten().filter_map(|s| s.experts.get(&e)).map(|x| &x.2).collect();
        sums.windows(2).all(|w| w[0] == w[1])
    });
    if sizes_match && agree && (0..n).all(|h| pack_is_intact(&paths[h], &existing[h].as_ref().expect("complete").experts)) {
        progress.advance(layer_bytes);
        let tables: Vec<&Table> = existing.iter().map(|s| &s.as_ref().expect("complete").experts).collect();
        return Ok(entries(l, spans.len(), n, copies, &rels, |h| tables[h]));
    }
    if existing.iter().any(Option::is_some) {
        eprintln!("deltafin setup: the packs of layer {l} are incomplete or damaged; rewriting them");
    }
    let recorded = |e: usize| -> Option<String> {
        existing
            .iter()
            .flatten()
            .find_map(|s| s.experts.get(&e))
            .map(|x| x.2.clone())
            .or_else(|| plan.earlier_expert(l, e).map(str::to_string))
    };
    let tmps: Vec<PathBuf> = paths.iter().map(|p| tmp_path(p)).collect();
    let written = (|| -> Result<Vec<Table>> {
        let files: Vec<File> = tmps.iter().map(|t| File::create(t).map_err(Error::io(t))).collect::<Result<_>>()?;
        let mut offsets = vec![0u64; n];
        let mut tables = vec![Table::new(); n];
        let mut buf = Vec::new();
        for (e, s) in spans.iter().enumerate() {
            buf.resize(s.len as usize, 0);
            plan.src.read_span(&s.file, s.offset, &mut buf)?;
            let sum = checksum(&buf);
            plan.check_source(&format!("expert {l}/{e}"), &s.file, &sum, recorded(e).as_deref())?;
            for h in assign_homes(l, e, n, copies) {
                files[h].write_all_at(&buf, offsets[h]).map_err(Error::io(&tmps[h]))?;
                tables[h].insert(e, (offsets[h], s.len, sum.clone()));
                offsets[h] = align_up(offsets[h] + s.len);
                progress.advance(s.len);
            }
        }
        for h in 0..n {
            files[h].set_len(offsets[h]).map_err(Error::io(&tmps[h]))?;
            files[h].sync_all().map_err(Error::io(&tmps[h]))?;
            super::drop_cache(&files[h]);
        }
        Ok(tables)
    })();
    let tables = match written {
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
        let side = LayerSidecar {
            source_id: plan.record.source_id.clone(),
            pack_dir: plan.pack_dirs[h].clone(),
            home: h,
            bytes,
            experts: tables[h].clone(),
        };
        write_sealed(&sides[h], &side)?;
    }
    Ok(entries(l, spans.len(), n, copies, &rels, |h| &tables[h]))
}

fn entries<'t>(l: usize, count: usize, n: usize, copies: usize, rels: &[String], table: impl Fn(usize) -> &'t Table) -> Vec<ExpertEntry> {
    (0..count)
        .map(|e| {
            let hs = assign_homes(l, e, n, copies);
            let (_, len, sum) = table(hs[0])[&e].clone();
            let copies = hs.iter().map(|&h| Copy { home: h, file: rels[h].clone(), offset: table(h)[&e].0 }).collect();
            ExpertEntry { layer: l, expert: e, len, xxh3: sum, copies }
        })
        .collect()
}
