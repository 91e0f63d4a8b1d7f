//! Decode on one drive capped below the disk's floor: the same engine runs as `bench decode`, with
//! the process's reads throttled by the kernel (cgroup v1 blkio `read_bps_device` on the disk that
//! holds the store), so the device limit they are judged against holds still for the whole run.
//!
//! Uncapped, the disk swings between about 1 and 3 GB/s from minute to minute, and a ratio of a
//! decode run to a limit measured seconds apart is mostly noise. A cap of 700 MB/s sits below the
//! dependable floor (~1.0 GB/s, `shared/BENCH-MACHINE.md`), so the cap, not the disk, decides the
//! rate; the harness still measures the limit itself (expert-sized `O_DIRECT` reads through the
//! same cap, before and after each repeat). The throttle goes on the disk itself rather than a
//! loop device: one drive needs no copy of the 4.2 GB store, and the engine reads with `O_DIRECT`,
//! so no page-cache hit can bypass the cap.
//!
//! Where the kernel lacks the throttle (no root, no cgroup v1 blkio), the engine's reader enforces
//! the cap instead (`EngineBuilder::read_caps`), and each repeat is judged against the lower of
//! the cap and the measured disk.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::engine_runs::{self, DecodeResult};

const CGROUP: &str = "/sys/fs/cgroup/blkio/deltafin-capped";
const ROOT_CGROUP: &str = "/sys/fs/cgroup/blkio";

/// The cap: below the disk's dependable floor.
pub const CAP: u64 = 700_000_000;

/// How the cap was enforced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Enforced {
    Kernel,
    Reader,
}

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

/// Runs the decode configurations with every read capped at [`CAP`].
pub fn decode(store: &Path, ckpt: &Path, vocab: u32, budget: u64, quick: bool) -> Result<(Vec<DecodeResult>, f64, Enforced)> {
    // The compute-only run reads the checkpoint through the page cache: measure it uncapped.
    let compute_step = engine_runs::compute_step(ckpt, vocab, quick)?;
    let kernel = super::ladder::available().map_err(anyhow::Error::msg).and_then(|()| disk_of(&store.join("manifest.json")));
    match kernel {
        Ok(dev) => {
            let _throttle = Throttle::new(&dev, CAP)?;
            eprintln!("capped decode: reads from {dev} throttled to {} MB/s by the kernel", CAP / 1_000_000);
            let d = engine_runs::decode_with(store, vocab, budget, quick, compute_step, None)?;
            Ok((d, compute_step, Enforced::Kernel))
        }
        Err(e) => {
            eprintln!("capped decode: kernel throttle unavailable ({e:#}); the reader enforces the cap");
            let d = engine_runs::decode_with(store, vocab, budget, quick, compute_step, Some(CAP))?;
            Ok((d, compute_step, Enforced::Reader))
        }
    }
}
