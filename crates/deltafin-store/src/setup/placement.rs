//! Where each expert goes over homes of different size and speed.
//!
//! Decode reads a handful of experts per layer and waits for the last of them, so a layer is as
//! fast as its slowest drive's share. Three placements, one copy of every byte at most:
//!
//! - **striped** (the default over several homes): every expert is cut into page-aligned stripes,
//!   one per home, sized by the home's share, so every read splits over all drives in proportion
//!   to their rates and they finish together whatever the routing.
//! - **weighted**: whole experts, each home taking its share of every layer's experts (a smooth
//!   weighted round-robin); a token's few experts land unevenly, so layers wait for the busiest.
//! - **round-robin**: whole experts dealt to homes in turn (`copies` consecutive homes each), as
//!   before; with one copy an unequal set of drives runs at its slowest member's pace.
//!
//! Shares come from what the drives are: each home's capacity (stated, or its free space) and read
//! rate (stated, or probed), water-filled so each home's share is proportional to its rate unless
//! its capacity caps it. They are recorded with the plan, so a resumed or repaired setup places
//! every byte exactly where the first run did. [`expected_rate`] models a decode layer's reads
//! over a layout, which `setup --plan` prints for every placement.

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::{Error, Result};
use crate::manifest::{align_up, ALIGN};

/// How experts are spread over the homes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Whole experts dealt to homes in turn, `copies` consecutive homes each.
    RoundRobin,
    /// Each expert striped over every home in proportion to its share.
    Striped,
    /// Whole experts, each home taking its share of every layer's.
    Weighted,
}

impl Placement {
    /// The name used on the command line and in the setup record.
    pub fn tag(self) -> &'static str {
        match self {
            Placement::RoundRobin => "round-robin",
            Placement::Striped => "striped",
            Placement::Weighted => "weighted",
        }
    }

    /// The placement named `s`.
    pub fn from_tag(s: &str) -> Option<Placement> {
        [Placement::RoundRobin, Placement::Striped, Placement::Weighted].into_iter().find(|p| p.tag() == s)
    }
}

/// What is known of a home's drive before setup: either may be stated by the user.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DriveFacts {
    /// Bytes of experts this home may hold (default: the free space of its file system).
    pub capacity: Option<u64>,
    /// Read rate in bytes/s (default: probed with a short read at setup).
    pub rate: Option<f64>,
}

/// Where one piece of an expert goes: `len` bytes from `start` of the expert, on `home`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub home: usize,
    pub start: u64,
    pub len: u64,
    /// A stripe (part of the expert) rather than a whole copy.
    pub stripe: bool,
}

/// A placement made concrete for one checkpoint: which home holds which bytes of every expert.
pub struct Layout {
    pub placement: Placement,
    pub copies: usize,
    /// Fraction of expert bytes per home (equal for round-robin).
    pub shares: Vec<f64>,
    homes: usize,
    experts: usize,
    /// MoE layer -> its position among the MoE layers.
    layer_pos: BTreeMap<usize, usize>,
    /// Weighted: the home of every expert, layer-major.
    table: Vec<u16>,
}

impl Layout {
    /// The layout of `placement` over `shares.len()` homes for `layers` x `experts` experts.
    pub fn new(placement: Placement, copies: usize, shares: Vec<f64>, layers: &[usize], experts: usize) -> Layout {
        let homes = shares.len().max(1);
        let layer_pos = layers.iter().enumerate().map(|(i, &l)| (l, i)).collect();
        let table = match placement {
            Placement::Weighted => weighted_table(&shares, layers.len() * experts),
            _ => Vec::new(),
        };
        Layout { placement, copies: copies.clamp(1, homes), shares, homes, experts, layer_pos, table }
    }

    /// Where the bytes of expert `e` of layer `l` (`len` bytes) go.
    pub fn slots(&self, l: usize, e: usize, len: u64) -> Vec<Slot> {
        let whole = |home| Slot { home, start: 0, len, stripe: false };
        match self.placement {
            Placement::RoundRobin => (0..self.copies).map(|j| whole((e + l + j) % self.homes)).collect(),
            Placement::Weighted => vec![whole(self.table[self.layer_pos[&l] * self.experts + e] as usize)],
            Placement::Striped => stripes(&self.shares, len),
        }
    }

