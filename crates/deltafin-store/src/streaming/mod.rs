//! Experts streamed from a store's homes into a budgeted RAM cache.
//!
//! Reader threads per home (drive) pull jobs from two queues, demand before prefetch. Each read
//! goes to the copy whose drive is expected to finish it first (bytes queued / measured rate);
//! a failing drive is quarantined with exponential back-off and its reads go to another copy.
//! Every buffer is reserved from the budget before the read; demand reads evict least recently
//! used entries (and wait for the engine to drop buffers if need be), prefetch reads only take
//! free room or evict older prefetches, and give up rather than push out what the current step
//! uses. Every read is checked against its checksum: a mismatch is never delivered as data.
//!
//! Where several drives hold an expert, a demand read is split into parts sized so that every
//! drive finishes together (`split`): a layer with fewer misses than drives still uses them all.

mod drives;
mod plan;
mod split;

pub use drives::{CappedDrives, DriveIo, LocalDrives};

pub use split::DEFAULT_SPLIT_MIN;

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use deltafin_core::{Bytes, ExpertLayout, ExpertShape};

use crate::error::Error;
use crate::manifest::{checksum, Manifest};
use crate::memory::{AlignedBuf, Budget};
use crate::reader::{aligned_window, CacheMode};
use crate::source::{Delivery, ExpertSource, HomeStats, Priority, SourceStats};
use plan::Plan;

type Key = (usize, u32);

/// Reader settings.
#[derive(Clone, Debug)]
pub struct ReaderOptions {
    /// Reader threads (concurrent reads) per home.
    pub queue_depth: usize,
    /// Page-cache bypass on or off.
    pub cache_mode: CacheMode,
    /// Bytes the expert cache and in-flight buffers may hold.
    pub expert_budget: u64,
    /// Experts never evicted (a hot tier), loaded at start.
    pub pinned: Vec<(usize, u32)>,
    /// Which cached expert to drop first.
    pub policy: CachePolicy,
    /// Demand reads of experts at least this large are split over the drives holding copies
    /// (`u64::MAX`: never split).
    pub split_min: u64,
    /// Read-rate caps in bytes/s per home, in the manifest's order (missing or 0: none). Emulates
    /// slower drives where the kernel cannot (no loop devices or blkio throttle): each read takes
    /// the next slot of its home's byte clock and returns no earlier than the slot's end, so a
    /// home never delivers more than its cap, whatever the disk under it does.
    pub read_caps: Vec<u64>,
    /// A stream store fetches the experts it has not cached in the background, with spare
    /// bandwidth, while the engine runs (no effect on other stores).
    pub background_fill: bool,
}

/// Eviction policy of the expert cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CachePolicy {
    /// Least recently used first.
    Lru,
    /// Needed furthest in the future first: decode walks the layers in a cycle, so the experts of
    /// the layer just computed are the last to be needed again (Belady's rule for this pattern).
    NextUse,
}

struct CacheEntry {
    bytes: Bytes,
    last_use: u64,
    /// Read by a prefetch and not demanded since.
    unused_prefetch: bool,
    pinned: bool,
}

struct Inflight {
    waiters: Vec<Sender<Delivery>>,
    priority: Priority,
    /// Copies already tried (indices into the entry's copies).
    tried: Vec<usize>,
    /// A reader thread has taken the job (a duplicate queue entry must not read it again).
    started: bool,
    /// Set when the read is split into parts over several drives.
    split: Option<split::Split>,
}

/// A queued read: a whole expert, or one part of a split read.
#[derive(Clone, Copy, Debug)]
struct Job {
    key: Key,
    part: Option<split::PartRef>,
    /// Bytes this job adds to its home's backlog.
    len: u64,
}

/// Why a read produced no bytes.
enum ReadFail {
    /// No room in the budget right now (a prefetch is dropped, a demand read requeued).
    Cancelled,
    /// The drive or file failed.
    Io(String),
    /// The bytes do not match the manifest's checksum.
    Corrupt(PathBuf),
}

