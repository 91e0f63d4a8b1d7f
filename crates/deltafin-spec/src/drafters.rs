//! Drafters that need no model: prompt lookup (n-grams of the sequence so far), and the
//! adversarial drafters the exactness tests use (an oracle replaying a known continuation, a
//! random one, one that is right for a while and then wrong).

use crate::Drafter;

/// Prompt lookup: finds the latest earlier place where the sequence's last `n` tokens occurred
/// (longest `n` first, from `max_ngram` down to `min_ngram`) and proposes what followed there.
/// Free to run; strong wherever text repeats (code edits, quoting, agents' tool output).
#[derive(Clone, Debug)]
pub struct NgramDrafter {
    pub min_ngram: usize,
    pub max_ngram: usize,
}

impl Default for NgramDrafter {
    fn default() -> Self {
        NgramDrafter { min_ngram: 1, max_ngram: 4 }
    }
}

impl Drafter for NgramDrafter {
    fn draft(&mut self, context: &[u32], n: usize) -> Vec<u32> {
        if n == 0 {
            return Vec::new();
        }
        for g in (self.min_ngram.max(1)..=self.max_ngram).rev() {
            if context.len() <= g {
                continue;
            }
            let tail = &context[context.len() - g..];
            // The latest earlier occurrence whose continuation is in the context.
            for start in (0..context.len() - g).rev() {
                if &context[start..start + g] == tail {
                    let from = start + g;
                    return context[from..(from + n).min(context.len())].to_vec();
                }
            }
        }
        Vec::new()
    }
}

/// Proposes a known continuation (the tests' "always right" drafter: a recorded plain run).
#[derive(Clone, Debug)]
pub struct OracleDrafter {
    /// The full sequence the drafter believes in: prompt, then the continuation.
    pub script: Vec<u32>,
}

impl Drafter for OracleDrafter {
    fn draft(&mut self, context: &[u32], n: usize) -> Vec<u32> {
        if context.len() > self.script.len() || self.script[..context.len()] != *context {
            return Vec::new();
        }
        self.script[context.len()..(context.len() + n).min(self.script.len())].to_vec()
    }
}

/// Proposes random ids below `vocab` (the tests' "always wrong" drafter), deterministically.
#[derive(Clone, Debug)]
pub struct RandomDrafter {
    pub vocab: u32,
    pub state: u64,
}

impl Drafter for RandomDrafter {
    fn draft(&mut self, _context: &[u32], n: usize) -> Vec<u32> {
        (0..n)
            .map(|_| {
                self.state = self.state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((self.state >> 33) % self.vocab as u64) as u32
            })
            .collect()
    }
}

/// Right (an oracle) for its first `right_for` drafts, then random.
#[derive(Clone, Debug)]
pub struct FlakyDrafter {
    pub oracle: OracleDrafter,
    pub random: RandomDrafter,
    pub right_for: usize,
    drafts: usize,
}

impl FlakyDrafter {
    /// An oracle over `script` that turns random after `right_for` drafts.
    pub fn new(script: Vec<u32>, vocab: u32, right_for: usize) -> FlakyDrafter {
        FlakyDrafter { oracle: OracleDrafter { script }, random: RandomDrafter { vocab, state: 7 }, right_for, drafts: 0 }
    }
}

impl Drafter for FlakyDrafter {
    fn draft(&mut self, context: &[u32], n: usize) -> Vec<u32> {
        self.drafts += 1;
        if self.drafts <= self.right_for {
            self.oracle.draft(context, n)
        } else {
            self.random.draft(context, n)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_lookup_proposes_what_followed_the_latest_match() {
        let mut d = NgramDrafter::default();
        // "1 2 3 4 ... 1 2" -> propose "3 4 9".
        assert_eq!(d.draft(&[1, 2, 3, 4, 9, 7, 1, 2], 3), vec![3, 4, 9]);
        // The latest occurrence wins; a continuation shorter than asked is fine.
        assert_eq!(d.draft(&[5, 6, 1, 5, 6, 2, 5, 6], 4), vec![2, 5, 6]);
        assert_eq!(d.draft(&[1, 2, 3], 2), Vec::<u32>::new());
    }

    #[test]
    fn the_oracle_follows_its_script_and_stops_off_it() {
        let mut o = OracleDrafter { script: vec![1, 2, 3, 4, 5] };
        assert_eq!(o.draft(&[1, 2], 2), vec![3, 4]);
        assert_eq!(o.draft(&[1, 9], 2), Vec::<u32>::new());
    }
}