    /// Bytes of layer `l`'s pack on each home (aligned as packed), for experts of `len` bytes.
    pub fn layer_bytes(&self, l: usize, len: u64) -> Vec<u64> {
        let mut out = vec![0u64; self.homes];
        for e in 0..self.experts {
            for s in self.slots(l, e, len) {
                out[s.home] += align_up(s.len);
            }
        }
        out
    }

    /// Expert bytes each home holds (aligned as packed), for experts of `len` bytes.
    pub fn bytes_per_home(&self, len: u64) -> Vec<u64> {
        let mut out = vec![0u64; self.homes];
        for &l in self.layer_pos.keys() {
            for (o, b) in out.iter_mut().zip(self.layer_bytes(l, len)) {
                *o += b;
            }
        }
        out
    }
}

/// Page-aligned stripes of a `len`-byte expert by `shares`, in home order: each home gets its
/// share rounded down to pages, the pages left over go one each to the homes with the largest
/// rounding losses, and the last stripe takes the unaligned tail. A home holds at most its share
/// plus one page of every expert, which [`water_fill`]'s reserve covers.
fn stripes(shares: &[f64], len: u64) -> Vec<Slot> {
    let pages = len.div_ceil(ALIGN);
    let exact: Vec<f64> = shares.iter().map(|s| s * pages as f64).collect();
    let mut got: Vec<u64> = exact.iter().map(|x| x.floor() as u64).collect();
    let mut left = pages.saturating_sub(got.iter().sum());
    let mut order: Vec<usize> = (0..shares.len()).filter(|&h| shares[h] > 0.0).collect();
    order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())).then(a.cmp(&b)));
    for &h in order.iter().cycle().take(order.len() * 2) {
        if left == 0 {
            break;
        }
        got[h] += 1;
        left -= 1;
    }
    let mut out = Vec::new();
    let mut start = 0u64;
    for (home, p) in got.into_iter().enumerate() {
        if p == 0 || start >= len {
            continue;
        }
        let n = (p * ALIGN).min(len - start);
        out.push(Slot { home, start, len: n, stripe: true });
        start += n;
    }
    out
}

/// The home of each of `n` whole experts: a smooth weighted round-robin (each home earns its
/// share per expert; the richest takes the next one), so every stretch of experts, a layer in
/// particular, is split in proportion and each home's count stays within one of its share.
fn weighted_table(shares: &[f64], n: usize) -> Vec<u16> {
    let mut credit = vec![0f64; shares.len()];
    (0..n)
        .map(|_| {
            for (c, s) in credit.iter_mut().zip(shares) {
                *c += s;
            }
            let best = (0..shares.len()).max_by(|&a, &b| credit[a].total_cmp(&credit[b]).then(b.cmp(&a))).unwrap_or(0);
            credit[best] -= 1.0;
            best as u16
        })
        .collect()
}

/// Shares of `total` bytes over homes with `caps` bytes of room and read `rates`: proportional to
/// rate (every home busy for the same time), except that a home whose share would exceed its room
/// is filled and the rest shared again among the others. `None` when the room does not add up.
pub fn water_fill(total: u64, caps: &[u64], rates: &[f64]) -> Option<Vec<f64>> {
    if caps.iter().sum::<u64>() < total || total == 0 {
        return None;
    }
    let room: Vec<f64> = caps.iter().map(|&c| c as f64 / total as f64).collect();
    let mut share = vec![0f64; caps.len()];
    let mut full = vec![false; caps.len()];
    loop {
        let taken: f64 = (0..caps.len()).filter(|&h| full[h]).map(|h| room[h]).sum();
        let free_rate: f64 = (0..caps.len()).filter(|&h| !full[h]).map(|h| rates[h].max(0.0)).sum();
        if free_rate <= 0.0 {
            return None;
        }
        let t = (1.0 - taken) / free_rate;
        let over: Vec<usize> = (0..caps.len()).filter(|&h| !full[h] && t * rates[h] > room[h]).collect();
        if over.is_empty() {
            for h in 0..caps.len() {
                share[h] = if full[h] { room[h] } else { t * rates[h].max(0.0) };
            }
            return Some(share);
        }
        for h in over {
            full[h] = true;
        }
    }
}