struct Home {
    stats: HomeStats,
    busy_until: Option<Instant>,
    busy_secs: f64,
    busy_bytes: f64,
    queued_bytes: u64,
    /// Reads in flight on this home (at most the queue depth; a thread checking a checksum or
    /// finishing a delivery holds no slot, so the drive's queue stays full meanwhile).
    reading: usize,
    quarantined_until: Option<Instant>,
    backoff: Duration,
    demand: VecDeque<Job>,
    prefetch: VecDeque<Job>,
}

struct State {
    cache: HashMap<Key, CacheEntry>,
    inflight: HashMap<Key, Inflight>,
    homes: Vec<Home>,
    clock: u64,
    /// Layer of the latest demand request (where the engine is).
    current_layer: usize,
    /// Clock when the current pass (step) began: under LRU a guess may displace what the pass
    /// has not used, never what it has.
    pass_start: u64,
    /// The pass's plan, as the engine told it (`begin_pass`): each layer's position in the order
    /// the pass walks the MoE layers, and how many there are.
    plan: Plan,
    /// Demand counts per expert since the last `take_heat`.
    heat: HashMap<Key, u64>,
    stats: SourceStats,
    shutdown: bool,
}

struct Inner {
    manifest: Manifest,
    /// The drives beneath the cache.
    io: Box<dyn DriveIo>,
    /// What a corrupt expert's error tells the user to do (depends on the store's layout).
    advice: String,
    index: HashMap<Key, usize>,
    layouts: HashMap<usize, ExpertLayout>,
    shape: ExpertShape,
    opts: ReaderOptions,
    budget: Arc<Budget>,
    state: Mutex<State>,
    work: Condvar,
}

/// The streaming [`ExpertSource`] over a store made by `deltafin setup`.
pub struct StreamingExperts {
    inner: Arc<Inner>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

/// One of a home's read slots, held from taking a job until its I/O is done; released on drop
/// (also on every early return). Never dropped while its thread holds the state lock.
struct ReadSlot<'a> {
    inner: &'a Inner,
    home: usize,
}

impl Drop for ReadSlot<'_> {
    fn drop(&mut self) {
        self.inner.state.lock().expect("poisoned").homes[self.home].reading -= 1;
        self.inner.work.notify_all();
    }
}

/// Initial guess of a drive's rate before it is measured (bytes/s).
const DEFAULT_RATE: f64 = 1e9;

impl StreamingExperts {
    /// Starts reader threads over `manifest`, for experts of `shape`; `advice` ends the error of a
    /// corrupt expert (what to do about it).
    pub fn start(manifest: Manifest, shape: ExpertShape, opts: ReaderOptions, advice: String) -> crate::Result<StreamingExperts> {
        let io: Box<dyn DriveIo> = if opts.read_caps.iter().any(|&c| c > 0) {
            Box::new(CappedDrives::new(LocalDrives { mode: opts.cache_mode }, opts.read_caps.clone()))
        } else {
            Box::new(LocalDrives { mode: opts.cache_mode })
        };
        Self::start_with(manifest, shape, opts, advice, io)
    }

