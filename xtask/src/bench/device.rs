//! The device's own limit, measured without the model: expert-sized direct reads from the store's
//! pack files at the queue depths the engine uses.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::{Context, Result};
use deltafin_store::{open_for_read, read_aligned, AlignedBuf, Budget, CacheMode, Manifest};

/// One queue depth's measurements (one per repeat).
#[derive(Clone, Debug)]
pub struct DeviceResult {
    pub queue_depth: usize,
    pub bytes_per_s: Vec<f64>,
}

/// Where the next measurement starts in the manifest: each call reads experts the previous one
/// did not, so a cache below the filesystem (the VM host's) cannot flatter repeated measurements.
static CURSOR: AtomicUsize = AtomicUsize::new(0);

/// Reads `count` experts (cycling through the manifest) with `qd` threads, each read one expert
/// with `O_DIRECT`, and returns bytes/s.
pub fn read_rate(store: &Path, qd: usize, count: usize) -> Result<f64> {
    let m = Manifest::read(store)?;
    let jobs: Vec<(PathBuf, u64, u64)> = m.experts.iter().map(|e| (m.copy_path(&e.copies[0]), e.copies[0].offset, e.len)).collect();
    let next = AtomicUsize::new(CURSOR.fetch_add(count, Ordering::Relaxed));
    let count = next.load(Ordering::Relaxed) + count;
    let budget = Budget::new(u64::MAX / 2);
    let t0 = Instant::now();
    let total: u64 = std::thread::scope(|s| {
        let handles: Vec<_> = (0..qd)
            .map(|_| {
                s.spawn(|| -> Result<u64> {
                    let mut bytes = 0;
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= count {
                            return Ok(bytes);
                        }
                        let (path, off, len) = &jobs[i % jobs.len()];
                        let (start, end) = deltafin_store::aligned_window(*off, *len);
                        let mut buf = AlignedBuf::try_new((end - start) as usize, &budget).context("no room in an unbounded budget")?;
                        let (f, _) = open_for_read(path, CacheMode::Direct)?;
                        read_aligned(&f, *off, *len, buf.as_mut_slice())?;
                        bytes += len;
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("reader thread").unwrap_or(0)).sum()
    });
    Ok(total as f64 / t0.elapsed().as_secs_f64())
}

/// Every queue depth the engine may use, repeated round-robin so a change of the disk's regime
/// spreads over all of them instead of landing on one.
pub fn run(store: &Path, quick: bool) -> Result<Vec<DeviceResult>> {
    let (count, repeats) = if quick { (32, 1) } else { (96, 3) };
    let mut out: Vec<DeviceResult> = [1, 2, 4, 8].iter().map(|&qd| DeviceResult { queue_depth: qd, bytes_per_s: vec![] }).collect();
    for _ in 0..repeats {
        for r in &mut out {
            let rate = read_rate(store, r.queue_depth, count)?;
            eprintln!("device: QD {}: {:.0} MB/s", r.queue_depth, rate / 1e6);
            r.bytes_per_s.push(rate);
        }
    }
    Ok(out)
}
