//! Reading spine tensors into RAM: each tensor straight from its file into its place in one
//! page-aligned buffer (direct I/O where the file system allows it, so no page-cache copy and
//! no second zeroing), several tensors at once, each checked against its checksum by the thread
//! that read it.
//!
//! Buffered reads copied every byte out of the page cache after the kernel had zeroed and
//! filled a page-cache page for it, on one thread, with the checksum after each read: most of
//! the time to open a store went to the kernel, not to the drive. Here the drive's transfer, the
//! copy-free placement and the checksums of other tensors overlap.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::manifest::{align_up, checksum, Manifest, SpineTensor, ALIGN};
use crate::memory::Pages;
use crate::reader::{open_for_read, read_aligned, CacheMode};
use crate::setup::{drop_cache, Progress};

/// Tensors read at once: enough to keep a drive's queue busy while other threads checksum.
const READERS: usize = 4;

/// One tensor to read: its entry, its file and its window of the buffer (its length rounded up
/// to [`ALIGN`], so a direct read of whole blocks fits).
struct Job<'a> {
    name: &'a str,
    tensor: &'a SpineTensor,
    window: &'a mut [u8],
}

/// Reads the spine tensors `names` (in that order) into one buffer, each at an [`ALIGN`]ed
/// offset, checking each; returns the buffer and each tensor's offset in it.
pub(crate) fn read_spine_tensors(
    dir: &Path,
    m: &Manifest,
    names: &[&str],
    progress: &dyn Progress,
) -> Result<(Pages, BTreeMap<String, u64>)> {
    let mut placement = BTreeMap::new();
    let mut size = 0u64;
    for n in names {
        placement.insert(n.to_string(), size);
        size = align_up(size + m.spine[*n].len);
    }
    let mut pages = Pages::new(size as usize);
    // Each file opened once, shared by the readers (positioned reads need no lock).
    let mut files: Vec<Option<(File, bool)>> = (0..m.spine_files.len()).map(|_| None).collect();
    for n in names {
        let t = &m.spine[*n];
        if files[t.file].is_none() {
            let path = m.spine_path(dir, t.file);
            files[t.file] = Some(open_for_read(&path, CacheMode::Direct).map_err(|e| Error::BadStore {
                path: path.clone(),
                why: format!("spine file unreadable: {e}"),
                advice: m.advice(dir),
            })?);
        }
    }
    let mut jobs = Vec::with_capacity(names.len());
    let mut rest = pages.as_mut_slice();
    for n in names {
        let t = &m.spine[*n];
        let (window, tail) = std::mem::take(&mut rest).split_at_mut(align_up(t.len) as usize);
        jobs.push(Job { name: n, tensor: t, window });
        rest = tail;
    }
    // Largest first, so the last tensor to finish is a small one.
    jobs.sort_by_key(|j| std::cmp::Reverse(j.tensor.len));
    let queue = Mutex::new(jobs.into_iter());
    progress.begin("spine", names.iter().map(|n| m.spine[*n].len).sum());
    let failure: Mutex<Option<Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..READERS.min(names.len()) {
            s.spawn(|| loop {
                let Some(job) = queue.lock().expect("poisoned").next() else { break };
                if failure.lock().expect("poisoned").is_some() {
                    break;
                }
                let (file, direct) = files[job.tensor.file].as_ref().expect("opened above");
                let len = job.tensor.len;
                if let Err(e) = read_one(dir, m, file, *direct, job) {
                    failure.lock().expect("poisoned").get_or_insert(e);
                    break;
                }
                progress.advance(len);
            });
        }
    });
    drop(queue);
    progress.end();
    for (f, _) in files.iter().flatten() {
        drop_cache(f);
    }
    match failure.into_inner().expect("poisoned") {
        Some(e) => Err(e),
        None => Ok((pages, placement)),
    }
}

/// Reads one tensor into its window and checks it.
fn read_one(dir: &Path, m: &Manifest, file: &File, direct: bool, job: Job<'_>) -> Result<()> {
    let t = job.tensor;
    let path = m.spine_path(dir, t.file);
    let unreadable = |e: std::io::Error| Error::BadStore {
        path: path.clone(),
        why: format!("spine tensor `{}` at offset {} ({} bytes) cannot be read: {e} (truncated?)", job.name, t.offset, t.len),
        advice: m.advice(dir),
    };
    let len = t.len as usize;
    if direct && t.offset.is_multiple_of(ALIGN) {
        // Whole blocks into the aligned window; the file may end inside the last one.
        read_aligned(file, t.offset, t.len, job.window).map_err(unreadable)?;
    } else {
        // A tensor at an unaligned offset (a checkpoint read in place) cannot be read directly.
        File::open(&path).and_then(|f| f.read_exact_at(&mut job.window[..len], t.offset)).map_err(unreadable)?;
    }
    if checksum(&job.window[..len]) != t.xxh3 {
        return Err(Error::SpineCorrupt { tensor: job.name.to_string(), path, offset: t.offset, advice: m.advice(dir) });
    }
    Ok(())
}