    /// [`StreamingExperts::start`] over the drives `io` (a stream store's hub cache).
    pub fn start_with(
        manifest: Manifest,
        shape: ExpertShape,
        opts: ReaderOptions,
        advice: String,
        io: Box<dyn DriveIo>,
    ) -> crate::Result<StreamingExperts> {
        let min = Self::min_budget(shape);
        if opts.expert_budget < min {
            return Err(Error::BudgetTooSmall {
                budget: opts.expert_budget,
                minimum: min,
                why: "the expert cache must hold at least one expert being read".into(),
            });
        }
        let index = manifest.experts.iter().enumerate().map(|(i, e)| ((e.layer, e.expert as u32), i)).collect();
        let layouts = manifest.layouts.iter().map(|(l, o)| (*l, ExpertLayout { offsets: *o, shape })).collect();
        let homes = manifest
            .homes
            .iter()
            .map(|p| Home {
                stats: HomeStats { path: p.display().to_string(), ..Default::default() },
                busy_until: None,
                busy_secs: 0.0,
                busy_bytes: 0.0,
                queued_bytes: 0,
                reading: 0,
                quarantined_until: None,
                backoff: Duration::from_millis(100),
                demand: VecDeque::new(),
                prefetch: VecDeque::new(),
            })
            .collect();
        // Until the engine says otherwise, a pass walks the MoE layers in ascending order.
        let mut moe: Vec<usize> = manifest.layouts.iter().map(|(l, _)| *l).collect();
        moe.sort_unstable();
        let inner = Arc::new(Inner {
            budget: Budget::new(opts.expert_budget),
            io,
            manifest,
            advice,
            index,
            layouts,
            shape,
            opts,
            state: Mutex::new(State {
                cache: HashMap::new(),
                inflight: HashMap::new(),
                homes,
                clock: 0,
                current_layer: 0,
                pass_start: 0,
                plan: Plan::new(&moe),
                heat: HashMap::new(),
                stats: SourceStats::default(),
                shutdown: false,
            }),
            work: Condvar::new(),
        });
        let mut threads = Vec::new();
        for h in 0..inner.manifest.homes.len() {
            // Two threads more than the queue depth: while one checks a finished expert's
            // checksum (about a millisecond per 17.5 MB) the others keep every read slot busy.
            for _ in 0..inner.opts.queue_depth.max(1) + 2 {
                let i = inner.clone();
                threads
                    .push(std::thread::Builder::new().name(format!("deltafin-read-{h}")).spawn(move || i.worker(h)).expect("spawn reader"));
            }
        }
        let s = StreamingExperts { inner, threads };
        let pins = s.inner.opts.pinned.clone();
        for (l, e) in pins {
            s.load_pinned(l, e)?;
        }
        Ok(s)
    }

    /// The smallest expert budget that can run: one expert's aligned window.
    pub fn min_budget(shape: ExpertShape) -> u64 {
        AlignedBuf::charge(shape.total_bytes() + crate::memory::BUF_ALIGN)
    }

    fn load_pinned(&self, l: usize, e: u32) -> crate::Result<()> {
        let rx = self.request(l, &[e], Priority::Demand);
        let (_, r) = rx.recv().map_err(|_| Error::format(&self.inner.manifest.homes[0], "reader stopped"))?;
        r?;
        let mut st = self.inner.state.lock().expect("poisoned");
        if let Some(c) = st.cache.get_mut(&(l, e)) {
            c.pinned = true;
        }
        // Loading the hot tier is not a demand of the model's.
        st.heat.remove(&(l, e));
        Ok(())
    }

    /// Bytes the budget holds now.
    pub fn budget_used(&self) -> u64 {
        self.inner.budget.used()
    }
}

