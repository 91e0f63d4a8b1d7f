//! Split reads: one expert read in parts, from several drives and several reader threads at once.
//!
//! When every copy of an expert sits at an aligned offset, a demand read is cut into page-aligned
//! shares sized so that each drive holding a copy, given what it already has queued and its
//! measured rate, finishes at the same moment; each share is cut again over that drive's reader
//! threads, so one expert keeps the whole queue depth busy. The parts land in one buffer; when
//! the last arrives the whole expert is checked against its checksum. A failing part moves to
//! another drive; a checksum mismatch falls back to whole reads, copy by copy, so a corrupt copy
//! is found and reported exactly as without splitting.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use deltafin_core::Bytes;

use super::{Inflight, Inner, Job, Key, ReadSlot, State, DEFAULT_RATE};
use crate::memory::{AlignedBuf, BUF_ALIGN};
use crate::source::{Delivery, Priority};

/// Default for `ReaderOptions::split_min`: experts smaller than this are read whole (splitting
/// them only adds requests); parts are at least a quarter of it.
pub const DEFAULT_SPLIT_MIN: u64 = 2 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Run {
    Queued,
    Running,
    Done,
}

#[derive(Debug)]
struct Part {
    copy: usize,
    start: u64,
    len: u64,
    run: Run,
}

/// Part `index` of the split read numbered `split`. A guess can be cancelled and its expert
/// requested afresh while parts of the old read are still queued or running; the number keeps
/// those from touching the new read's parts or buffer (a part marked running by a stale job, or
/// a buffer installed over the new one, would leave the new read waiting forever).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PartRef {
    pub(super) index: usize,
    pub(super) split: u64,
}

/// Whether `e` is checked stripe by stripe: every copy is a stripe with its own checksum (the
/// stripes cover the expert exactly, which the manifest checks, so all passing is the whole
/// expert passing).
fn by_stripes(e: &crate::manifest::ExpertEntry) -> bool {
    !e.copies.is_empty() && e.copies.iter().all(|c| c.stripe.is_some())
}

/// The stripe (copy index) holding expert byte `at`; a part never straddles stripes (each is
/// cut inside one).
fn stripe_holding(e: &crate::manifest::ExpertEntry, at: u64) -> Option<usize> {
    e.copies.iter().position(|c| c.stripe.as_ref().is_some_and(|s| (s.start..s.start + s.len).contains(&at)))
}

/// Numbers split reads; unique for the life of the process.
static NEXT_SPLIT: AtomicU64 = AtomicU64::new(0);

/// The parts of one split read and the buffer they fill.
pub(super) struct Split {
    id: u64,
    parts: Vec<Part>,
    buf: Option<Arc<AlignedBuf>>,
    allocating: bool,
    /// A striped expert's running checks, one per stripe (copy); empty for other reads.
    stripes: Vec<StripeCheck>,
}

/// The running checksum of one stripe, fed its parts in order as they land.
struct StripeCheck {
    /// `None` while a reader thread is feeding it (or once the stripe is checked).
    hasher: Option<Box<crate::checksum::Xxh3>>,
    /// Stripe bytes fed so far, from the stripe's start.
    fed_to: u64,
}

impl Split {
    /// Whether the shared buffer has been allocated (and counts against the budget).
    pub(super) fn holds_buffer(&self) -> bool {
        self.buf.is_some()
    }
}

/// The split read `id` of `key`, if it is still the one in flight.
fn split_of(st: &mut State, key: Key, id: u64) -> Option<&mut Split> {
    st.inflight.get_mut(&key)?.split.as_mut().filter(|s| s.id == id)
}

/// Marks part `part` taken by a reader of `home`; `None` if it is not (or no longer) queued there.
pub(super) fn take_part(inf: &mut Inflight, part: PartRef) -> Option<(Priority, usize)> {
    let split = inf.split.as_mut().filter(|s| s.id == part.split)?;
    let p = split.parts.get_mut(part.index)?;
    if p.run != Run::Queued {
        return None;
    }
    p.run = Run::Running;
    Some((inf.priority, p.copy))
}

