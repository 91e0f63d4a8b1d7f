//! Split reads: one expert read in parts, from several drives and several reader threads at once.
//!
//! When every copy of an expert sits at an aligned offset, a demand read is cut into page-aligned
//! shares sized so that each drive holding a copy, given what it already has queued and its
//! measured rate, finishes at the same moment; each share is cut again over that drive's reader
//! threads, so one expert keeps the whole queue depth busy. The parts land in one buffer; when
//! the last arrives the whole expert is checked against its checksum. A failing part moves to
//! another drive; a checksum mismatch falls back to whole reads, copy by copy, so a corrupt copy
//! is found and reported exactly as without splitting.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use deltafin_core::Bytes;

use super::{Inflight, Inner, Job, Key, ReadSlot, State, DEFAULT_RATE};
use crate::memory::{AlignedBuf, BUF_ALIGN};
use crate::reader::{open_for_read, read_aligned};
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

/// The parts of one split read and the buffer they fill.
pub(super) struct Split {
    parts: Vec<Part>,
    buf: Option<Arc<AlignedBuf>>,
    allocating: bool,
}

impl Split {
    /// Whether the shared buffer has been allocated (and counts against the budget).
    pub(super) fn holds_buffer(&self) -> bool {
        self.buf.is_some()
    }
}

/// Marks part `part` taken by a reader of `home`; `None` if it is not (or no longer) queued there.
pub(super) fn take_part(inf: &mut Inflight, part: usize) -> Option<(Priority, usize)> {
    let split = inf.split.as_mut()?;
    let p = split.parts.get_mut(part)?;
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
    let queued: Vec<(usize, usize, u64)> =
        split.parts.iter().enumerate().filter(|(_, p)| p.run == Run::Queued).map(|(n, p)| (homes_of(p.copy), n, p.len)).collect();
    for (home, n, len) in queued {
        st.homes[home].queued_bytes += len;
        st.homes[home].demand.push_back(Job { key, part: Some(n), len });
    }
}

impl Inner {
    /// Plans and queues a split read of `key` for `waiter` (none for a prefetch); `false` if it
    /// should be read whole.
    pub(super) fn start_split(&self, st: &mut State, key: Key, waiter: Option<Sender<Delivery>>, priority: Priority) -> bool {
        let e = self.entry(key);
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
        // Equal finish times: (queued_h + s_h) / rate_h = T for every drive, sum s_h = len.
        let rate = |i: usize| {
            let r = st.homes[e.copies[i].home].stats.rate;
            if r > 0.0 {
                r
            } else {
                DEFAULT_RATE
            }
        };
        let total_rate: f64 = usable.iter().map(|&i| rate(i)).sum();
        let backlog: f64 = usable.iter().map(|&i| st.homes[e.copies[i].home].queued_bytes as f64).sum();
        let t = (e.len as f64 + backlog) / total_rate;
        let piece_min = (min / 4).max(BUF_ALIGN as u64);
        let mut sizes: Vec<(usize, u64)> = usable
            .iter()
            .map(|&i| {
                let want = (t * rate(i) - st.homes[e.copies[i].home].queued_bytes as f64).max(0.0) as u64;
                (i, want / BUF_ALIGN as u64 * BUF_ALIGN as u64)
            })
            .filter(|&(_, s)| s >= piece_min)
            .collect();
        if sizes.is_empty() {
            // Every drive is far behind the others' finish time: read it whole from the best.
            let best = usable.iter().copied().min_by(|&a, &b| {
                let eta = |i: usize| st.homes[e.copies[i].home].queued_bytes as f64 / rate(i);
                eta(a).total_cmp(&eta(b))
            });
            sizes.extend(best.map(|i| (i, e.len)));
        }
        // Rounding leftovers go to the last share; it also carries the unaligned tail.
        let assigned: u64 = sizes[..sizes.len() - 1].iter().map(|s| s.1).sum();
        let last = sizes.len() - 1;
        sizes[last].1 = e.len - assigned;
        // Each drive's share is cut again over its reader threads, so that the drive's queue stays
        // full to the end of a layer: the last few reads of a step would otherwise run at queue
        // depth one, at about half the drive's throughput (`cargo xtask bench device`).
        let mut parts = Vec::new();
        let mut start = 0;
        for (copy, len) in sizes {
            let pieces = (len / piece_min).clamp(1, lanes as u64);
            let step = (len / pieces).div_ceil(BUF_ALIGN as u64) * BUF_ALIGN as u64;
            let end = start + len;
            while start < end {
                let n = step.min(end - start);
                parts.push(Part { copy, start, len: n, run: Run::Queued });
                start += n;
            }
        }
        if parts.len() < 2 {
            return false;
        }
        for (n, p) in parts.iter().enumerate() {
            let home = e.copies[p.copy].home;
            st.homes[home].queued_bytes += p.len;
            let job = Job { key, part: Some(n), len: p.len };
            match priority {
                Priority::Demand => st.homes[home].demand.push_back(job),
                Priority::Prefetch => st.homes[home].prefetch.push_back(job),
            }
        }
        let split = Split { parts, buf: None, allocating: false };
        st.inflight
            .insert(key, Inflight { waiters: waiter.into_iter().collect(), priority, tried: vec![], started: true, split: Some(split) });
        true
    }