impl Drop for StreamingExperts {
    fn drop(&mut self) {
        self.inner.state.lock().expect("poisoned").shutdown = true;
        self.inner.work.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Inner {
    fn entry(&self, key: Key) -> &crate::manifest::ExpertEntry {
        &self.manifest.experts[self.index[&key]]
    }

    /// The copy (index) expected to finish first among untried, non-quarantined homes.
    fn choose_copy(&self, st: &State, key: Key, tried: &[usize]) -> Option<usize> {
        let e = self.entry(key);
        let now = Instant::now();
        let mut best: Option<(f64, usize)> = None;
        let mut fallback = None;
        for (i, c) in e.copies.iter().enumerate() {
            // A stripe is never read as if it were the expert.
            if tried.contains(&i) || c.stripe.is_some() {
                continue;
            }
            let h = &st.homes[c.home];
            let rate = if h.stats.rate > 0.0 { h.stats.rate } else { DEFAULT_RATE };
            let eta = (h.queued_bytes + e.len) as f64 / rate;
            if h.quarantined_until.is_some_and(|t| t > now) {
                fallback = fallback.or(Some(i));
                continue;
            }
            if best.is_none_or(|(b, _)| eta < b) {
                best = Some((eta, i));
            }
        }
        best.map(|(_, i)| i).or(fallback)
    }

    fn enqueue(&self, st: &mut State, key: Key, copy: usize, priority: Priority) {
        let e = self.entry(key);
        let home = e.copies[copy].home;
        let len = e.len;
        let h = &mut st.homes[home];
        h.queued_bytes += len;
        let job = Job { key, part: None, len };
        match priority {
            Priority::Demand => h.demand.push_back(job),
            Priority::Prefetch => h.prefetch.push_back(job),
        }
    }

    fn worker(self: Arc<Self>, home: usize) {
        loop {
            let (job, priority, copy) = {
                let mut st = self.state.lock().expect("poisoned");
                loop {
                    if st.shutdown {
                        return;
                    }
                    let qd = self.opts.queue_depth.max(1);
                    let h = &mut st.homes[home];
                    if h.reading >= qd {
                        st = self.work.wait(st).expect("poisoned");
                        continue;
                    }
                    let next = h
                        .demand
                        .pop_front()
                        .map(|k| (k, Priority::Demand))
                        .or_else(|| h.prefetch.pop_front().map(|k| (k, Priority::Prefetch)));
                    let Some((job, p)) = next else {
                        st = self.work.wait(st).expect("poisoned");
                        continue;
                    };
                    let take = match st.inflight.get_mut(&job.key) {
                        // A cancelled prefetch, or a duplicate of a job already taken: skip.
                        None => None,
                        Some(inf) => match job.part {
                            Some(part) => split::take_part(inf, part),
                            None if inf.started || inf.split.is_some() => None,
                            None => {
                                inf.started = true;
                                let copy = self
                                    .entry(job.key)
                                    .copies
                                    .iter()
                                    .position(|c| c.home == home)
                                    .expect("queued on a home holding a copy");
                                Some((p.min(inf.priority), copy))
                            }
                        },
                    };
                    match take {
                        Some((p, copy)) => {
                            st.homes[home].reading += 1;
                            break (job, p, copy);
                        }
                        None => st.homes[home].queued_bytes -= job.len,
                    }
                }
            };
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let slot = ReadSlot { inner: &self, home };
                match job.part {
                    Some(part) => self.run_part(slot, job, part, copy, priority),
                    None => {
                        let result = self.read_one(slot, job.key, priority, copy);
                        self.finish(home, job.key, copy, result);
                    }
                }
            }));
            if let Err(panic) = run {
                // A bug must not leave the engine waiting forever on a read that no thread is
                // doing: whoever waits for this expert gets the error, and this thread goes on.
                let why = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "panic".into());
                let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(inf) = st.inflight.remove(&job.key) {
                    for w in &inf.waiters {
                        let _ = w
                            .send((job.key.1, Err(Error::ReaderFailed { layer: job.key.0, expert: job.key.1 as usize, why: why.clone() })));
                    }
                }
                drop(st);
                self.work.notify_all();
            }
        }
    }

    /// Eviction order: larger is evicted first.
    fn evict_rank(&self, plan: &Plan, key: Key, c: &CacheEntry, current: usize) -> (usize, u64) {
        match self.opts.policy {
            CachePolicy::Lru => (0, u64::MAX - c.last_use),
            CachePolicy::NextUse => (plan.next_use(key.0, current), u64::MAX - c.last_use),
        }
    }

    /// A buffer of `len` bytes for `key`, making room by evicting in policy order (a prefetch only
    /// displaces what is needed later than itself); an evicted expert's mapping is reused as is.
    /// Never waits: a reader thread that blocked on memory could hold up the very part whose
    /// completion would free it; on `None` the caller requeues instead.
    fn alloc(&self, len: usize, key: Key, priority: Priority) -> Option<AlignedBuf> {
        loop {
            if let Some(buf) = AlignedBuf::try_new(len, &self.budget) {
                return Some(buf);
            }
            {
                let mut st = self.state.lock().expect("poisoned");
                if st.shutdown {
                    return None;
                }
                let current = st.current_layer;
                let pass_start = st.pass_start;
                let plan = &st.plan;
                let incoming = plan.next_use(key.0, current);
                let victim = st
                    .cache
                    .iter()
                    .filter(|(k, c)| {
                        !c.pinned
                            && match priority {
                                Priority::Demand => true,
                                // A guess displaces only what is needed later than itself
                                // (LRU: other unused guesses, or what this pass has not used).
                                Priority::Prefetch => match self.opts.policy {
                                    CachePolicy::Lru => c.unused_prefetch || c.last_use < pass_start,
                                    CachePolicy::NextUse => plan.next_use(k.0, current) > incoming,
                                },
                            }
                    })
                    .max_by_key(|(k, c)| self.evict_rank(plan, **k, c, current))
                    .map(|(k, _)| *k);
                match victim {
                    Some(k) => {
                        let c = st.cache.remove(&k).expect("victim exists");
                        if c.unused_prefetch {
                            st.stats.prefetch_wasted_bytes += c.bytes.len() as u64;
                        }
                        continue;
                    }
                    None if priority == Priority::Demand => {
                        // A guess part-way through holds a buffer that its remaining parts,
                        // queued behind demand, would release only later: drop the guess.
                        let guess = st
                            .inflight
                            .iter()
                            .find(|(_, f)| {
                                f.waiters.is_empty()
                                    && f.priority == Priority::Prefetch
                                    && f.split.as_ref().is_some_and(split::Split::holds_buffer)
                            })
                            .map(|(k, _)| *k);
                        match guess {
                            Some(k) => {
                                st.inflight.remove(&k);
                                continue;
                            }
                            None => return None,
                        }
                    }
                    None => return None,
                }
            }
        }
    }

    fn read_one(&self, slot: ReadSlot<'_>, key: Key, priority: Priority, copy: usize) -> Result<(Bytes, f64), ReadFail> {
        let e = self.entry(key);
        let c = &e.copies[copy];
        let (start, end) = aligned_window(c.offset, e.len);
        let Some(mut buf) = self.alloc((end - start) as usize, key, priority) else {
            if priority == Priority::Demand {
                // Requeued by `finish`; give the engine a moment to drop a buffer first.
                drop(slot);
                self.budget.wait_for_release(Duration::from_millis(5));
            }
            return Err(ReadFail::Cancelled);
        };
        let path = self.manifest.copy_path(c);
        let t0 = Instant::now();
        let at = self
            .io
            .read(c.home, &path, c.offset, e.len, buf.as_mut_slice())
            .map_err(|err| ReadFail::Io(format!("{}: {err}{}", path.display(), crate::error::io_hint(&err))))?;
        let secs = t0.elapsed().as_secs_f64();
        drop(slot);
        let owner: Arc<dyn deltafin_core::ByteOwner> = Arc::new(buf);
        let bytes = Bytes::new(owner, at, e.len as usize);
        // A stream store's experts carry no checksum in the manifest: only a drive that checks
        // every read itself may deliver them.
        let checked_below = e.xxh3.is_empty() && self.io.self_checked();
        if !checked_below && checksum(bytes.as_slice()) != e.xxh3 {
            return Err(ReadFail::Corrupt(path));
        }
        Ok((bytes, secs))
    }

    /// Records a successful read of `len` bytes from `home` in `secs`.
    fn note_read(st: &mut State, home: usize, len: u64, secs: f64) {
        let h = &mut st.homes[home];
        h.stats.reads += 1;
        h.stats.bytes += len;
        // A drive's rate is bytes over the time it was busy (the union of its reads' intervals),
        // not the mean of per-read rates: concurrent reads each see a fraction of the drive.
        let end = Instant::now();
        let start = end - Duration::from_secs_f64(secs);
        let busy = match h.busy_until {
            Some(u) if u >= end => 0.0,
            Some(u) if u > start => (end - u).as_secs_f64(),
            _ => secs,
        };
        h.busy_until = Some(h.busy_until.map_or(end, |u| u.max(end)));
        h.busy_secs += busy;
        h.stats.busy_s += busy;
        h.busy_bytes += len as f64;
        if h.busy_bytes > 2e9 {
            // Forget slowly, so a drive that changes speed is re-measured.
            h.busy_bytes /= 2.0;
            h.busy_secs /= 2.0;
        }
        if h.busy_secs > 0.0 {
            h.stats.rate = h.busy_bytes / h.busy_secs;
        }
        h.backoff = Duration::from_millis(100);
        h.quarantined_until = None;
        st.stats.bytes_read += len;
    }

    /// Hands verified bytes to everyone waiting and caches them.
    fn deliver(st: &mut State, key: Key, bytes: Bytes) {
        st.clock += 1;
        let clock = st.clock;
        let waiters = st.inflight.remove(&key).map(|i| i.waiters).unwrap_or_default();
        let unused_prefetch = waiters.is_empty();
        for w in &waiters {
            let _ = w.send((key.1, Ok(bytes.clone())));
        }
        st.cache.insert(key, CacheEntry { bytes, last_use: clock, unused_prefetch, pinned: false });
    }

    fn finish(&self, home: usize, key: Key, copy: usize, result: Result<(Bytes, f64), ReadFail>) {
        let len = self.entry(key).len;
        let mut st = self.state.lock().expect("poisoned");
        st.homes[home].queued_bytes -= len;
        match result {
            Ok((bytes, secs)) => {
                Self::note_read(&mut st, home, len, secs);
                Self::deliver(&mut st, key, bytes);
            }
            Err(ReadFail::Cancelled) => {
                // A prefetch that found no room: forget it (nobody waits for it).
                if let Some(inf) = st.inflight.get(&key) {
                    if inf.waiters.is_empty() {
                        st.inflight.remove(&key);
                    } else {
                        // Demanded meanwhile: retry as demand on the same copy.
                        st.inflight.get_mut(&key).expect("present").started = false;
                        self.enqueue(&mut st, key, copy, Priority::Demand);
                    }
                }
            }
            Err(fail) => {
                let (corrupt, msg) = match fail {
                    ReadFail::Corrupt(p) => (Some(p.clone()), format!("checksum mismatch in {}", p.display())),
                    ReadFail::Io(m) => (None, m),
                    ReadFail::Cancelled => unreachable!("handled above"),
                };
                let h = &mut st.homes[home];
                h.stats.errors += 1;
                // Out of file handles is this process's state, not the drive's.
                if corrupt.is_none() && !msg.contains(crate::error::OUT_OF_HANDLES) {
                    // An I/O failure: quarantine the drive with back-off.
                    h.quarantined_until = Some(Instant::now() + h.backoff);
                    h.backoff = (h.backoff * 2).min(Duration::from_secs(30));
                }
                eprintln!("deltafin: read of expert {}/{} failed ({msg}); trying another copy if there is one", key.0, key.1);
                let Some(mut inf) = st.inflight.remove(&key) else {
                    drop(st);
                    self.work.notify_all();
                    return;
                };
                inf.tried.push(copy);
                inf.started = false;
                match self.choose_copy(&st, key, &inf.tried) {
                    Some(next) => {
                        let p = inf.priority;
                        st.inflight.insert(key, inf);
                        self.enqueue(&mut st, key, next, p);
                    }
                    None => {
                        let err = |()| match &corrupt {
                            Some(p) => Error::Corrupt {
                                layer: key.0,
                                expert: key.1 as usize,
                                path: p.clone(),
                                offset: self.entry(key).copies[copy].offset,
                                advice: self.advice.clone(),
                            },
                            None => Error::Unavailable { layer: key.0, expert: key.1 as usize, last: msg.clone() },
                        };
                        for w in &inf.waiters {
                            let _ = w.send((key.1, Err(err(()))));
                        }
                    }
                }
            }
        }
        drop(st);
        self.work.notify_all();
    }
}

