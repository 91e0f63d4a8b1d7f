//! RAM for expert bytes: page-aligned buffers (direct I/O needs them) that are counted against
//! a byte budget from allocation to drop, wherever they travel (cache, channel, engine).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use deltafin_core::ByteOwner;

/// Alignment of expert buffers (a page; `O_DIRECT` wants the logical block size or more).
pub const BUF_ALIGN: usize = 4096;

/// A byte budget shared by every expert buffer.
pub struct Budget {
    cap: u64,
    used: AtomicU64,
    peak: AtomicU64,
    mu: Mutex<()>,
    cv: Condvar,
}

impl Budget {
    /// A budget of `cap` bytes.
    pub fn new(cap: u64) -> Arc<Budget> {
        Arc::new(Budget { cap, used: AtomicU64::new(0), peak: AtomicU64::new(0), mu: Mutex::new(()), cv: Condvar::new() })
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
    /// Reserves `n` bytes if they fit now.
    pub fn try_reserve(&self, n: u64) -> bool {
        let mut cur = self.used.load(Ordering::Acquire);
        loop {
            if cur + n > self.cap {
                return false;
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
    fn release(&self, n: u64) {
        self.used.fetch_sub(n, Ordering::AcqRel);
        let _g = self.mu.lock().expect("poisoned");
        self.cv.notify_all();
    }
    /// Waits a little for some buffer to be dropped.
    pub fn wait_for_release(&self, timeout: Duration) {
        let g = self.mu.lock().expect("poisoned");
        let _ = self.cv.wait_timeout(g, timeout).expect("poisoned");
    }
}

/// A zeroed, page-aligned buffer whose bytes were reserved from a [`Budget`].
///
/// Backed by its own anonymous memory map, so dropping it returns the pages to the system at
/// once: malloc arenas would keep freed expert-sized chunks and let RSS creep past the budget.
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
    /// Maps `len` bytes (rounded up to the alignment) already reserved in `budget`.
    pub fn new_reserved(len: usize, budget: Arc<Budget>) -> AlignedBuf {
        let len = (len.div_ceil(BUF_ALIGN) * BUF_ALIGN).max(BUF_ALIGN);
        // SAFETY: an anonymous private mapping; failure is checked below.
        let ptr = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        if ptr == libc::MAP_FAILED {
            std::alloc::handle_alloc_error(std::alloc::Layout::from_size_align(len, BUF_ALIGN).expect("valid layout"));
        }
        AlignedBuf { ptr: ptr as *mut u8, len, budget }
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
        // SAFETY: mapped in `new_reserved` with this length.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
        self.budget.release(self.len as u64);
    }
}
