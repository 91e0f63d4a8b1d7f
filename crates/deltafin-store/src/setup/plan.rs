//! The layout a setup would make, worked out before anything is written: each home's capacity
//! and read rate (stated, or found), the shares, the bytes per drive, and the read rate decode
//! can expect from it and from the other placements (`deltafin setup --plan` prints it).

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use deltafin_core::K3Config;

use super::placement::{expected_rate, probe_rate, shares_for, DriveFacts, Layout, Placement};
use super::space::free_bytes;
use super::{SetupOptions, PACKS_DIR};
use crate::error::{Error, Result};
use crate::manifest::align_up;

/// One home as planned.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct PlannedHome {
    pub path: PathBuf,
    /// Bytes of experts it may hold.
    pub capacity: u64,
    /// `stated`, or `free space` (shared with the other homes on its file system).
    pub capacity_from: &'static str,
    /// Read rate, bytes/s.
    pub rate: f64,
    /// `stated`, `probed`, or `one drive` (every home on one file system: rates do not matter).
    pub rate_from: &'static str,
    /// Expert bytes the layout puts there.
    pub bytes: u64,
    /// Expected share of the bytes decode reads from it.
    pub read_share: f64,
}

/// What a setup would lay out, and what each placement would give.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct LayoutPlan {
    pub placement: Placement,
    pub copies: usize,
    pub homes: Vec<PlannedHome>,
    /// Expert bytes of one copy of the model.
    pub expert_bytes: u64,
    /// Expected aggregate read rate of decode's expert reads (bytes/s).
    pub expected_rate: f64,
    /// The sum of the homes' rates: what perfect balance would give.
    pub rate_sum: f64,
    /// Experts routed per token per layer (what `expected_rate` assumes).
    pub experts_per_token: usize,
    /// Every placement's expected rate over these homes (`None`: it does not fit).
    pub alternatives: Vec<(String, Option<f64>)>,
    /// Fractions of expert bytes per home.
    pub shares: Vec<f64>,
}

/// Capacities and rates of `homes`: stated where given; else the free space of each file system
/// (shared equally by the homes on it, less `reserved` bytes per file system, plus `held` bytes
/// this store already keeps there) and a probed rate per file system (skipped when every home is
/// on one: their rates are the same drive's).
pub(crate) fn drive_facts(
    homes: &[PathBuf],
    stated: &[DriveFacts],
    reserved: &BTreeMap<u64, u64>,
    held: &BTreeMap<u64, u64>,
) -> Result<Vec<(u64, &'static str, f64, &'static str)>> {
    let dev_of = |h: &Path| -> Result<u64> { Ok(std::fs::metadata(existing(h)).map_err(Error::io(h))?.dev()) };
    let devs: Vec<u64> = homes.iter().map(|h| dev_of(h)).collect::<Result<_>>()?;
    let fact = |i: usize| stated.get(i).copied().unwrap_or_default();
    let mut per_dev: BTreeMap<u64, usize> = BTreeMap::new();
    for (i, d) in devs.iter().enumerate() {
        if fact(i).capacity.is_none() {
            *per_dev.entry(*d).or_default() += 1;
        }
    }
    let one_device = devs.iter().all(|d| *d == devs[0]);
    let mut probed: BTreeMap<u64, f64> = BTreeMap::new();
    let mut out = Vec::new();
    for (i, h) in homes.iter().enumerate() {
        let f = fact(i);
        let (capacity, capacity_from) = match f.capacity {
            Some(c) => (c, "stated"),
            None => {
                let d = devs[i];
                let free = free_bytes(&existing(h))? + held.get(&d).copied().unwrap_or(0);
                (free.saturating_sub(reserved.get(&d).copied().unwrap_or(0)) / per_dev[&d] as u64, "free space")
            }
        };
        let (rate, rate_from) = match f.rate {
            Some(r) => (r, "stated"),
            None if one_device => (1e9, "one drive"),
            None => {
                let r = match probed.get(&devs[i]) {
                    Some(r) => *r,
                    None => {
                        eprintln!("deltafin setup: measuring the read rate of {} (state it as --home PATH::RATE to skip)", h.display());
                        // A home not made yet is probed where it will live (its file system).
                        let r = probe_rate(&existing(h))?;
                        probed.insert(devs[i], r);
                        r
                    }
                };
                (r, "probed")
            }
        };
        out.push((capacity, capacity_from, rate, rate_from));
    }
    Ok(out)
}

/// `p`, or its nearest ancestor that exists (a home not made yet lives on that file system).
pub(crate) fn existing(p: &Path) -> PathBuf {
    p.ancestors().find(|a| a.exists()).unwrap_or(Path::new("/")).to_path_buf()
}

