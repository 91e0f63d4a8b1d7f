//! Decode on one drive capped below the disk's floor: the same engine runs as `bench decode`, with
//! every read held to 700 MB/s, so the device limit the runs are judged against holds still.
//!
//! Uncapped, the disk swings between about 1 and 3 GB/s from minute to minute, and a ratio of a
//! decode run to a limit measured seconds apart is mostly noise. 700 MB/s sits below the
//! dependable floor (~1.0 GB/s, `shared/BENCH-MACHINE.md`), so the cap, not the disk, decides the
//! rate. Each repeat is still bracketed by measurements of the disk itself, and judged against the
//! lower of the cap and the disk.
//!
//! Two enforcers, and they differ in one way that matters here. The engine's reader
//! (`EngineBuilder::read_caps`, the default) paces each drive with a byte clock that restarts
//! when the drive idles: like a real drive, time with nothing in flight is lost. The kernel's
//! cgroup v1 blkio throttle (`--limiter cgroup`, root) is a byte budget per 100 ms slice: a
//! few milliseconds of idle are made up by a burst at the disk's own speed right after (a
//! timeline of reads shows three experts at ~2 GB/s, then a ~70 ms stall), so it forgives the
//! gaps between layers that the engine is supposed to fill, and a prefetch can only add bytes.
//! The kernel throttle goes on the disk holding the store (one drive needs no loop device and no
//! copy of the 4.2 GB store; the engine reads with `O_DIRECT`, so no page-cache hit bypasses it).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::engine_runs::{self, DecodeResult};
use super::Limiter;

const CGROUP: &str = "/sys/fs/cgroup/blkio/deltafin-capped";
const ROOT_CGROUP: &str = "/sys/fs/cgroup/blkio";

/// The cap: below the disk's dependable floor.
pub const CAP: u64 = 700_000_000;

/// Puts this process (all its threads) in a throttled cgroup; moves it back and removes the
/// cgroup when dropped, so a failed run leaves nothing capped behind.
struct Throttle;

impl Throttle {
    fn new(dev: &str, cap: u64) -> Result<Throttle> {
        let _ = std::fs::remove_dir(CGROUP);
        std::fs::create_dir_all(CGROUP).with_context(|| format!("creating {CGROUP}"))?;
        let t = Throttle;
        std::fs::write(format!("{CGROUP}/blkio.throttle.read_bps_device"), format!("{dev} {cap}"))
            .with_context(|| format!("capping {dev} at {cap} B/s"))?;
        // cgroup.procs moves every thread of the process, the engine's readers included.
        std::fs::write(format!("{CGROUP}/cgroup.procs"), std::process::id().to_string()).context("joining the capped cgroup")?;
        Ok(t)
    }
}

impl Drop for Throttle {
    fn drop(&mut self) {
        let _ = std::fs::write(format!("{ROOT_CGROUP}/cgroup.procs"), std::process::id().to_string());
        let _ = std::fs::remove_dir(CGROUP);
    }
}

/// `major:minor` of the whole disk holding `path` (the throttle applies to disks, not partitions).
fn disk_of(path: &Path) -> Result<String> {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(path)?.dev();
    let (maj, min) = (libc::major(dev), libc::minor(dev));
    let sys = PathBuf::from(format!("/sys/dev/block/{maj}:{min}"));
    if sys.join("partition").exists() {
        let parent = std::fs::read_to_string(sys.join("../dev")).context("reading the partition's disk")?;
        return Ok(parent.trim().to_string());
    }
    if !sys.exists() {
        bail!("{} is not on a block device ({maj}:{min})", path.display());
    }
    Ok(format!("{maj}:{min}"))
}

/// Runs the decode configurations with every read capped at [`CAP`], enforced by the reader
/// unless `limiter` asks for the kernel, judged against `compute_step` (the compute-only step the
/// uncapped part measured); returns what enforced the cap.
pub fn decode(
    store: &Path,
    vocab: u32,
    budget: u64,
    quick: bool,
    compute_step: f64,
    limiter: Limiter,
) -> Result<(Vec<DecodeResult>, Limiter)> {
    if limiter == Limiter::Cgroup {
        super::ladder::available().map_err(|e| anyhow::anyhow!("kernel read caps unavailable: {e} (try --limiter reader)"))?;
        let dev = disk_of(&store.join("manifest.json"))?;
        let _throttle = Throttle::new(&dev, CAP)?;
        eprintln!("capped decode: reads from {dev} throttled to {} MB/s by the kernel", CAP / 1_000_000);
        let d = engine_runs::decode_with(store, vocab, budget, quick, compute_step, None)?;
        return Ok((d, Limiter::Cgroup));
    }
    eprintln!("capped decode: the reader holds reads to {} MB/s", CAP / 1_000_000);
    let d = engine_runs::decode_with(store, vocab, budget, quick, compute_step, Some(CAP))?;
    Ok((d, Limiter::Reader))
}
