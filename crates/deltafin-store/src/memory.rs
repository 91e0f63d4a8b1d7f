//! RAM for expert bytes: page-aligned buffers (direct I/O needs them) that are counted against
//! a byte budget from allocation to drop, wherever they travel (cache, channel, engine).
//!
//! A dropped buffer's mapping is kept as a spare (still counted) and handed to the next buffer
//! of the same size: mapping fresh memory for every 17.5 MB read costs thousands of page faults
//! and zeroing per read, over a core's worth of kernel time at decode speed on two cores, which
//! the expert kernels then lack. Spares are unmapped first whenever the budget is short.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use deltafin_core::ByteOwner;

/// Alignment of expert buffers (a page; `O_DIRECT` wants the logical block size or more).
pub const BUF_ALIGN: usize = 4096;

/// A byte budget shared by every expert buffer.
pub struct Budget {
    cap: u64,
    /// Bytes of live buffers plus spares.
    used: AtomicU64,
    peak: AtomicU64,
    mu: Mutex<()>,
    cv: Condvar,
    spares: Mutex<Vec<Mapping>>,
}

/// An anonymous mapping (address as an integer, so the list is `Send`).
struct Mapping {
    addr: usize,
    len: usize,
}

impl Mapping {
    /// `huge`: ask for huge pages (see below).
    fn new(len: usize, huge: bool) -> Mapping {
        // SAFETY: an anonymous private mapping; failure is checked below.
        let ptr = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        if ptr == libc::MAP_FAILED {
            std::alloc::handle_alloc_error(std::alloc::Layout::from_size_align(len, BUF_ALIGN).expect("valid layout"));
        }
        // Huge pages where the kernel offers them on request: 512 times fewer faults. Advice
        // only; refusal changes nothing.
        if huge {
            // SAFETY: the range was just mapped.
            unsafe { libc::madvise(ptr, len, libc::MADV_HUGEPAGE) };
        }
        Mapping { addr: ptr as usize, len }
    }
    fn unmap(self) {
        // SAFETY: mapped in `new` with this length and no longer referenced.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}

impl Budget {
    /// A budget of `cap` bytes.
    pub fn new(cap: u64) -> Arc<Budget> {
        Arc::new(Budget {
            cap,
            used: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            mu: Mutex::new(()),
            cv: Condvar::new(),
            spares: Mutex::new(Vec::new()),
        })
    }
    /// The cap.
    pub fn cap(&self) -> u64 {
        self.cap
    }
    /// Bytes held now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }
    /// Most bytes ever held at once.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Acquire)
    }
    /// Reserves `n` bytes if they fit now, unmapping spares to make room.
    pub fn try_reserve(&self, n: u64) -> bool {
        let mut cur = self.used.load(Ordering::Acquire);
        loop {
            if cur + n > self.cap {
                let spare = self.spares.lock().expect("poisoned").pop();
                match spare {
                    Some(m) => {
                        self.used.fetch_sub(m.len as u64, Ordering::AcqRel);
                        m.unmap();
                        cur = self.used.load(Ordering::Acquire);
                        continue;
                    }
                    None => return false,
                }
            }
            match self.used.compare_exchange_weak(cur, cur + n, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    self.peak.fetch_max(cur + n, Ordering::AcqRel);
                    return true;
                }
                Err(now) => cur = now,
            }
        }
    }
    /// Takes a spare mapping of exactly `len` bytes; its charge stays (it becomes the new
    /// buffer's).
    fn take_spare(&self, len: usize) -> Option<Mapping> {
        let mut spares = self.spares.lock().expect("poisoned");
        let i = spares.iter().position(|m| m.len == len)?;
        Some(spares.swap_remove(i))
    }
    /// Keeps a dropped buffer's mapping (still counted) for reuse.
    fn put_spare(&self, m: Mapping) {
        self.spares.lock().expect("poisoned").push(m);
        let _g = self.mu.lock().expect("poisoned");
        self.cv.notify_all();
    }
    /// Waits a little for some buffer to be dropped.
    pub fn wait_for_release(&self, timeout: Duration) {
        let g = self.mu.lock().expect("poisoned");
        let _ = self.cv.wait_timeout(g, timeout).expect("poisoned");
    }
}

impl Drop for Budget {
    fn drop(&mut self) {
        for m in self.spares.get_mut().expect("poisoned").drain(..) {
            m.unmap();
        }
    }
}

/// A page-aligned buffer whose bytes were reserved from a [`Budget`]; its contents start
/// unspecified (a reused mapping holds an earlier read).
///
/// Backed by its own anonymous memory map rather than malloc, whose arenas would keep freed
/// expert-sized chunks outside the budget's count and let RSS creep past it.
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
    budget: Arc<Budget>,
}