impl ExpertSource for StreamingExperts {
    fn layout(&self, layer: usize) -> ExpertLayout {
        self.inner.layouts[&layer]
    }

    fn request(&self, layer: usize, experts: &[u32], priority: Priority) -> Receiver<Delivery> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let inner = &self.inner;
        let mut st = inner.state.lock().expect("poisoned");
        st.clock += 1;
        if priority == Priority::Demand {
            st.current_layer = layer;
            for &e in experts {
                *st.heat.entry((layer, e)).or_default() += 1;
            }
        }
        // Stale guesses: queued prefetches of this layer that were not demanded.
        let stale: Vec<Key> = st
            .inflight
            .iter()
            .filter(|(k, f)| {
                // A split guess is cancelled even part-way: its queued parts are then skipped.
                k.0 == layer
                    && (!f.started || f.split.is_some())
                    && f.waiters.is_empty()
                    && f.priority == Priority::Prefetch
                    && !experts.contains(&k.1)
            })
            .map(|(k, _)| *k)
            .collect();
        for k in stale {
            st.inflight.remove(&k);
        }
        // Largest-first is moot (experts are equal); issue in id order, hits answered at once.
        for &e in experts {
            let key = (layer, e);
            let clock = st.clock;
            if let Some(c) = st.cache.get_mut(&key) {
                c.last_use = clock;
                let was_prefetch = std::mem::replace(&mut c.unused_prefetch, false);
                let _ = tx.send((e, Ok(c.bytes.clone())));
                st.stats.hits += 1;
                if was_prefetch {
                    st.stats.prefetch_used += 1;
                }
                continue;
            }
            st.stats.misses += 1;
            if let Some(inf) = st.inflight.get_mut(&key) {
                let promote = inf.priority == Priority::Prefetch && priority == Priority::Demand;
                if inf.priority == Priority::Prefetch && inf.waiters.is_empty() {
                    st.stats.prefetch_used += 1;
                }
                let inf = st.inflight.get_mut(&key).expect("present");
                inf.waiters.push(tx.clone());
                inf.priority = inf.priority.min(priority);
                if promote {
                    let e = inner.entry(key);
                    split::promote_parts(&mut st, key, |copy| e.copies[copy].home);
                }
                continue;
            }
            if priority == Priority::Demand && inner.start_split(&mut st, key, Some(tx.clone()), Priority::Demand) {
                continue;
            }
            match inner.choose_copy(&st, key, &[]) {
                Some(copy) => {
                    st.inflight.insert(key, Inflight { waiters: vec![tx.clone()], priority, tried: vec![], started: false, split: None });
                    inner.enqueue(&mut st, key, copy, priority);
                }
                None => {
                    let _ = tx.send((e, Err(Error::Unavailable { layer, expert: e as usize, last: "no copy recorded".into() })));
                }
            }
        }
        drop(st);
        inner.work.notify_all();
        rx
    }

    fn begin_pass(&self, layers: &[usize]) {
        let mut st = self.inner.state.lock().expect("poisoned");
        st.clock += 1;
        st.pass_start = st.clock;
        if !st.plan.is(layers) {
            st.plan = Plan::new(layers);
        }
    }

    fn take_heat(&self) -> HashMap<Key, u64> {
        std::mem::take(&mut self.inner.state.lock().expect("poisoned").heat)
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) {
        let inner = &self.inner;
        let mut st = inner.state.lock().expect("poisoned");
        for &e in experts {
            let key = (layer, e);
            if st.cache.contains_key(&key) || st.inflight.contains_key(&key) {
                continue;
            }
            // Split like demand reads, so guessed experts complete one by one and a wrong guess
            // can be dropped between parts.
            if inner.start_split(&mut st, key, None, Priority::Prefetch) {
                st.stats.prefetch_issued += 1;
                continue;
            }
            if let Some(copy) = inner.choose_copy(&st, key, &[]) {
                st.inflight
                    .insert(key, Inflight { waiters: vec![], priority: Priority::Prefetch, tried: vec![], started: false, split: None });
                inner.enqueue(&mut st, key, copy, Priority::Prefetch);
                st.stats.prefetch_issued += 1;
            }
        }
        drop(st);
        inner.work.notify_all();
    }

    fn stats(&self) -> SourceStats {
        let st = self.inner.state.lock().expect("poisoned");
        let mut s = st.stats.clone();
        s.per_home = st.homes.iter().map(|h| h.stats.clone()).collect();
        s.cache_peak_bytes = self.inner.budget.peak();
        s.unverified_bytes = self.inner.io.unverified_bytes();
        s
    }

    fn expert_bytes(&self) -> u64 {
        self.inner.shape.total_bytes() as u64
    }
}