/// Aggregate read rate (bytes/s) a decode layer's reads reach over `layout`: `k` experts routed
/// uniformly per layer, each home reading its bytes at its rate (whole copies held by several
/// homes split in proportion to rate, as the reader does), the layer done when the busiest home
/// is. Averaged over a fixed pseudo-random sample, so the number is the same on every run.
/// Returns the rate and each home's share of the bytes read.
pub fn expected_rate(layout: &Layout, rates: &[f64], layers: &[usize], experts: usize, k: usize, len: u64) -> (f64, Vec<f64>) {
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let k = k.clamp(1, experts.max(1));
    let (mut bytes, mut secs) = (0f64, 0f64);
    let mut per_home = vec![0f64; rates.len()];
    for _ in 0..512 {
        let l = layers[(next() % layers.len() as u64) as usize];
        let mut picked = Vec::with_capacity(k);
        while picked.len() < k {
            let e = (next() % experts as u64) as usize;
            if !picked.contains(&e) {
                picked.push(e);
            }
        }
        let mut load = vec![0f64; rates.len()];
        for &e in &picked {
            let slots = layout.slots(l, e, len);
            if slots.iter().any(|s| s.stripe) {
                for s in &slots {
                    load[s.home] += s.len as f64;
                }
            } else {
                let sum: f64 = slots.iter().map(|s| rates[s.home]).sum();
                for s in &slots {
                    load[s.home] += len as f64 * rates[s.home] / sum;
                }
            }
        }
        bytes += (k as u64 * len) as f64;
        secs += (0..rates.len()).map(|h| load[h] / rates[h]).fold(0.0, f64::max);
        for (t, x) in per_home.iter_mut().zip(&load) {
            *t += x;
        }
    }
    (bytes / secs, per_home.iter().map(|x| x / bytes).collect())
}

/// Measures a home's read rate: writes a 128 MiB probe file with direct I/O, reads it back the
/// same way in 4 MiB reads from 4 threads (twice; the better pass counts) and removes it.
/// File systems without direct I/O are probed through the page cache after dropping it.
pub fn probe_rate(home: &Path) -> Result<f64> {
    use std::os::unix::fs::FileExt;
    const SIZE: usize = 128 << 20;
    const CHUNK: usize = 4 << 20;
    let path = home.join(".deltafin-probe.partial");
    let aligned = |n: usize| -> (Vec<u8>, usize) {
        let v = vec![0x5au8; n + ALIGN as usize];
        let at = v.as_ptr().align_offset(ALIGN as usize);
        (v, at)
    };
    let result = (|| -> std::io::Result<f64> {
        {
            let f = open_direct(&path, true)?;
            let (buf, at) = aligned(CHUNK);
            for i in 0..SIZE / CHUNK {
                f.write_all_at(&buf[at..at + CHUNK], (i * CHUNK) as u64)?;
            }
            f.sync_all()?;
            super::drop_cache(&f);
        }
        let mut best = 0f64;
        for _ in 0..2 {
            let f = std::sync::Arc::new(open_direct(&path, false)?);
            let t0 = std::time::Instant::now();
            let handles: Vec<_> = (0..4)
                .map(|t| {
                    let f = f.clone();
                    std::thread::spawn(move || -> std::io::Result<()> {
                        let (mut buf, at) = aligned(CHUNK);
                        for i in (t..SIZE / CHUNK).step_by(4) {
                            f.read_exact_at(&mut buf[at..at + CHUNK], (i * CHUNK) as u64)?;
                        }
                        Ok(())
                    })
                })
                .collect();
            for h in handles {
                h.join().map_err(|_| std::io::Error::other("probe thread failed"))??;
            }
            best = best.max(SIZE as f64 / t0.elapsed().as_secs_f64());
            super::drop_cache(&f);
        }
        Ok(best)
    })();
    let _ = std::fs::remove_file(&path);
    result.map_err(|err| Error::Io { path: home.to_path_buf(), err })
}

fn open_direct(path: &Path, create: bool) -> std::io::Result<std::fs::File> {
    let mut o = std::fs::OpenOptions::new();
    o.read(true);
    if create {
        o.write(true).create(true).truncate(true);
    }
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        let mut d = o.clone();
        d.custom_flags(libc::O_DIRECT);
        match d.open(path) {
            Ok(f) => return Ok(f),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(e),
        }
    }
    o.open(path)
}