    /// Gets (or allocates, once) the buffer all parts of `key` write into.
    fn split_buffer(&self, key: Key, window: u64, priority: Priority) -> Option<Arc<AlignedBuf>> {
        let mut st = self.state.lock().expect("poisoned");
        loop {
            let split = st.inflight.get_mut(&key)?.split.as_mut()?;
            if let Some(b) = &split.buf {
                return Some(b.clone());
            }
            if !split.allocating {
                split.allocating = true;
                drop(st);
                let buf = self.alloc(window as usize, key, priority).map(Arc::new);
                let mut st = self.state.lock().expect("poisoned");
                let split = st.inflight.get_mut(&key).and_then(|i| i.split.as_mut());
                let out = match (split, buf) {
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

    /// Reads part `part` of a split read on `home` and completes the expert when it is the last.
    pub(super) fn run_part(&self, slot: ReadSlot<'_>, job: Job, part: usize, copy: usize, priority: Priority) {
        let home = slot.home;
        let key = job.key;
        let e = self.entry(key);
        let window = e.len.div_ceil(BUF_ALIGN as u64) * BUF_ALIGN as u64;
        let Some(buf) = self.split_buffer(key, window, priority) else {
            let mut st = self.state.lock().expect("poisoned");
            if st.inflight.get(&key).is_some_and(|i| i.waiters.is_empty() && i.priority == Priority::Prefetch) {
                // A guess that finds no room is dropped, never waited for.
                st.inflight.remove(&key);
                st.homes[home].queued_bytes -= job.len;
                drop(st);
                self.work.notify_all();
                return;
            }
            // No room yet: put the part back and let other jobs (which may free memory) run.
            if let Some(p) = st.inflight.get_mut(&key).and_then(|i| i.split.as_mut()).and_then(|s| s.parts.get_mut(part)) {
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
            let st = self.state.lock().expect("poisoned");
            match st.inflight.get(&key).and_then(|i| i.split.as_ref()).and_then(|s| s.parts.get(part)) {
                Some(p) => (p.start, p.len),
                None => {
                    drop(st);
                    self.state.lock().expect("poisoned").homes[home].queued_bytes -= job.len;
                    return;
                }
            }
        };
        let c = &e.copies[copy];
        let path = self.manifest.copy_path(c);
        let t0 = Instant::now();
        let due = self.pace_slot(home, len);
        let room = (window - start) as usize;
        // SAFETY: each part writes only [start, start + room) of the shared buffer, and parts
        // cover disjoint ranges (start is page-aligned and parts do not overlap); nobody reads the
        // buffer before every part is done.
        let dst = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr_for_parts().add(start as usize), room) };
        let result = open_for_read(&path, self.opts.cache_mode)
            .and_then(|(f, _)| read_aligned(&f, c.offset + start, len, dst))
            .map_err(|err| format!("{}: {err}", path.display()));
        if let Some(due) = due {
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
        }
        let secs = t0.elapsed().as_secs_f64();
        drop(slot);
        let mut st = self.state.lock().expect("poisoned");
        st.homes[home].queued_bytes -= job.len;
        let Some(inf) = st.inflight.get_mut(&key) else {
            // A stale guess, cancelled while this part was being read.
            if result.is_ok() {
                st.stats.prefetch_wasted_bytes += len;
            }
            return;
        };
        let Some(split) = inf.split.as_mut() else { return };
        if !split.buf.as_ref().is_some_and(|b| Arc::ptr_eq(b, &buf)) {
            // This part belongs to a cancelled guess; the expert was requested afresh since.
            if result.is_ok() {
                st.stats.prefetch_wasted_bytes += len;
            }
            return;
        }
        match result {
            Ok(_) => {
                split.parts[part].run = Run::Done;
                let done = split.parts.iter().all(|p| p.run == Run::Done);
                Self::note_read(&mut st, home, len, secs);
                if done {
                    // The checksum reads the whole expert: not under the lock every reader and
                    // the engine's requests share.
                    drop(st);
                    let owner: Arc<dyn deltafin_core::ByteOwner> = buf.clone();
                    let bytes = Bytes::new(owner, 0, e.len as usize);
                    let good = crate::manifest::checksum(bytes.as_slice()) == e.xxh3;
                    let mut st = self.state.lock().expect("poisoned");
                    let still_wanted = st
                        .inflight
                        .get(&key)
                        .and_then(|i| i.split.as_ref())
                        .is_some_and(|s| s.buf.as_ref().is_some_and(|b| Arc::ptr_eq(b, &buf)));
                    if !still_wanted {
                        // A guess cancelled while its expert was being checked.
                        st.stats.prefetch_wasted_bytes += e.len;
                    } else if good {
                        Self::deliver(&mut st, key, bytes);
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
                let next = e
                    .copies
                    .iter()
                    .enumerate()
                    .filter(|(i, c)| *i != copy && st.homes[c.home].quarantined_until.is_none_or(|t| t <= now))
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
                        st.homes[other].demand.push_front(Job { key, part: Some(part), len });
                    }
                    None => {
                        let inf = st.inflight.remove(&key).expect("present");
                        for w in &inf.waiters {
                            let _ =
                                w.send((key.1, Err(crate::Error::Unavailable { layer: key.0, expert: key.1 as usize, last: msg.clone() })));
                        }
                    }
                }
            }
        }
        drop(st);
        self.work.notify_all();
    }
}
