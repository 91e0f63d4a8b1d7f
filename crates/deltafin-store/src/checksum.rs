//! The checksums a store records and checks: XXH3-64 over each range of bytes (a file, a spine
//! tensor, an expert or a stripe of one) and XXH3-128 for the identity of a whole checkpoint or
//! store.
//!
//! Through twox-hash, which picks its AVX2 or NEON code at run time. xxhash-rust, used before,
//! picks at compile time, so a portable x86-64 build hashed with SSE2, on every byte a run streams
//! (a reader thread checks each expert on the cores the compute runs on): a streamed prompt on
//! `slice` spent about 13% less CPU in its checks (docs/bench/kernels.md). The values are the same
//! XXH3, so stores made before still check.

use std::hash::Hasher;

/// XXH3-64 of `bytes`.
pub fn xxh3_64(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}

/// XXH3-64 of `bytes` with a seed.
pub fn xxh3_64_with_seed(bytes: &[u8], seed: u64) -> u64 {
    twox_hash::XxHash3_64::oneshot_with_seed(seed, bytes)
}

/// XXH3-64 of bytes fed in pieces.
#[derive(Default)]
pub struct Xxh3(twox_hash::XxHash3_64);

impl Xxh3 {
    pub fn new() -> Xxh3 {
        Xxh3::default()
    }
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }
    /// The checksum of everything fed so far.
    pub fn digest(&self) -> u64 {
        self.0.finish()
    }
}

/// XXH3-128 of bytes fed in pieces: an identity.
#[derive(Default)]
pub struct Xxh3Wide(twox_hash::XxHash3_128);

impl Xxh3Wide {
    pub fn new() -> Xxh3Wide {
        Xxh3Wide::default()
    }
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }
    /// The identity of everything fed so far.
    pub fn digest128(&self) -> u128 {
        self.0.finish_128()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Published XXH3 values (xxhsum 0.8), so a change of crate cannot change what stores record.
    #[test]
    fn matches_the_reference_xxh3_values() {
        assert_eq!(xxh3_64(b""), 0x2d06800538d394c2);
        assert_eq!(xxh3_64(b"a"), 0xe6c632b61e964e1f);
        let mut h = Xxh3::new();
        h.update(b"");
        assert_eq!(h.digest(), 0x2d06800538d394c2);
        assert_eq!(Xxh3Wide::new().digest128(), 0x99aa06d3014798d86001c324468d497f);
    }

    #[test]
    fn pieces_hash_as_one() {
        let bytes: Vec<u8> = (0..100_003u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        let (mut h, mut w) = (Xxh3::new(), Xxh3Wide::new());
        for piece in bytes.chunks(77) {
            h.update(piece);
            w.update(piece);
        }
        assert_eq!(h.digest(), xxh3_64(&bytes));
        let mut whole = Xxh3Wide::new();
        whole.update(&bytes);
        assert_eq!(w.digest128(), whole.digest128());
        assert_ne!(xxh3_64_with_seed(&bytes, 1), xxh3_64(&bytes));
    }
}
