//! A decode step copies no sequence state: what it allocates does not grow with the context.
//! (Its own test binary: the allocation counter is process-wide, so no other test may run beside
//! it.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use deltafin_sched::{EngineBuilder, LoadedModel, Phase, Slot};

/// Counts bytes allocated, so a test can see what one step allocates.
struct Counting;
static ALLOCATED: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATED.fetch_add(new_size as u64, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-k3-dev/checkpoint")
}

fn ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + seed * 101 + 5) % 1000).collect()
}

/// Bytes allocated by one decode step after a prompt of `n` tokens, and the state then held.
fn decode_step_allocation(model: &LoadedModel, n: usize) -> (u64, usize) {
    let mut seq = model.new_sequence();
    model.engine().step(&mut [Slot::new(&mut seq, &ids(n, 8), Phase::Prompt)], None).unwrap();
    let before = ALLOCATED.load(Ordering::Relaxed);
    model.engine().step(&mut [Slot::new(&mut seq, &[9], Phase::Decode)], None).unwrap();
    let bytes = ALLOCATED.load(Ordering::Relaxed) - before;
    (bytes, seq.bytes(model.engine().model().config()))
}

#[test]
fn a_decode_step_copies_no_sequence_state() {
    let model = EngineBuilder::new(fixture()).context(2048).open().unwrap();
    let (short, state_short) = decode_step_allocation(&model, 32);
    let (long, state_long) = decode_step_allocation(&model, 1500);
    let grown = (state_long - state_short) as u64;
    // A copy of the state per step would allocate all of `grown` again; attention scores over the
    // longer context are a small fraction of it.
    assert!(
        long.saturating_sub(short) < grown / 4,
        "a decode step allocates {short} bytes at 33 tokens and {long} at 1501, while the state grew by {grown}"
    );
}