/// Moves the still-queued parts of a split prefetch that was just demanded to the demand queues
/// (the copies left in the prefetch queues are skipped when popped).
pub(super) fn promote_parts(st: &mut State, key: Key, homes_of: impl Fn(usize) -> usize) {
    let Some(split) = st.inflight.get(&key).and_then(|i| i.split.as_ref()) else { return };
    let id = split.id;
    let queued: Vec<(usize, usize, u64)> =
        split.parts.iter().enumerate().filter(|(_, p)| p.run == Run::Queued).map(|(n, p)| (homes_of(p.copy), n, p.len)).collect();
    for (home, n, len) in queued {
        st.homes[home].queued_bytes += len;
        st.homes[home].demand.push_back(Job { key, part: Some(PartRef { index: n, split: id }), len });
    }
}

/// Shares of a `len`-byte read over `drives` (copy, rate in bytes/s, bytes already queued), so
/// that every drive used finishes at the same moment: `(queued + share) / rate` equal for all,
/// the shares summing to `len`. A drive whose backlog alone outlasts that moment gets nothing,
/// and the moment is worked out again without it (otherwise the others' shares would add up to
/// more than the expert). Shares are page multiples, at least `piece_min`, except the last,
/// which takes the rounding leftovers and the unaligned tail.
fn plan_shares(len: u64, drives: &[(usize, f64, u64)], piece_min: u64) -> Vec<(usize, u64)> {
    let align = BUF_ALIGN as u64;
    let mut set: Vec<(usize, f64, u64)> = drives.to_vec();
    let mut sizes: Vec<(usize, u64)> = loop {
        let rate: f64 = set.iter().map(|d| d.1).sum();
        let backlog: f64 = set.iter().map(|d| d.2 as f64).sum();
        let t = (len as f64 + backlog) / rate;
        let want = |d: &(usize, f64, u64)| ((t * d.1 - d.2 as f64).max(0.0) as u64) / align * align;
        let keep: Vec<(usize, f64, u64)> = set.iter().copied().filter(|d| want(d) >= piece_min).collect();
        if keep.len() == set.len() || keep.is_empty() {
            break keep.iter().map(|d| (d.0, want(d))).collect();
        }
        set = keep;
    };
    if sizes.is_empty() {
        // Every drive is far behind: read it whole from the one that frees up first.
        let best = drives.iter().min_by(|a, b| (a.2 as f64 / a.1).total_cmp(&(b.2 as f64 / b.1)));
        return best.map(|d| vec![(d.0, len)]).unwrap_or_default();
    }
    // Hand out in order, never more than is left; the last share takes the rest.
    let mut left = len;
    let last = sizes.len() - 1;
    for (n, s) in sizes.iter_mut().enumerate() {
        s.1 = if n == last { left } else { s.1.min(left) };
        left -= s.1;
    }
    sizes.retain(|s| s.1 > 0);
    sizes
}

/// Cuts one drive's share `[start, start + len)` of an expert into page-aligned parts, one per
/// reader thread (`lanes`) as long as each is at least `piece_min`.
fn cut_share(parts: &mut Vec<Part>, copy: usize, mut start: u64, len: u64, piece_min: u64, lanes: u64) {
    let pieces = (len / piece_min).clamp(1, lanes);
    let step = (len / pieces).div_ceil(BUF_ALIGN as u64) * BUF_ALIGN as u64;
    let end = start + len;
    while start < end {
        let n = step.min(end - start);
        parts.push(Part { copy, start, len: n, run: Run::Queued });
        start += n;
    }
}