/// Works out the layout over `homes` with the given capacities and rates.
pub(crate) fn layout_plan(
    cfg: &K3Config,
    placement: Placement,
    copies: usize,
    homes: &[PathBuf],
    facts: &[(u64, &'static str, f64, &'static str)],
    recorded: Option<Vec<f64>>,
) -> Result<(LayoutPlan, Layout)> {
    let layers = cfg.moe_layers();
    let len = cfg.expert_shape().total_bytes() as u64;
    let units = (layers.len() * cfg.num_experts) as u64;
    let caps: Vec<u64> = facts.iter().map(|f| f.0).collect();
    let rates: Vec<f64> = facts.iter().map(|f| f.2).collect();
    let n = homes.len().max(1);
    let shares_of = |p: Placement| -> Option<Vec<f64>> {
        match p {
            Placement::RoundRobin => Some(vec![1.0 / n as f64; n]),
            _ => shares_for(p, len, units, &caps, &rates).map(|s| s.0),
        }
    };
    let fits = |l: &Layout| l.bytes_per_home(len).iter().zip(&caps).all(|(b, c)| b <= c);
    let shares = match (recorded, placement) {
        (Some(s), _) => s,
        (None, p) => shares_of(p).ok_or_else(|| short_of_room(homes, &caps, units * align_up(len)))?,
    };
    let layout = Layout::new(placement, copies, shares.clone(), &layers, cfg.num_experts);
    let bytes = layout.bytes_per_home(len);
    if let Some(h) = (0..homes.len()).find(|&h| bytes[h] > caps[h]) {
        return Err(Error::format(
            &homes[h],
            format!(
                "{} placement puts {:.3} GB of experts on this home, which can hold {:.3} GB ({}); choose --placement striped or \
                 weighted (they fill each drive to its share), add a drive, or state a larger capacity",
                placement.tag(),
                bytes[h] as f64 / 1e9,
                caps[h] as f64 / 1e9,
                facts[h].1
            ),
        ));
    }
    let k = cfg.experts_per_token;
    let (rate, read_shares) = expected_rate(&layout, &rates, &layers, cfg.num_experts, k, len);
    let mut alternatives = Vec::new();
    for (name, p, c) in [
        ("striped".to_string(), Placement::Striped, 1),
        ("weighted".to_string(), Placement::Weighted, 1),
        ("round-robin".to_string(), Placement::RoundRobin, 1),
        (format!("mirror (round-robin, {n} copies)"), Placement::RoundRobin, n),
    ] {
        let alt = shares_of(p).map(|s| Layout::new(p, c, s, &layers, cfg.num_experts)).filter(|l| fits(l));
        alternatives.push((name, alt.map(|l| expected_rate(&l, &rates, &layers, cfg.num_experts, k, len).0)));
    }
    let planned = homes
        .iter()
        .enumerate()
        .map(|(h, path)| PlannedHome {
            path: path.clone(),
            capacity: caps[h],
            capacity_from: facts[h].1,
            rate: rates[h],
            rate_from: facts[h].3,
            bytes: bytes[h],
            read_share: read_shares[h],
        })
        .collect();
    let plan = LayoutPlan {
        placement,
        copies: layout.copies,
        homes: planned,
        expert_bytes: units * len,
        expected_rate: rate,
        rate_sum: rates.iter().sum(),
        experts_per_token: k,
        alternatives,
        shares,
    };
    Ok((plan, layout))
}

fn short_of_room(homes: &[PathBuf], caps: &[u64], need: u64) -> Error {
    Error::format(
        homes.first().map_or(Path::new("."), |h| h.as_path()),
        format!(
            "the homes cannot hold the experts: one copy needs {:.3} GB, the {} home(s) can hold {:.3} GB together (stated \
             capacities, or free space); add a drive, free space, or state larger capacities (--home PATH:SIZE)",
            need as f64 / 1e9,
            homes.len(),
            caps.iter().sum::<u64>() as f64 / 1e9
        ),
    )
}

/// The layout `deltafin setup` (or `--rebalance`) with `opts` would make, without installing
/// anything: only the rate probe's temporary file is written (and removed), and only where a
/// rate is neither stated nor measurable from one shared drive.
pub fn plan_layout(opts: &SetupOptions) -> Result<LayoutPlan> {
    let (cfg, held) = if opts.rebalance {
        let m = crate::manifest::Manifest::read(&opts.out)?;
        let text = std::fs::read_to_string(opts.out.join("config.json")).map_err(Error::io(opts.out.join("config.json")))?;
        let cfg = K3Config::from_json(&text).map_err(|e| Error::format(opts.out.join("config.json"), e.to_string()))?;
        (cfg, held_by_device(&m))
    } else {
        let source = crate::hf_snapshot::resolve_model_dir(&opts.source)?;
        let ckpt = crate::checkpoint::Checkpoint::open(&source)?;
        (ckpt.config().clone(), BTreeMap::new())
    };
    let homes: Vec<PathBuf> = if opts.homes.is_empty() { vec![opts.out.clone()] } else { opts.homes.clone() };
    let homes: Vec<PathBuf> = homes.iter().map(|h| std::path::absolute(h).unwrap_or_else(|_| h.clone())).collect();
    let facts = drive_facts(&homes, &opts.drives, &BTreeMap::new(), &held)?;
    Ok(layout_plan(&cfg, opts.placement_kind(), opts.copies, &homes, &facts, None)?.0)
}

/// Bytes of a store's expert packs on each file system (freed as a rebalance moves them).
pub(crate) fn held_by_device(m: &crate::manifest::Manifest) -> BTreeMap<u64, u64> {
    let files: std::collections::BTreeSet<PathBuf> = m.experts.iter().flat_map(|e| e.copies.iter().map(|c| m.copy_path(c))).collect();
    let mut out = BTreeMap::new();
    for p in &files {
        if let Ok(md) = std::fs::metadata(p) {
            if p.components().any(|c| c.as_os_str() == PACKS_DIR) {
                *out.entry(md.dev()).or_default() += md.len();
            }
        }
    }
    out
}