/// The shares of `placement` for `units` experts of `len` bytes over homes with `caps` bytes of
/// room and read `rates`, with the room each home must keep for page rounding taken off first;
/// and the reserve taken. `None` when the experts do not fit.
pub fn shares_for(placement: Placement, len: u64, units: u64, caps: &[u64], rates: &[f64]) -> Option<(Vec<f64>, u64)> {
    let (total, reserve) = match placement {
        // Stripes are cut from the expert's pages: at most one page of every expert above its share.
        Placement::Striped => (units * align_up(len), units * ALIGN),
        // At most one whole expert above its share.
        _ => (units * align_up(len), align_up(len)),
    };
    let room: Vec<u64> = caps.iter().map(|c| c.saturating_sub(reserve)).collect();
    water_fill(total, &room, rates).map(|s| (s, reserve))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small xorshift for the property tests below.
    fn rng(seed: u64) -> impl FnMut() -> u64 {
        let mut x = seed | 1;
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
    }

    #[test]
    fn shares_follow_rates_until_a_drive_is_full() {
        let s = water_fill(1000, &[10_000; 4], &[136.0, 71.0, 71.0, 57.0]).unwrap();
        assert!((s[0] - 136.0 / 335.0).abs() < 1e-12 && (s[3] - 57.0 / 335.0).abs() < 1e-12, "{s:?}");
        // The fast drive holds only 20%: the rest is shared by rate among the others.
        let s = water_fill(1000, &[200, 10_000, 10_000, 10_000], &[136.0, 71.0, 71.0, 57.0]).unwrap();
        assert!((s[0] - 0.2).abs() < 1e-12 && (s[1] / s[3] - 71.0 / 57.0).abs() < 1e-9, "{s:?}");
        assert!((s.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert!(water_fill(1000, &[300, 300, 300], &[1.0; 3]).is_none());
    }

    #[test]
    fn stripes_cover_the_expert_once_in_page_aligned_order() {
        let len = 17_547_264 + 1234;
        let s = stripes(&[136.0 / 335.0, 71.0 / 335.0, 71.0 / 335.0, 57.0 / 335.0], len);
        assert_eq!(s.len(), 4);
        let mut at = 0;
        for x in &s {
            assert_eq!((x.start, x.start % ALIGN), (at, 0));
            at += x.len;
        }
        assert_eq!(at, len);
        assert!((s[0].len as f64 / len as f64 - 136.0 / 335.0).abs() < 0.001, "{s:?}");
    }

    #[test]
    fn a_planned_layout_never_exceeds_a_drives_stated_capacity() {
        let mut r = rng(7);
        let layers: Vec<usize> = (1..9).collect();
        for case in 0..400 {
            let homes = 1 + (r() % 5) as usize;
            let experts = 1 + (r() % 40) as usize;
            let len = 1 + r() % 200_000;
            let rates: Vec<f64> = (0..homes).map(|_| 1.0 + (r() % 1000) as f64).collect();
            let per = align_up(len);
            let total_units = (layers.len() * experts) as u64;
            let caps: Vec<u64> = (0..homes).map(|_| r() % (total_units * per * 2 / homes as u64 + 1)).collect();
            for placement in [Placement::Striped, Placement::Weighted] {
                let Some((shares, _)) = shares_for(placement, len, total_units, &caps, &rates) else { continue };
                let layout = Layout::new(placement, 1, shares, &layers, experts);
                let used = layout.bytes_per_home(len);
                for h in 0..homes {
                    assert!(used[h] <= caps[h], "case {case} {placement:?}: home {h} holds {} of {} ({caps:?})", used[h], caps[h]);
                }
                // Every byte is placed exactly once.
                for &l in &layers {
                    for e in 0..experts {
                        let s = layout.slots(l, e, len);
                        assert_eq!(s.iter().map(|x| x.len).sum::<u64>(), len, "case {case} {placement:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn striping_reaches_the_sum_of_rates_where_whole_experts_do_not() {
        let layers: Vec<usize> = (0..8).collect();
        let rates = [136.0, 71.0, 71.0, 57.0];
        let len = 17_547_264;
        let n = (layers.len() * 256) as u64;
        let caps = [n * align_up(len); 4];
        let sum: f64 = rates.iter().sum();
        let rate = |p| {
            let shares = shares_for(p, len, n, &caps, &rates).map(|s| s.0).unwrap_or(vec![0.25; 4]);
            expected_rate(&Layout::new(p, 1, shares, &layers, 256), &rates, &layers, 256, 8, len).0 / sum
        };
        let (striped, weighted, rr) = (rate(Placement::Striped), rate(Placement::Weighted), rate(Placement::RoundRobin));
        assert!(striped > 0.99, "{striped}");
        assert!(weighted < striped && rr < weighted, "{striped} {weighted} {rr}");
    }
}
