//! The drive ladder: 1 to 4 emulated drives, equal and unequal, each a loop device (direct I/O,
//! 4 KiB sectors) with an ext4 file system and a kernel-enforced read cap (cgroup v1 blkio
//! throttle), well below the real disk's floor so the emulation is honest
//! (`shared/BENCH-MACHINE.md`). Every drive holds a copy of every expert, so the reader can send
//! each read to the drive expected to finish it first. Needs root; everything is torn down after.
//!
//! Where the kernel lacks them (no root, no loop devices, no cgroup v1 blkio), or when asked
//! (`--limiter reader`), the drives are plain folders on the one disk and the engine's own reader
//! enforces each cap (`deltafin run --read-caps`: every read takes the next slot of its drive's
//! byte clock and returns no earlier than the slot's end). The caps stay far below the disk's
//! floor, so the disk under them never decides the result.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use deltafin_store::Manifest;

const CGROUP: &str = "/sys/fs/cgroup/blkio/deltafin-ladder";

/// A rung's run is killed after this many seconds (a normal one takes under a minute): a hung
/// engine fails the ladder with its stderr instead of holding the harness forever.
const RUN_LIMIT_S: u32 = 900;

/// What enforces the emulated drives' read caps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Limiter {
    /// The kernel's where it can (loop devices + cgroup v1 blkio throttle), else the reader's.
    Auto,
    /// Loop devices capped by the cgroup v1 blkio throttle (root).
    Cgroup,
    /// Plain folders, caps enforced by the engine's reader (`--read-caps`).
    Reader,
}

/// One rung.
#[derive(Clone, Debug)]
pub struct Rung {
    pub profile: String,
    pub drives: usize,
    /// Read caps of the drives used, bytes/s.
    pub rates: Vec<f64>,
    /// Median over repeats.
    pub tok_s: f64,
    /// Sum of rates / measured expert bytes per decoded token (median over repeats).
    pub ideal: f64,
    /// Median of the repeats' measured / ideal.
    pub efficiency: f64,
    /// Each repeat's measured / ideal.
    pub efficiencies: Vec<f64>,
    pub tok_s_runs: Vec<f64>,
    pub bytes_per_token: f64,
    pub per_drive_bytes: Vec<u64>,
}

struct Drives {
    loops: Vec<String>,
    mounts: Vec<PathBuf>,
}

impl Drop for Drives {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(CGROUP);
        // Plain folders (the reader-limited ladder) have nothing to unmount.
        if !self.loops.is_empty() {
            for m in &self.mounts {
                let _ = Command::new("umount").arg(m).status();
            }
        }
        for l in &self.loops {
            let _ = Command::new("losetup").args(["-d", l]).status();
        }
    }
}

fn sh(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Whether this machine can run the ladder (root, loop devices, cgroup v1 blkio).
pub fn available() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root (loop devices, mounts, cgroups)".into());
    }
    if !Path::new("/sys/fs/cgroup/blkio").exists() {
        return Err("no cgroup v1 blkio controller".into());
    }
    if Command::new("losetup").arg("--version").output().is_err() {
        return Err("no losetup".into());
    }
    Ok(())
}

fn setup_drives(dir: &Path, count: usize, size: u64) -> Result<Drives> {
    let mut d = Drives { loops: vec![], mounts: vec![] };
    for i in 0..count {
        let img = dir.join(format!("drive{i}.img"));
        let f = std::fs::File::create(&img)?;
        f.set_len(size)?;
        let dev = sh(Command::new("losetup").args(["-f", "--show", "--direct-io=on", "--sector-size", "4096"]).arg(&img))?;
        d.loops.push(dev.clone());
        sh(Command::new("mkfs.ext4").args(["-q", "-F", &dev]))?;
        let mnt = dir.join(format!("mnt{i}"));
        std::fs::create_dir_all(&mnt)?;
        sh(Command::new("mount").args(["-o", "noatime", &dev]).arg(&mnt))?;
        d.mounts.push(mnt);
    }
    Ok(d)
}

fn minor(dev: &str) -> Result<String> {
    let out = sh(Command::new("stat").args(["-c", "%t:%T", dev]))?;
    let (maj, min) = out.split_once(':').context("stat output")?;
    Ok(format!("{}:{}", u32::from_str_radix(maj, 16)?, u32::from_str_radix(min, 16)?))
}

/// A store variant that only knows the first `n` homes.
fn variant(store: &Path, n: usize, out: &Path) -> Result<()> {
    std::fs::create_dir_all(out)?;
    for f in ["config.json", "tiktoken.model", "tokenizer_config.json", "spine.bin", "deltafin-store", "setup.json"] {
        let dst = out.join(f);
        let _ = std::fs::remove_file(&dst);
        std::fs::hard_link(store.join(f), &dst).or_else(|_| std::fs::copy(store.join(f), &dst).map(|_| ()))?;
    }
    let mut m = Manifest::read(store)?;
    m.homes.truncate(n);
    for e in &mut m.experts {
        e.copies.retain(|c| c.home < n);
    }
    m.write(out)?;
    Ok(())
}