impl Inner {
    /// Plans and queues a split read of `key` for `waiter` (none for a prefetch); `false` if it
    /// should be read whole.
    pub(super) fn start_split(&self, st: &mut State, key: Key, waiter: Option<Sender<Delivery>>, priority: Priority) -> bool {
        let e = self.entry(key);
        if e.is_striped() {
            // Each stripe is on one drive only: always read in parts, each stripe from its drive,
            // cut again over its reader threads.
            let lanes = self.opts.queue_depth.max(1) as u64;
            let piece_min = (self.opts.split_min.min(DEFAULT_SPLIT_MIN) / 4).max(BUF_ALIGN as u64);
            let mut parts = Vec::new();
            for (copy, c) in e.copies.iter().enumerate() {
                let (start, len) = c.range(e.len);
                cut_share(&mut parts, copy, start, len, piece_min, lanes);
            }
            self.queue_parts(st, key, waiter, priority, parts);
            return true;
        }
        let now = Instant::now();
        let usable: Vec<usize> =
            (0..e.copies.len()).filter(|&i| st.homes[e.copies[i].home].quarantined_until.is_none_or(|t| t <= now)).collect();
        let min = self.opts.split_min;
        let lanes = self.opts.queue_depth.max(1);
        if min == u64::MAX || usable.is_empty() || e.len < min || e.copies.iter().any(|c| c.offset % BUF_ALIGN as u64 != 0) {
            return false;
        }
        if usable.len() < 2 && lanes < 2 {
            return false;
        }
        let rate = |i: usize| {
            let r = st.homes[e.copies[i].home].stats.rate;
            if r > 0.0 {
                r
            } else {
                DEFAULT_RATE
            }
        };
        let drives: Vec<(usize, f64, u64)> = usable.iter().map(|&i| (i, rate(i), st.homes[e.copies[i].home].queued_bytes)).collect();
        let piece_min = (min / 4).max(BUF_ALIGN as u64);
        let sizes = plan_shares(e.len, &drives, piece_min);
        // Each drive's share is cut again over its reader threads, so that the drive's queue stays
        // full to the end of a layer: the last few reads of a step would otherwise run at queue
        // depth one, at about half the drive's throughput (`cargo xtask bench device`).
        let mut parts = Vec::new();
        let mut start = 0;
        for (copy, len) in sizes {
            cut_share(&mut parts, copy, start, len, piece_min, lanes as u64);
            start += len;
        }
        if parts.len() < 2 {
            return false;
        }
        self.queue_parts(st, key, waiter, priority, parts);
        true
    }

    /// Queues `parts` of `key` on their drives as one split read.
    fn queue_parts(&self, st: &mut State, key: Key, waiter: Option<Sender<Delivery>>, priority: Priority, parts: Vec<Part>) {
        let e = self.entry(key);
        let id = NEXT_SPLIT.fetch_add(1, Ordering::Relaxed);
        for (n, p) in parts.iter().enumerate() {
            let home = e.copies[p.copy].home;
            st.homes[home].queued_bytes += p.len;
            let job = Job { key, part: Some(PartRef { index: n, split: id }), len: p.len };
            match priority {
                Priority::Demand => st.homes[home].demand.push_back(job),
                Priority::Prefetch => st.homes[home].prefetch.push_back(job),
            }
        }
        let stripes = if by_stripes(e) {
            e.copies
                .iter()
                .map(|c| StripeCheck { hasher: Some(Box::new(crate::checksum::Xxh3::new())), fed_to: c.range(e.len).0 })
                .collect()
        } else {
            Vec::new()
        };
        let split = Split { id, parts, buf: None, allocating: false, stripes };
        st.inflight
            .insert(key, Inflight { waiters: waiter.into_iter().collect(), priority, tried: vec![], started: true, split: Some(split) });
    }

    /// Gets (or allocates, once) the buffer all parts of split read `id` write into; `None` when
    /// there is no room or the read is no longer in flight.
    fn split_buffer(&self, key: Key, id: u64, window: u64, priority: Priority) -> Option<Arc<AlignedBuf>> {
        let mut st = self.state.lock().expect("poisoned");
        loop {
            let split = split_of(&mut st, key, id)?;
            if let Some(b) = &split.buf {
                return Some(b.clone());
            }
            if !split.allocating {
                split.allocating = true;
                drop(st);
                let buf = self.alloc(window as usize, key, priority).map(Arc::new);
                let mut st = self.state.lock().expect("poisoned");
                // Installed only in the read it was allocated for (a buffer for a cancelled read
                // goes back to the budget when dropped here).
                let out = match (split_of(&mut st, key, id), buf) {
                    (Some(s), Some(b)) => {
                        s.buf = Some(b.clone());
                        s.allocating = false;
                        Some(b)
                    }
                    (Some(s), None) => {
                        s.allocating = false;
                        None
                    }
                    (None, _) => None,
                };
                drop(st);
                self.work.notify_all();
                return out;
            }
            st = self.work.wait_timeout(st, Duration::from_millis(50)).expect("poisoned").0;
        }
    }

