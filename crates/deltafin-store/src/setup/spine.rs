//! The spine of a store: copied into one aligned `spine.bin`, or left in the checkpoint's shards
//! (in place). Either way every tensor gets a checksum, recorded in a sealed sidecar and then the
//! manifest, and checked whenever the spine is loaded.

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use deltafin_core::LM_PREFIX;
use serde::{Deserialize, Serialize};

use super::{write_file_atomically, Install, Progress, SpanSource};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::manifest::{align_up, checksum, read_sealed, write_sealed, SpineTensor};

/// Sidecar of the spine: which checkpoint it came from and each tensor's place and checksum.
#[derive(Serialize, Deserialize)]
struct SpineSidecar {
    source_id: String,
    bytes: u64,
    tensors: BTreeMap<String, SpineTensor>,
}

/// Names of the spine tensors of a checkpoint (everything of the language model but the routed
/// experts), sorted.
pub(crate) fn spine_names(ckpt: &Checkpoint) -> Vec<String> {
    let mut v: Vec<String> =
        ckpt.tensors().keys().filter(|n| n.starts_with(LM_PREFIX) && !n.contains(".block_sparse_moe.experts.")).cloned().collect();
    v.sort();
    v
}

/// Bytes `spine.bin` will take: each tensor aligned, in name order.
pub(crate) fn spine_file_bytes(ckpt: &Checkpoint) -> u64 {
    spine_names(ckpt).iter().fold(0, |off, n| align_up(off + ckpt.tensors()[n].len))
}

/// Same place, shape and type (checksums aside).
fn same_place(a: &BTreeMap<String, SpineTensor>, b: &BTreeMap<String, SpineTensor>) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|((na, ta), (nb, tb))| {
            na == nb && ta.file == tb.file && ta.offset == tb.offset && ta.len == tb.len && ta.dtype == tb.dtype && ta.shape == tb.shape
        })
}

/// Writes (or verifies and keeps) `STORE/spine.bin`.
pub(super) fn write_spine_file(plan: &Install, progress: &dyn Progress) -> Result<(Vec<PathBuf>, BTreeMap<String, SpineTensor>)> {
    let ckpt = plan.ckpt;
    let path = plan.out.join("spine.bin");
    let side_path = plan.out.join("spine.bin.json");
    let mut planned = BTreeMap::new();
    let mut off = 0u64;
    for n in spine_names(ckpt) {
        let t = &ckpt.tensors()[&n];
        planned.insert(
            n,
            SpineTensor { dtype: format!("{:?}", t.dtype), shape: t.shape.clone(), file: 0, offset: off, len: t.len, xxh3: String::new() },
        );
        off = align_up(off + t.len);
    }
    let total = off;
    let files = vec![PathBuf::from("spine.bin")];
    let side: Option<SpineSidecar> = read_sealed(&side_path).ok().filter(|s: &SpineSidecar| s.source_id == plan.record.source_id);
    if let Some(s) = &side {
        let len = std::fs::metadata(&path).map(|m| m.len()).ok();
        if same_place(&s.tensors, &planned) && len == Some(total) {
            progress.begin("verify spine", total);
            let ranges: Vec<(u64, u64, &str)> = s.tensors.values().map(|t| (t.offset, t.len, t.xxh3.as_str())).collect();
            let intact = super::readback::is_exact(&path, &ranges, progress);
            progress.end();
            if intact {
                return Ok((files, s.tensors.clone()));
            }
            eprintln!("deltafin setup: {} is damaged; rewriting the spine", path.display());
        }
    }
    let recorded = |n: &str| -> Option<String> {
        side.as_ref().and_then(|s| s.tensors.get(n)).map(|t| t.xxh3.clone()).or_else(|| plan.earlier_spine(n).map(str::to_string))
    };
    progress.begin("spine", total);
    let mut tensors = planned;
    write_file_atomically(&path, total, |f| {
        let mut buf = Vec::new();
        for (n, t) in tensors.iter_mut() {
            let e = &ckpt.tensors()[n];
            let shard = &ckpt.shards()[e.shard];
            buf.resize(e.len as usize, 0);
            plan.src.read_span(shard, e.offset, &mut buf)?;
            let sum = checksum(&buf);
            plan.check_source(&format!("spine tensor `{n}`"), shard, &sum, recorded(n).as_deref())?;
            t.xxh3 = sum;
            f.write_all_at(&buf, t.offset).map_err(Error::io(crate::manifest::tmp_path(&path)))?;
            progress.advance(t.len);
        }
        Ok(())
    })?;
    progress.end();
    write_sealed(&side_path, &SpineSidecar { source_id: plan.record.source_id.clone(), bytes: total, tensors: tensors.clone() })?;
    Ok((files, tensors))
}

/// Checksums the spine where it lies in the checkpoint's shards (nothing is copied). A re-run
/// compares them with the sidecar's: the shards are the store, so a change is an error.
pub(crate) fn in_place_spine(plan: &Install, progress: &dyn Progress) -> Result<(Vec<PathBuf>, BTreeMap<String, SpineTensor>)> {
    let ckpt = plan.ckpt;
    let side_path = plan.out.join("inplace-spine.json");
    let side: Option<SpineSidecar> = read_sealed(&side_path).ok().filter(|s: &SpineSidecar| s.source_id == plan.record.source_id);
    let files: Vec<PathBuf> = ckpt.shards().iter().map(|p| plan.spine_dir.join(p.strip_prefix(ckpt.dir()).unwrap_or(p))).collect();
    let names = spine_names(ckpt);
    let total: u64 = names.iter().map(|n| ckpt.tensors()[n].len).sum();
    progress.begin("spine", total);
    let mut tensors = BTreeMap::new();
    let mut buf = Vec::new();
    for n in names {
        let e = &ckpt.tensors()[&n];
        let sum = plan.src.span_checksum(&files[e.shard], e.offset, e.len, &mut buf)?;
        let recorded =
            side.as_ref().and_then(|s| s.tensors.get(&n)).map(|t| t.xxh3.clone()).or_else(|| plan.earlier_spine(&n).map(str::to_string));
        plan.check_source(&format!("spine tensor `{n}`"), &files[e.shard], &sum, recorded.as_deref())?;
        progress.advance(e.len);
        tensors.insert(
            n,
            SpineTensor { dtype: format!("{:?}", e.dtype), shape: e.shape.clone(), file: e.shard, offset: e.offset, len: e.len, xxh3: sum },
        );
    }
    progress.end();
    write_sealed(&side_path, &SpineSidecar { source_id: plan.record.source_id.clone(), bytes: total, tensors: tensors.clone() })?;
    Ok((files, tensors))
}