/// Runs the ladder on the `slice-mini` checkpoint at `ckpt` with the `deltafin` binary `bin`;
/// returns the rungs and the limiter that enforced the caps.
pub fn run(bin: &Path, ckpt: &Path, work: &Path, quick: bool, budget: &str, limiter: Limiter) -> Result<(Vec<Rung>, Limiter)> {
    let limiter = match (limiter, available()) {
        (Limiter::Cgroup, Err(e)) => bail!("drive ladder with kernel caps unavailable: {e} (try --limiter reader)"),
        (Limiter::Auto, Err(e)) => {
            eprintln!("ladder: kernel caps unavailable ({e}); the reader enforces them");
            Limiter::Reader
        }
        (Limiter::Auto, Ok(())) => Limiter::Cgroup,
        (l, _) => l,
    };
    let _ = std::fs::remove_dir_all(work);
    std::fs::create_dir_all(work)?;
    let expert_total: u64 = std::fs::read_dir(ckpt)?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
        .sum();
    let drives = match limiter {
        Limiter::Reader => {
            let mounts: Vec<PathBuf> = (0..4).map(|i| work.join(format!("drive{i}"))).collect();
            for m in &mounts {
                std::fs::create_dir_all(m)?;
            }
            Drives { loops: vec![], mounts }
        }
        _ => setup_drives(work, 4, expert_total + (256 << 20))?,
    };
    let store = work.join("store");
    let mut setup = Command::new(bin);
    setup.args(["setup", "--full", "--copies", "4", "--from"]).arg(ckpt).arg("--out").arg(&store);
    for m in &drives.mounts {
        setup.arg("--home").arg(m);
    }
    sh(&mut setup)?;
    // Uncapped baseline right before the ladder, as the recipe asks.
    let uncapped = crate::bench::device::read_rate(&store, 4, 24)?;
    eprintln!("ladder: uncapped read rate {:.0} MB/s", uncapped / 1e6);
    let devs: Vec<String> = drives.loops.iter().map(|l| minor(l)).collect::<Result<_>>()?;
    let profiles: [(&str, [f64; 4]); 2] =
        [("equal", [100e6, 100e6, 100e6, 100e6]), ("unequal 13.6:7.1:7.1:5.7", [136e6, 71e6, 71e6, 57e6])];
    let (new, repeats) = if quick { (3, 2) } else { (8, 3) };
    let ids = crate::bench::engine_runs::prompt(4, 8192).iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",");
    let mut out = Vec::new();
    for (profile, rates) in profiles {
        for n in 1..=4 {
            let v = work.join(format!("variant{n}"));
            variant(&store, n, &v)?;
            let stats = work.join(format!("stats-{n}.json"));
            let run = format!(
                "{} run --model {} --ram-budget {budget} --queue-depth 4 --ids {ids} --max-new {new} --print-ids --stats-json {}",
                bin.display(),
                v.display(),
                stats.display()
            );
            let script = if limiter == Limiter::Reader {
                let caps: Vec<String> = rates[..n].iter().map(|r| format!("{}", *r as u64)).collect();
                format!("exec timeout {RUN_LIMIT_S} {run} --read-caps {}", caps.join(","))
            } else {
                let _ = std::fs::remove_dir(CGROUP);
                std::fs::create_dir_all(CGROUP)?;
                for (i, dev) in devs.iter().enumerate() {
                    // Drives beyond n are capped too (unused); caps apply to every thread of the run.
                    std::fs::write(format!("{CGROUP}/blkio.throttle.read_bps_device"), format!("{dev} {}", rates[i] as u64))?;
                }
                format!("echo $$ > {CGROUP}/cgroup.procs; exec timeout {RUN_LIMIT_S} {run}")
            };
            let sum: f64 = rates[..n].iter().sum();
            let (mut tok, mut ideals, mut effs, mut bpts) = (vec![], vec![], vec![], vec![]);
            let mut per_drive_bytes = vec![];
            for _ in 0..repeats {
                sh(Command::new("sh").args(["-c", &script]))?;
                let s: serde_json::Value = serde_json::from_slice(&std::fs::read(&stats)?)?;
                let tok_s = s["decode_tok_s"].as_f64().unwrap_or(0.0);
                let bpt = s["bytes_per_token"].as_f64().unwrap_or(0.0);
                let ideal = sum / bpt.max(1.0);
                per_drive_bytes =
                    s["per_drive"].as_array().map(|a| a.iter().map(|d| d["bytes"].as_u64().unwrap_or(0)).collect()).unwrap_or_default();
                eprintln!("ladder {profile} {n} drive(s): {tok_s:.3} tok/s, ideal {ideal:.3}, efficiency {:.0}%", 100.0 * tok_s / ideal);
                tok.push(tok_s);
                ideals.push(ideal);
                effs.push(tok_s / ideal);
                bpts.push(bpt);
            }
            let median = |v: &[f64]| crate::bench::engine_runs::spread(v).1;
            out.push(Rung {
                profile: profile.into(),
                drives: n,
                rates: rates[..n].to_vec(),
                tok_s: median(&tok),
                ideal: median(&ideals),
                efficiency: median(&effs),
                efficiencies: effs,
                tok_s_runs: tok,
                bytes_per_token: median(&bpts),
                per_drive_bytes,
            });
            let _ = std::fs::remove_dir(CGROUP);
        }
    }
    drop(drives);
    let _ = std::fs::remove_dir_all(work);
    Ok((out, limiter))
}