// SAFETY: the mapping is uniquely owned; shared access is read-only via `bytes()`.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above: no interior mutability after construction.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A buffer of `len` bytes (rounded up to the alignment) if the budget has room: a spare of
    /// that size is taken over as it is (no new charge, no page faults); otherwise the bytes are
    /// reserved, unmapping spares of other sizes if need be, and freshly mapped.
    pub fn try_new(len: usize, budget: &Arc<Budget>) -> Option<AlignedBuf> {
        let len = Self::charge(len) as usize;
        let m = match budget.take_spare(len) {
            Some(m) => m,
            None if budget.try_reserve(len as u64) => Mapping::new(len, true),
            None => return None,
        };
        Some(AlignedBuf { ptr: m.addr as *mut u8, len, budget: budget.clone() })
    }
    /// Bytes counted against the budget for a request of `len`.
    pub fn charge(len: usize) -> u64 {
        (len.div_ceil(BUF_ALIGN) * BUF_ALIGN).max(BUF_ALIGN) as u64
    }
    /// Base pointer for split reads, whose parts fill disjoint ranges of one shared buffer.
    /// Writing through it is `unsafe`: ranges must not overlap and nobody may read meanwhile.
    pub(crate) fn as_ptr_for_parts(&self) -> *mut u8 {
        self.ptr
    }
    /// Writable view (before it is shared).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for len bytes and uniquely owned here.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl ByteOwner for AlignedBuf {
    fn bytes(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes for the buffer's lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        self.budget.put_spare(Mapping { addr: self.ptr as usize, len: self.len });
    }
}

/// Page-aligned anonymous memory outside any [`Budget`] (the spine, which the engine counts
/// itself), for direct reads. Zeroed when made.
///
/// Not on huge pages: with the spine's hundreds of MB on them, streamed decode on `slice`
/// waited twice as long for expert reads (the expert buffers, which ask for huge pages, then
/// met a kernel compacting memory for theirs); `bench ab` measured decode at 0.84x.
pub struct Pages {
    map: Mapping,
    len: usize,
}

impl Pages {
    /// `len` bytes (at least one page is mapped; `bytes()` has exactly `len`).
    pub fn new(len: usize) -> Pages {
        Pages { map: Mapping::new(AlignedBuf::charge(len) as usize, false), len }
    }
    /// Writable view (before it is shared).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is valid for at least len bytes and uniquely owned here.
        unsafe { std::slice::from_raw_parts_mut(self.map.addr as *mut u8, self.len) }
    }
}

impl ByteOwner for Pages {
    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is valid for at least len bytes for the value's lifetime.
        unsafe { std::slice::from_raw_parts(self.map.addr as *const u8, self.len) }
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        Mapping { addr: self.map.addr, len: self.map.len }.unmap();
    }
}

/// Peak resident set size of this process: on Linux its own high-water mark (`VmHWM`), not
/// `ru_maxrss`, which keeps the forking parent's peak across fork and exec (a child of a 100 MB
/// process would report 100 MB); elsewhere getrusage (macOS reports bytes).
pub fn peak_rss_bytes() -> u64 {
    #[cfg(target_os = "linux")]
    if let Some(kb) = std::fs::read_to_string("/proc/self/status").ok().and_then(|s| {
        s.lines().find_map(|l| l.strip_prefix("VmHWM:").and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok()))
    }) {
        return kb * 1024;
    }
    // SAFETY: getrusage writes into the zeroed struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0;
    }
    let v = ru.ru_maxrss as u64;
    if cfg!(target_os = "macos") {
        v
    } else {
        v * 1024
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_buffers_are_reused_and_give_way_when_the_budget_is_short() {
        let budget = Budget::new(3 * 8192);
        let mut a = AlignedBuf::try_new(8192, &budget).unwrap();
        a.as_mut_slice()[0] = 7;
        let addr = a.as_ptr_for_parts() as usize;
        drop(a);
        // The spare still counts (it is resident) ...
        assert_eq!(budget.used(), 8192);
        // ... and the next buffer of its size takes it over without a second charge, even when
        // the budget has no room left beside it.
        let filler = AlignedBuf::try_new(2 * 8192, &budget).unwrap();
        let b = AlignedBuf::try_new(8192, &budget).unwrap();
        assert_eq!(b.as_ptr_for_parts() as usize, addr);
        assert_eq!(budget.used(), 3 * 8192);
        drop(b);
        drop(filler);
        // A reservation that does not fit beside the spares unmaps them instead of failing.
        let c = AlignedBuf::try_new(3 * 8192, &budget).unwrap();
        assert_eq!(budget.used(), 3 * 8192);
        assert!(!budget.try_reserve(1));
        assert!(AlignedBuf::try_new(8192, &budget).is_none());
        drop(c);
        assert_eq!(budget.used(), 3 * 8192);
        assert_eq!(budget.peak(), 3 * 8192);
    }
}
