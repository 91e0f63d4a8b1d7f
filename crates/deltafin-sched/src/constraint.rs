//! Constrained decoding's seam: a grammar (a JSON schema, say) that says which ids may come next.
//! The engine masks the exact logits with it before choosing, greedy or sampled, so every token
//! is still K3's own choice among those the grammar allows. The grammar libraries live outside
//! this crate (`deltafin-grammar`); here is only what the step needs from them.

use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// A grammar's state for one generation.
pub trait TokenConstraint: Send {
    /// The ids allowed next: bit `i % 32` of word `i / 32` is set for each allowed id `i`.
    fn allowed(&mut self) -> std::result::Result<Vec<u32>, String>;
    /// Moves past `id` (one of the ids [`TokenConstraint::allowed`] just gave).
    fn commit(&mut self, id: u32) -> std::result::Result<(), String>;
}

/// A shared handle on a generation's constraint (options are cloned; the state is one).
#[derive(Clone)]
pub struct Constraint(Arc<Mutex<Box<dyn TokenConstraint>>>);

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

impl Constraint {
    pub fn new(c: impl TokenConstraint + 'static) -> Constraint {
        Constraint(Arc::new(Mutex::new(Box::new(c))))
    }

    /// The next token: `choose` applied to `logits` with every id the grammar forbids set to
    /// minus infinity (which no choice takes), then committed to the grammar.
    pub(crate) fn next(&self, logits: &[f32], choose: impl FnOnce(&[f32]) -> u32) -> Result<u32> {
        let mut c = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let allowed = c.allowed().map_err(|e| Error::Invalid(format!("the output grammar failed: {e}")))?;
        let is_allowed = |i: usize| allowed.get(i / 32).is_some_and(|w| w >> (i % 32) & 1 == 1);
        let masked: Vec<f32> = logits.iter().enumerate().map(|(i, &l)| if is_allowed(i) { l } else { f32::NEG_INFINITY }).collect();
        if !(0..logits.len()).any(is_allowed) {
            return Err(Error::Invalid("the output grammar allows no token of this model's vocabulary here".into()));
        }
        let id = choose(&masked);
        c.commit(id).map_err(|e| Error::Invalid(format!("the output grammar refused token {id}: {e}")))?;
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Sampling;

    /// Allows only even ids, then only id 1 after it has seen three tokens.
    struct Evens(usize);
    impl TokenConstraint for Evens {
        fn allowed(&mut self) -> std::result::Result<Vec<u32>, String> {
            Ok(vec![if self.0 >= 3 { 0b10 } else { 0x5555_5555 }; 2])
        }
        fn commit(&mut self, id: u32) -> std::result::Result<(), String> {
            self.0 += 1;
            if id % 2 == 1 && self.0 <= 3 {
                return Err(format!("{id} is odd"));
            }
            Ok(())
        }
    }

    #[test]
    fn choices_come_from_the_allowed_ids_greedy_and_sampled() {
        let logits: Vec<f32> = (0..64).map(|i| ((i * 37) % 64) as f32 / 8.0).collect();
        let c = Constraint::new(Evens(0));
        let s = Sampling::new(1.5, 9);
        for p in 0..3 {
            let id = c.next(&logits, |l| s.choose(l, p)).unwrap();
            assert_eq!(id % 2, 0, "sampled {id}");
        }
        let id = c.next(&logits, crate::argmax).unwrap();
        assert_eq!(id, 1, "only id 1 remains");
        let best_even = (0..64).filter(|i| i % 2 == 0).max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a))).unwrap();
        assert_eq!(Constraint::new(Evens(0)).next(&logits, crate::argmax).unwrap(), best_even as u32);
    }
}
