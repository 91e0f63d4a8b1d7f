//! Output rows handed to threads first come, first served, in chunks that shrink toward the end.
//!
//! A product split into equal blocks ends with one core finishing its last block while the other
//! waits: with prompt-sized blocks (128 weight rows of a 3072-row expert matrix) that wait is
//! half a block per product on average, and an expert-major prompt runs thousands of products
//! (a hand perf run of a 512-token prompt on `slice` found one core alone in the tiles for 5%
//! of the wall time). Here big chunks go first and small ones last, each taken by whichever
//! thread is free, so the last chunk any core waits on is small.
//!
//! Only which thread computes a row and when change: every value is still its one fixed-order
//! dot, so results are identical for any chunking and thread count.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use rayon::prelude::*;

/// `rows` cut into consecutive ranges for `threads` threads: each `left / (2 * threads)` rows
/// (`left`: rows not yet in a range) rounded up to a multiple of `min`, at most `max`, so the
/// first chunks are `max` rows and the last ones `min` (every chunk but the last a multiple of
/// `min`).
pub fn row_chunks(rows: usize, max: usize, min: usize, threads: usize) -> Vec<Range<usize>> {
    let (min, max) = (min.max(1), max.max(min.max(1)));
    let mut chunks = Vec::new();
    let mut start = 0;
    while start < rows {
        let left = rows - start;
        let len = left.div_ceil(2 * threads.max(1)).next_multiple_of(min).clamp(min, max).min(left);
        chunks.push(start..start + len);
        start += len;
    }
    chunks
}

/// `f()` on a thread of the compute pool (the pool every parallel kernel here runs on), the
/// calling thread waiting; in place when called from a pool thread already.
///
/// A caller outside the pool that runs many short parallel products one after another (a
/// decode step runs hundreds) hands each one to the pool and sleeps until it is done: a sleep
/// and a wake-up per product. From a pool thread, each product starts on the caller, which
/// takes its share of the work, and the caller sleeps once for all of them.
pub fn on_compute_threads<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    // `rayon::scope` runs its closure on a pool thread (`in_place_scope` would not).
    rayon::scope(|_| f())
}

/// `f(item)` for every item on every thread of the pool, items taken in order by whichever thread
/// is free; the results in the items' order.
pub fn first_come<T: Send, R: Send>(items: Vec<T>, f: impl Fn(T) -> R + Sync) -> Vec<R> {
    let n = items.len();
    // Each slot is taken exactly once (the counter hands out each index once), so no lock is
    // ever contended; a lock only makes the hand-over safe without `unsafe`.
    let slots: Vec<Mutex<Option<T>>> = items.into_iter().map(|i| Mutex::new(Some(i))).collect();
    let results: Vec<Mutex<Option<R>>> = (0..n).map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    let take = |i: usize| slots[i].lock().unwrap_or_else(|p| p.into_inner()).take().expect("each item is taken once");
    // One worker per thread; a thread that starts a second worker finds the items gone.
    (0..rayon::current_num_threads().min(n)).into_par_iter().for_each(|_| loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        let r = f(take(i));
        *results[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
    });
    results.into_iter().map(|r| r.into_inner().unwrap_or_else(|p| p.into_inner()).expect("every item ran")).collect()
}

/// `f(rows, out_rows)` for each chunk of `out` (`per_row` floats per row, rows as `chunks` cut
/// them, which must cover `out` in order), first come, first served on every thread.
pub fn for_row_chunks(out: &mut [f32], per_row: usize, chunks: &[Range<usize>], f: impl Fn(Range<usize>, &mut [f32]) + Sync) {
    let mut parts = Vec::with_capacity(chunks.len());
    let mut rest = out;
    for c in chunks {
        let (part, tail) = std::mem::take(&mut rest).split_at_mut(c.len() * per_row);
        parts.push((c.clone(), part));
        rest = tail;
    }
    assert!(rest.is_empty(), "row chunks cover {} of the output's floats", chunks.last().map_or(0, |c| c.end * per_row));
    first_come(parts, |(rows, part)| f(rows, part));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_rows_in_order_and_shrink() {
        for (rows, max, min, threads) in
            [(3072, 128, 32, 2), (3584, 128, 32, 2), (100, 32, 32, 2), (5, 128, 32, 4), (0, 128, 32, 2), (1000, 128, 16, 1)]
        {
            let c = row_chunks(rows, max, min, threads);
            assert_eq!(c.iter().map(|r| r.len()).sum::<usize>(), rows);
            assert!(c.windows(2).all(|w| w[0].end == w[1].start && w[0].len() >= w[1].len()), "{rows} rows: {c:?}");
            assert!(c.iter().all(|r| r.len() <= max));
            assert!(c.iter().rev().skip(1).all(|r| r.len() % min == 0), "{c:?}");
        }
        let c = row_chunks(3072, 128, 32, 2);
        assert_eq!((c[0].len(), c.last().unwrap().len()), (128, 32));
    }

    #[test]
    fn compute_runs_on_a_pool_thread_and_nested_calls_stay_on_it() {
        // Tests run on threads of their own, outside the pool.
        assert_eq!(rayon::current_thread_index(), None);
        let (outer, inner, sum) = on_compute_threads(|| {
            let outer = rayon::current_thread_index();
            let inner = on_compute_threads(rayon::current_thread_index);
            (outer, inner, (0..1000u64).into_par_iter().sum::<u64>())
        });
        assert!(outer.is_some(), "the closure ran off the pool");
        assert_eq!(inner, outer, "a nested call moved to another thread");
        assert_eq!(sum, 499_500);
    }

    #[test]
    fn every_chunk_runs_once_with_its_rows() {
        let chunks = row_chunks(1000, 64, 8, 3);
        let mut out = vec![0f32; 1000 * 3];
        for_row_chunks(&mut out, 3, &chunks, |rows, part| {
            assert_eq!(part.len(), rows.len() * 3);
            for (i, v) in part.iter_mut().enumerate() {
                *v += (rows.start * 3 + i) as f32;
            }
        });
        assert!(out.iter().enumerate().all(|(i, &v)| v == i as f32));
        assert_eq!(first_come((0..50).collect(), |i: i32| i * 2), (0..50).map(|i| i * 2).collect::<Vec<_>>());
    }
}
