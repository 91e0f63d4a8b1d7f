//! The BPE vocabulary in three flat arrays: every token's bytes back to back, where each ends,
//! and an open-addressing table of ids keyed by their bytes.
//!
//! Why not a `HashMap<Vec<u8>, u32>` plus a `Vec<Vec<u8>>`: that costs two heap blocks and a
//! 32-byte table entry per token, several times the tokens' own bytes (K3 has 163,840), all of it
//! out of a `--ram-budget`; these arrays cost the bytes plus 4 bytes per token and per slot
//! (`Vocab::heap_bytes`), and answer a lookup with one hash and, almost always, one byte
//! comparison.

use std::hash::Hasher as _;

/// Marks an empty slot of the table.
const EMPTY: u32 = u32::MAX;

/// Token bytes by id, and id by token bytes.
#[derive(Debug, Clone)]
pub(crate) struct Vocab {
    /// Every token's bytes, in id order.
    bytes: Vec<u8>,
    /// `ends[id]`: where token `id`'s bytes end in `bytes` (it starts where `id - 1`'s end).
    ends: Vec<u32>,
    /// Ids at the slot their bytes hash to, or the next free one after it (linear probing); a
    /// power of two at least twice the ids, so probe runs stay short. The keys are the fixed
    /// vocabulary: text looked up cannot lengthen a run, only end at an empty slot.
    slots: Vec<u32>,
}

impl Vocab {
    pub(crate) fn new() -> Vocab {
        Vocab { bytes: vec![], ends: vec![], slots: vec![EMPTY; 16] }
    }

    /// Number of tokens.
    pub(crate) fn len(&self) -> usize {
        self.ends.len()
    }

    /// Token `id`'s bytes.
    pub(crate) fn bytes(&self, id: u32) -> Option<&[u8]> {
        let id = id as usize;
        let end = *self.ends.get(id)? as usize;
        let start = if id == 0 { 0 } else { self.ends[id - 1] as usize };
        Some(&self.bytes[start..end])
    }

    /// The id whose bytes are `span`.
    pub(crate) fn get(&self, span: &[u8]) -> Option<u32> {
        let mask = self.slots.len() - 1;
        let mut i = hash(span) as usize & mask;
        loop {
            let id = self.slots[i];
            if id == EMPTY {
                return None;
            }
            if self.bytes(id) == Some(span) {
                return Some(id);
            }
            i = (i + 1) & mask;
        }
    }

    /// Adds `token` as the next id; false (and nothing added) if those bytes already have one.
    pub(crate) fn push(&mut self, token: &[u8]) -> bool {
        if self.get(token).is_some() {
            return false;
        }
        let id = self.ends.len() as u32;
        self.bytes.extend_from_slice(token);
        self.ends.push(self.bytes.len() as u32);
        if 2 * self.ends.len() > self.slots.len() {
            self.slots = vec![EMPTY; 2 * self.slots.len()];
            for id in 0..id {
                self.place(id);
            }
        }
        self.place(id);
        true
    }

    /// Shrinks the arrays to their contents (they grew by doubling while the rank file was read).
    pub(crate) fn shrink(&mut self) {
        self.bytes.shrink_to_fit();
        self.ends.shrink_to_fit();
    }

    /// Heap bytes held.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.bytes.capacity() + 4 * self.ends.capacity() + 4 * self.slots.capacity()
    }

    /// The longest token in bytes.
    pub(crate) fn max_len(&self) -> usize {
        (0..self.len() as u32).filter_map(|id| self.bytes(id)).map(<[u8]>::len).max().unwrap_or(1)
    }

    fn place(&mut self, id: u32) {
        let mask = self.slots.len() - 1;
        let mut i = hash(self.bytes(id).expect("placed id exists")) as usize & mask;
        while self.slots[i] != EMPTY {
            i = (i + 1) & mask;
        }
        self.slots[i] = id;
    }
}

/// FxHash of the bytes, its high bits folded down (the table indexes by the low bits, and Fx's
/// last multiply leaves those the weakest).
fn hash(span: &[u8]) -> u64 {
    let mut h = rustc_hash::FxHasher::default();
    h.write(span);
    h.write_usize(span.len());
    let x = h.finish();
    x ^ (x >> 29) ^ (x >> 47)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_every_token_and_nothing_else() {
        let mut v = Vocab::new();
        let tokens: Vec<Vec<u8>> = (0..5000u32).map(|i| format!("t{i}").into_bytes()).chain([vec![], vec![0], vec![0, 0]]).collect();
        for t in &tokens {
            assert!(v.push(t));
        }
        assert!(!v.push(b"t17"), "a duplicate is refused");
        assert_eq!(v.len(), tokens.len());
        for (id, t) in tokens.iter().enumerate() {
            assert_eq!(v.get(t), Some(id as u32));
            assert_eq!(v.bytes(id as u32), Some(t.as_slice()));
        }
        assert_eq!(v.get(b"t5000"), None);
        assert_eq!(v.get(b"x"), None);
        assert_eq!(v.bytes(tokens.len() as u32), None);
        assert_eq!(v.max_len(), 5);
    }
}
