//! What the benchmarks share: reproducible pseudo-random bytes.

/// `n` bytes in `[lo, lo + span)` from a xorshift seeded with `seed`.
pub fn bytes(n: usize, seed: u64, lo: u8, span: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            lo + (x % span) as u8
        })
        .collect()
}
