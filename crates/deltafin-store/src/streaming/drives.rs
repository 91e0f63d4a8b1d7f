//! The drive I/O beneath the streaming cache: how the bytes of one read get from a home into a
//! buffer. The cache (budget, eviction, in-flight reads, failover) lives in `mod.rs` and knows
//! only this interface, so a new byte source (a network fetch, a throttled drive) is a new
//! implementation here, not a change to the cache's state machine.

use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::reader::{open_for_read, read_aligned, CacheMode};

/// Reads byte ranges of a home's files.
pub trait DriveIo: Send + Sync {
    /// Reads `[offset, offset + len)` of `path` on home `home` into `buf`, which covers the
    /// range's aligned window; returns where the wanted bytes start in `buf`.
    fn read(&self, home: usize, path: &Path, offset: u64, len: u64, buf: &mut [u8]) -> std::io::Result<usize>;
    /// Whether every read is checked here already, for experts whose checksum the manifest cannot
    /// know (a stream store's, learnt when fetched). Reads of experts the manifest has a checksum
    /// for are checked against it whatever this says.
    fn self_checked(&self) -> bool {
        false
    }
    /// Bytes handed to the engine (spine included) that no published hash has covered yet: a
    /// stream store's, until their shard is checked. Local stores check every byte: 0.
    fn unverified_bytes(&self) -> u64 {
        0
    }
}

/// Local files, through the page cache or around it.
pub struct LocalDrives {
    pub mode: CacheMode,
}

impl DriveIo for LocalDrives {
    fn read(&self, _home: usize, path: &Path, offset: u64, len: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        let (file, _) = open_for_read(path, self.mode)?;
        read_aligned(&file, offset, len, buf)
    }
}

/// Drives held to a read rate each (bytes/s; 0 = none), to emulate slower drives on one fast
/// disk: each read takes the next slot of its home's byte clock and returns no earlier than the
/// slot's end, so a home never delivers more than its cap. The clock restarts when the home idles,
/// so idle time is lost, as on a real drive.
pub struct CappedDrives<D> {
    inner: D,
    caps: Vec<u64>,
    /// End of the last slot handed out, per home.
    paced_until: Mutex<Vec<Option<Instant>>>,
}

impl<D> CappedDrives<D> {
    /// `inner` with `caps[home]` bytes/s per home (missing or 0: uncapped).
    pub fn new(inner: D, caps: Vec<u64>) -> CappedDrives<D> {
        let n = caps.len();
        CappedDrives { inner, caps, paced_until: Mutex::new(vec![None; n]) }
    }

    /// The moment a read of `len` bytes starting now may complete, under `home`'s cap.
    fn slot(&self, home: usize, len: u64) -> Option<Instant> {
        let cap = self.caps.get(home).copied().filter(|&c| c > 0)?;
        let mut clocks = self.paced_until.lock().expect("poisoned");
        let now = Instant::now();
        let start = clocks[home].map_or(now, |t| t.max(now));
        let end = start + Duration::from_secs_f64(len as f64 / cap as f64);
        clocks[home] = Some(end);
        Some(end)
    }
}

impl<D: DriveIo> DriveIo for CappedDrives<D> {
    fn read(&self, home: usize, path: &Path, offset: u64, len: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        let due = self.slot(home, len);
        let at = self.inner.read(home, path, offset, len, buf);
        if let Some(due) = due {
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
        }
        at
    }
    fn self_checked(&self) -> bool {
        self.inner.self_checked()
    }
    fn unverified_bytes(&self) -> u64 {
        self.inner.unverified_bytes()
    }
}