    /// Feeds stripe `s` of split read `id` the parts that continue its checked prefix, on the
    /// reader thread that just completed one, while their bytes are warm; checks the stripe
    /// when it is whole and delivers the expert once every stripe has passed. Checking as parts
    /// land keeps the checksum off the critical path: after the last part only that part is
    /// left to hash, not the whole expert (a layer's drives idle, and its compute waits, until
    /// its last expert is delivered). One thread feeds a stripe at a time; a part that lands
    /// meanwhile is picked up by that thread, which looks again before giving the hasher back.
    fn feed_stripe(&self, key: Key, id: u64, s: usize, buf: Arc<AlignedBuf>) {
        let e = self.entry(key);
        let c = &e.copies[s];
        let (a, n) = c.range(e.len);
        let owner: Arc<dyn deltafin_core::ByteOwner> = buf;
        let bytes = Bytes::new(owner, 0, e.len as usize);
        let mut st = self.state.lock().expect("poisoned");
        loop {
            let Some(split) = split_of(&mut st, key, id) else {
                return;
            };
            let fed_to = split.stripes[s].fed_to;
            let Some(len) = split.parts.iter().find(|p| p.start == fed_to && p.run == Run::Done).map(|p| p.len) else {
                // The part that continues the prefix has not landed yet.
                return;
            };
            let Some(mut hasher) = split.stripes[s].hasher.take() else {
                // Another thread is feeding the stripe; it looks again before it stops.
                return;
            };
            let from = split.stripes[s].fed_to;
            drop(st);
            hasher.update(&bytes.as_slice()[from as usize..(from + len) as usize]);
            st = self.state.lock().expect("poisoned");
            let Some(split) = split_of(&mut st, key, id) else {
                // A guess cancelled while its stripe was being checked.
                st.stats.prefetch_wasted_bytes += len;
                return;
            };
            split.stripes[s].fed_to = from + len;
            if from + len < a + n {
                split.stripes[s].hasher = Some(hasher);
                continue;
            }
            let good = c.stripe.as_ref().is_some_and(|stripe| format!("{:016x}", hasher.digest()) == stripe.xxh3);
            if !good {
                let inf = st.inflight.remove(&key).expect("present");
                let err = || crate::Error::Corrupt {
                    layer: key.0,
                    expert: key.1 as usize,
                    path: self.manifest.copy_path(c),
                    offset: c.offset,
                    advice: self.advice.clone(),
                };
                for w in &inf.waiters {
                    let _ = w.send((key.1, Err(err())));
                }
            } else if split.stripes.iter().zip(&e.copies).all(|(k, c)| k.fed_to == c.range(e.len).0 + c.range(e.len).1) {
                Self::deliver(&mut st, key, bytes);
            }
            drop(st);
            self.work.notify_all();
            return;
        }
    }

