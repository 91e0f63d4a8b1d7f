//! Kept states: sequences kept between generations so that a prompt extending one (a chat's next
//! turn, from any of several conversations) runs only its new tokens.
//!
//! The cache holds whole [`Sequence`]s, least recently used evicted first, within a byte
//! allowance that the RAM budget reserves ([`crate::EngineBuilder::kept_states`]). A kept state
//! is taken out while a generation continues it, so no two generations share one. The kernels are
//! batch-invariant, so a continuation is bit-identical to a cold run whichever state it reuses.

use deltafin_core::K3Config;

use crate::sequence::Sequence;

/// Sequences kept for reuse, within a byte allowance.
#[derive(Debug, Default)]
pub(crate) struct KeptStates {
    /// Each with the clock value of its last use.
    entries: Vec<(u64, Sequence)>,
    allowance: usize,
    clock: u64,
}

impl KeptStates {
    /// An empty cache holding at most `allowance` bytes of state (0: keeps nothing).
    pub(crate) fn new(allowance: usize) -> KeptStates {
        KeptStates { entries: Vec::new(), allowance, clock: 0 }
    }

    /// Takes out the longest kept state that `prompt` strictly extends (at least one new token
    /// to run) and that has room for `prompt` plus `max_new` tokens.
    pub(crate) fn take_longest(&mut self, prompt: &[u32], max_new: usize) -> Option<Sequence> {
        let fits =
            |s: &Sequence| s.ids().len() < prompt.len() && prompt.starts_with(s.ids()) && prompt.len() + max_new <= s.context_limit();
        let best = self.entries.iter().enumerate().filter(|(_, (_, s))| fits(s)).max_by_key(|(_, (_, s))| s.ids().len())?.0;
        Some(self.entries.swap_remove(best).1)
    }

    /// A copy of the longest kept state that `prompt` strictly extends with room for `prompt`
    /// plus `max_new` tokens, leaving it kept (a prefix many prompts share).
    pub(crate) fn copy_longest(&mut self, prompt: &[u32], max_new: usize) -> Option<Sequence> {
        let seq = self.take_longest(prompt, max_new)?;
        let copy = seq.clone();
        self.insert(seq);
        Some(copy)
    }

    /// Keeps `seq`, evicting the least recently used states until all fit the allowance. A
    /// state holding exactly the same tokens as `seq` is replaced; one too large alone is not kept.
    pub(crate) fn keep(&mut self, seq: Sequence, cfg: &K3Config) {
        if self.make_room(&seq, cfg) {
            self.insert(seq);
        }
    }

    /// Drops a state with `seq`'s tokens and the least recently used ones until `seq` fits;
    /// `false` if it should not be kept (empty, or larger than the whole allowance).
    fn make_room(&mut self, seq: &Sequence, cfg: &K3Config) -> bool {
        let size = seq.bytes(cfg);
        if seq.ids().is_empty() || size > self.allowance {
            return false;
        }
        self.entries.retain(|(_, s)| s.ids() != seq.ids());
        while self.bytes(cfg) + size > self.allowance {
            let Some(oldest) = self.entries.iter().enumerate().min_by_key(|(_, (t, _))| *t).map(|(i, _)| i) else { break };
            self.entries.swap_remove(oldest);
        }
        true
    }

    fn insert(&mut self, seq: Sequence) {
        self.clock += 1;
        self.entries.push((self.clock, seq));
    }

    /// Keeps a copy of `seq` (taken only once there is room for it).
    pub(crate) fn keep_copy(&mut self, seq: &Sequence, cfg: &K3Config) {
        if self.make_room(seq, cfg) {
            self.insert(seq.clone());
        }
    }

    /// Bytes of state kept now.
    pub(crate) fn bytes(&self, cfg: &K3Config) -> usize {
        self.entries.iter().map(|(_, s)| s.bytes(cfg)).sum()
    }

    /// States kept now.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Forgets every kept state.
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
    }
}
