//! The drive ladder: 1 to 4 emulated drives, equal and unequal, each a loop device (direct I/O,
//! 4 KiB sectors) with an ext4 file system and a kernel-enforced read cap (cgroup v1 blkio
//! throttle), well below the real disk's floor so the emulation is honest
//! (`shared/BENCH-MACHINE.md`). The mirror rows hold a copy of every expert on every drive, so the
//! reader can send each read to the drive expected to finish it first; the one-copy rows (reader
//! caps only) hold each byte once, striped, weighted or round-robin. Needs root for the kernel's
//! caps; everything is torn down after.
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
    /// `mirror (...)`, or a one-copy placement.
    pub layout: String,
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

/// One configuration of the ladder: a layout over some drives at some caps.
struct Config {
    layout: String,
    profile: String,
    rates: Vec<f64>,
    store: PathBuf,
    runs: Vec<(f64, f64, f64, Vec<u64>)>,
}

/// The layouts at one copy of every byte (1x capacity) the ladder measures beside the full
/// mirror, and whether the store depends on the drives' rates (striped and weighted do).
const ONE_COPY: [(&str, bool); 3] = [("striped", true), ("weighted", true), ("round-robin", false)];

/// Runs the ladder on the `slice-mini` checkpoint at `ckpt` with the `deltafin` binary `bin`;
/// returns the rungs and the limiter that enforced the caps. Every expert on every drive (the
/// mirror) at 1 to 4 drives; with the reader's caps also each one-copy placement at 2 to 4
/// drives (each set up over the drives with their rates stated). Configurations are interleaved:
/// each repeat runs every one in turn.
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
    let mut configs = Vec::new();
    for (profile, rates) in profiles {
        for n in 1..=4 {
            let v = work.join(format!("variant{n}"));
            if !v.exists() {
                variant(&store, n, &v)?;
            }
            let layout = "mirror (every expert on every drive)".to_string();
            configs.push(Config { layout, profile: profile.into(), rates: rates[..n].to_vec(), store: v, runs: vec![] });
        }
        if limiter != Limiter::Reader {
            // The loop devices hold one mirror copy each: no room for the one-copy stores.
            continue;
        }
        for (placement, by_rate) in ONE_COPY {
            for n in 2..=4 {
                let key = if by_rate {
                    format!("{placement}-{}-{n}", profile.split(' ').next().unwrap_or(profile))
                } else {
                    format!("{placement}-{n}")
                };
                let out = work.join(format!("store-{key}"));
                if !out.exists() {
                    let mut c = Command::new(bin);
                    c.args(["setup", "--full", "--placement", placement, "--from"]).arg(ckpt).arg("--out").arg(&out);
                    for (m, r) in drives.mounts.iter().zip(&rates[..n]) {
                        // Stated rates (the caps are the reader's, so a probe would see the one disk).
                        c.arg("--home").arg(format!("{}::{}/s", m.display(), *r as u64));
                    }
                    eprintln!("ladder: setting up {key}");
                    sh(&mut c)?;
                }
                configs.push(Config {
                    layout: placement.into(),
                    profile: profile.into(),
                    rates: rates[..n].to_vec(),
                    store: out,
                    runs: vec![],
                });
            }
        }
    }
    for round in 0..repeats {
        for c in &mut configs {
            let n = c.rates.len();
            let stats = work.join("stats.json");
            let run = format!(
                "{} run --model {} --ram-budget {budget} --queue-depth 4 --ids {ids} --max-new {new} --print-ids --stats-json {}",
                bin.display(),
                c.store.display(),
                stats.display()
            );
            let script = if limiter == Limiter::Reader {
                let caps: Vec<String> = c.rates.iter().map(|r| format!("{}", *r as u64)).collect();
                format!("exec timeout {RUN_LIMIT_S} {run} --read-caps {}", caps.join(","))
            } else {
                let _ = std::fs::remove_dir(CGROUP);
                std::fs::create_dir_all(CGROUP)?;
                for (i, dev) in devs.iter().enumerate() {
                    // Drives beyond n are capped too (unused); caps apply to every thread of the run.
                    let rate = c.rates.get(i).or(c.rates.last()).copied().unwrap_or(100e6);
                    std::fs::write(format!("{CGROUP}/blkio.throttle.read_bps_device"), format!("{dev} {}", rate as u64))?;
                }
                format!("echo $$ > {CGROUP}/cgroup.procs; exec timeout {RUN_LIMIT_S} {run}")
            };
            sh(Command::new("sh").args(["-c", &script]))?;
            let _ = std::fs::remove_dir(CGROUP);
            let s: serde_json::Value = serde_json::from_slice(&std::fs::read(&stats)?)?;
            let tok_s = s["decode_tok_s"].as_f64().unwrap_or(0.0);
            let bpt = s["bytes_per_token"].as_f64().unwrap_or(0.0);
            let ideal = c.rates.iter().sum::<f64>() / bpt.max(1.0);
            let per_drive =
                s["per_drive"].as_array().map(|a| a.iter().map(|d| d["bytes"].as_u64().unwrap_or(0)).collect()).unwrap_or_default();
            eprintln!(
                "ladder round {}: {} {} {n} drive(s): {tok_s:.3} tok/s, ideal {ideal:.3}, efficiency {:.0}%",
                round + 1,
                c.layout,
                c.profile,
                100.0 * tok_s / ideal
            );
            c.runs.push((tok_s, ideal, bpt, per_drive));
        }
    }
    let median = |v: &[f64]| crate::bench::engine_runs::spread(v).1;
    let out = configs
        .into_iter()
        .map(|c| {
            let tok: Vec<f64> = c.runs.iter().map(|r| r.0).collect();
            let ideals: Vec<f64> = c.runs.iter().map(|r| r.1).collect();
            let effs: Vec<f64> = c.runs.iter().map(|r| r.0 / r.1).collect();
            let bpts: Vec<f64> = c.runs.iter().map(|r| r.2).collect();
            Rung {
                layout: c.layout,
                profile: c.profile,
                drives: c.rates.len(),
                rates: c.rates,
                tok_s: median(&tok),
                ideal: median(&ideals),
                efficiency: median(&effs),
                efficiencies: effs,
                tok_s_runs: tok,
                bytes_per_token: median(&bpts),
                per_drive_bytes: c.runs.last().map(|r| r.3.clone()).unwrap_or_default(),
            }
        })
        .collect();
    drop(drives);
    let _ = std::fs::remove_dir_all(work);
    Ok((out, limiter))
}