    /// Reads part `part` of a split read on `home` and completes the expert when it is the last.
    pub(super) fn run_part(&self, slot: ReadSlot<'_>, job: Job, part: PartRef, copy: usize, priority: Priority) {
        let home = slot.home;
        let key = job.key;
        let (id, part) = (part.split, part.index);
        let e = self.entry(key);
        let window = e.len.div_ceil(BUF_ALIGN as u64) * BUF_ALIGN as u64;
        let Some(buf) = self.split_buffer(key, id, window, priority) else {
            let mut st = self.state.lock().expect("poisoned");
            let ours = split_of(&mut st, key, id).is_some();
            if ours && st.inflight.get(&key).is_some_and(|i| i.waiters.is_empty() && i.priority == Priority::Prefetch) {
                // A guess that finds no room is dropped, never waited for.
                st.inflight.remove(&key);
                st.homes[home].queued_bytes -= job.len;
                drop(st);
                self.work.notify_all();
                return;
            }
            // No room yet: put the part back and let other jobs (which may free memory) run.
            if let Some(p) = split_of(&mut st, key, id).and_then(|s| s.parts.get_mut(part)) {
                p.run = Run::Queued;
                st.homes[home].demand.push_back(job);
            } else {
                st.homes[home].queued_bytes -= job.len;
            }
            drop(st);
            self.work.notify_all();
            drop(slot);
            self.budget.wait_for_release(Duration::from_millis(5));
            return;
        };
        let (start, len) = {
            let mut st = self.state.lock().expect("poisoned");
            match split_of(&mut st, key, id).and_then(|s| s.parts.get(part)) {
                Some(p) => (p.start, p.len),
                None => {
                    st.homes[home].queued_bytes -= job.len;
                    return;
                }
            }
        };
        let c = &e.copies[copy];
        let path = self.manifest.copy_path(c);
        let t0 = Instant::now();
        let room = (window - start) as usize;
        // SAFETY: each part writes only [start, start + room) of the shared buffer, and parts
        // cover disjoint ranges (start is page-aligned and parts do not overlap); nobody reads the
        // buffer before every part is done.
        let dst = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr_for_parts().add(start as usize), room) };
        // A stripe holds the expert's bytes from its own start.
        let at = c.offset + start - c.range(e.len).0;
        let result = self.io.read(home, &path, at, len, dst).map_err(|err| format!("{}: {err}", path.display()));
        let secs = t0.elapsed().as_secs_f64();
        drop(slot);
        let mut st = self.state.lock().expect("poisoned");
        st.homes[home].queued_bytes -= job.len;
        let Some(split) = split_of(&mut st, key, id) else {
            // A stale guess, cancelled while this part was being read (the expert may have been
            // requested afresh since, as another split read with its own buffer).
            if result.is_ok() {
                st.stats.prefetch_wasted_bytes += len;
            }
            return;
        };
        match result {
            Ok(_) => {
                split.parts[part].run = Run::Done;
                let done = split.parts.iter().all(|p| p.run == Run::Done);
                let striped = !split.stripes.is_empty();
                Self::note_read(&mut st, home, len, secs);
                if striped {
                    if let Some(s) = stripe_holding(e, start) {
                        drop(st);
                        self.feed_stripe(key, id, s, buf);
                        return;
                    }
                } else if done {
                    // The checksum reads the whole expert: not under the lock every reader and
                    // the engine's requests share.
                    drop(st);
                    let owner: Arc<dyn deltafin_core::ByteOwner> = buf.clone();
                    let bytes = Bytes::new(owner, 0, e.len as usize);
                    let good = crate::manifest::checksum(bytes.as_slice()) == e.xxh3;
                    let mut st = self.state.lock().expect("poisoned");
                    let still_wanted = split_of(&mut st, key, id).is_some();
                    if !still_wanted {
                        // A guess cancelled while its expert was being checked.
                        st.stats.prefetch_wasted_bytes += e.len;
                    } else if good {
                        Self::deliver(&mut st, key, bytes);
                    } else if e.is_striped() {
                        // Each stripe has its own checksum: name the one that is wrong.
                        let bad = e
                            .copies
                            .iter()
                            .find(|c| {
                                let (a, n) = c.range(e.len);
                                let sum = c.stripe.as_ref().map(|s| s.xxh3.as_str()).unwrap_or_default();
                                crate::manifest::checksum(&bytes.as_slice()[a as usize..(a + n) as usize]) != sum
                            })
                            .unwrap_or(&e.copies[0]);
                        let inf = st.inflight.remove(&key).expect("present");
                        for w in &inf.waiters {
                            let _ = w.send((
                                key.1,
                                Err(crate::Error::Corrupt {
                                    layer: key.0,
                                    expert: key.1 as usize,
                                    path: self.manifest.copy_path(bad),
                                    offset: bad.offset,
                                    advice: self.advice.clone(),
                                }),
                            ));
                        }
                    } else {
                        // Which copy is bad is unknown: read whole, copy by copy.
                        eprintln!("deltafin: split read of expert {}/{} failed its checksum; re-reading whole copies", key.0, key.1);
                        let inf = st.inflight.get_mut(&key).expect("present");
                        inf.split = None;
                        inf.started = false;
                        let priority = inf.priority;
                        if let Some(first) = self.choose_copy(&st, key, &[]) {
                            self.enqueue(&mut st, key, first, priority);
                        }
                    }
                    drop(st);
                    self.work.notify_all();
                    return;
                }
            }
            Err(msg) => {
                let h = &mut st.homes[home];
                h.stats.errors += 1;
                h.quarantined_until = Some(Instant::now() + h.backoff);
                h.backoff = (h.backoff * 2).min(Duration::from_secs(30));
                eprintln!("deltafin: part of expert {}/{} failed ({msg}); reading it from another drive", key.0, key.1);
                let now = Instant::now();
                // Another copy holding these bytes: a whole copy, never another stripe.
                let next = e
                    .copies
                    .iter()
                    .enumerate()
                    .filter(|(i, c)| *i != copy && c.stripe.is_none() && st.homes[c.home].quarantined_until.is_none_or(|t| t <= now))
                    .min_by_key(|(_, c)| st.homes[c.home].queued_bytes)
                    .map(|(i, _)| i);
                let inf = st.inflight.get_mut(&key).expect("present");
                let split = inf.split.as_mut().expect("split");
                match next {
                    Some(n) => {
                        let p = &mut split.parts[part];
                        p.copy = n;
                        p.run = Run::Queued;
                        let other = e.copies[n].home;
                        st.homes[other].queued_bytes += len;
                        st.homes[other].demand.push_front(Job { key, part: Some(PartRef { index: part, split: id }), len });
                    }
                    None => {
                        let inf = st.inflight.remove(&key).expect("present");
                        let last = match &e.copies[copy].stripe {
                            Some(s) => format!(
                                "{msg}; the drive at {} holds bytes {}..{} of this expert and no other drive has them (a striped store keeps \
                                 one copy of every byte): bring the drive back, or re-run setup onto working drives",
                                self.manifest.homes[home].display(),
                                s.start,
                                s.start + s.len
                            ),
                            None => msg.clone(),
                        };
                        for w in &inf.waiters {
                            let _ = w
                                .send((key.1, Err(crate::Error::Unavailable { layer: key.0, expert: key.1 as usize, last: last.clone() })));
                        }
                    }
                }
            }
        }
        drop(st);
        self.work.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(len: u64, drives: &[(usize, f64, u64)]) -> Vec<(usize, u64)> {
        let shares = plan_shares(len, drives, 1 << 19);
        assert_eq!(shares.iter().map(|s| s.1).sum::<u64>(), len, "{shares:?}");
        assert!(shares.iter().all(|s| s.1 > 0), "{shares:?}");
        for s in &shares[..shares.len() - 1] {
            assert_eq!(s.1 % BUF_ALIGN as u64, 0, "{shares:?}");
        }
        shares
    }

    #[test]
    fn equal_idle_drives_share_equally() {
        let len = 17_547_264 + 100;
        let shares = check(len, &[(0, 1e8, 0), (1, 1e8, 0), (2, 1e8, 0)]);
        assert_eq!(shares.len(), 3);
        assert!(shares.iter().all(|s| s.1.abs_diff(len / 3) < 8192), "{shares:?}");
    }

    #[test]
    fn a_drive_whose_backlog_outlasts_the_others_gets_nothing_and_the_rest_still_add_up() {
        // Unequal drives (13.6 : 7.1 : 7.1 : 5.7), the slowest holding a long queue: the moment
        // worked out with it would give the others more than the expert (this once made a part
        // run past the end of the expert's buffer).
        let len = 17_547_264;
        let drives = [(0, 136e6, 0), (1, 71e6, 4 << 20), (2, 71e6, 0), (3, 57e6, 60 << 20)];
        let shares = check(len, &drives);
        assert!(shares.iter().all(|s| s.0 != 3), "{shares:?}");
        let fast = shares.iter().find(|s| s.0 == 0).unwrap().1;
        let slow = shares.iter().find(|s| s.0 == 2).unwrap().1;
        assert!(fast > slow, "{shares:?}");
    }

    #[test]
    fn every_drive_far_behind_reads_whole_from_the_first_free() {
        let shares = check(4 << 20, &[(0, 1e8, 900 << 20), (1, 1e8, 800 << 20)]);
        assert_eq!(shares, vec![(1, 4 << 20)]);
    }
}
