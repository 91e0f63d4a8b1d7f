//! Seeded sampling that any machine reproduces: `temperature`, `top_k`, `top_p` and `min_p` over
//! logits that are already bit-identical on every backend, batch and thread count, with a random
//! number that depends only on the seed and the token's position in its sequence (a counter-based
//! generator: nothing is shared between requests or carried between steps).
//!
//! So the same request with the same seed gives the same text alone or in a batch, on the CPU or
//! a GPU, with or without drafts. Drafts are verified by the very draw plain sampling makes at
//! each position: a draft is kept when it is the token sampled there. For a drafter that proposes
//! one token (every drafter here), that is exact rejection sampling: the draft `d` is accepted
//! with probability `p(d) = min(1, p(d)/q(d))` with `q` its point mass, and a rejected position
//! emits a token drawn from `p` without `d`, the residual `max(0, p - q)` renormalized. Drafting
//! changes neither the distribution nor, with a seed, the text.
//!
//! Every operation is IEEE and sequential in a fixed order (core's own `exp`, sums in F64 in
//! rank order), so the choice has no platform in it.

use deltafin_core::{argmax, exp};

/// How to choose each token. `temperature` 0 is greedy (the default everywhere).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the most likely tokens whose probabilities sum to at least `top_p` (1: all).
    pub top_p: f32,
    /// Keep tokens at least `min_p` times as likely as the most likely one (0: all).
    pub min_p: f32,
    /// The seed: with the position, all the randomness there is.
    pub seed: u64,
}

impl Sampling {
    /// Sampling at `temperature` with `seed`, nothing else cut.
    pub fn new(temperature: f32, seed: u64) -> Sampling {
        Sampling { temperature, top_k: 0, top_p: 1.0, min_p: 0.0, seed }
    }
    /// Whether this is greedy decoding (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
    /// Checks the values, naming the first that is out of range.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!("temperature {} must be a number >= 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p {} must be in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p {} must be in [0, 1]", self.min_p));
        }
        Ok(())
    }

    /// The token at `position` (its index in the sequence) from `logits`.
    pub fn choose(&self, logits: &[f32], position: usize) -> u32 {
        if self.is_greedy() {
            return argmax(logits);
        }
        let (ids, weights) = self.candidates(logits);
        let total: f64 = weights.iter().sum();
        let target = uniform(self.seed, position as u64) * total;
        let mut acc = 0.0;
        for (id, w) in ids.iter().zip(&weights) {
            acc += w;
            if target < acc {
                return *id;
            }
        }
        *ids.last().expect("at least one candidate")
    }

    /// The tokens that may be drawn, most likely first (ties: the lower id), with their
    /// unnormalized probabilities.
    fn candidates(&self, logits: &[f32]) -> (Vec<u32>, Vec<f64>) {
        let t = self.temperature;
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        // NaN never reaches here (non-finite logits are an error before any choice); total_cmp
        // keeps the order total regardless.
        let by_rank = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
        if self.top_k > 0 && self.top_k < order.len() {
            order.select_nth_unstable_by(self.top_k - 1, by_rank);
            order.truncate(self.top_k);
        }
        order.sort_unstable_by(by_rank);
        // Ids an output grammar forbids are at minus infinity (sorted last): never candidates.
        let allowed = order.iter().take_while(|&&i| logits[i as usize] > f32::NEG_INFINITY).count().max(1);
        order.truncate(allowed);
        let top = logits[order[0] as usize] / t;
        // exp((l - max) / T) with core's exp: the same bits everywhere.
        let mut weights: Vec<f64> = order.iter().map(|&i| exp(logits[i as usize] / t - top) as f64).collect();
        if self.min_p > 0.0 {
            // The most likely token weighs exp(0) = 1.
            let keep = weights.iter().take_while(|&&w| w >= self.min_p as f64).count().max(1);
            order.truncate(keep);
            weights.truncate(keep);
        }
        if self.top_p < 1.0 {
            let total: f64 = weights.iter().sum();
            let mut acc = 0.0;
            let mut keep = weights.len();
            for (i, w) in weights.iter().enumerate() {
                acc += w;
                if acc >= self.top_p as f64 * total {
                    keep = i + 1;
                    break;
                }
            }
            order.truncate(keep);
            weights.truncate(keep);
        }
        (order, weights)
    }

    /// Each candidate's probability (for tests and logprobs): ids most likely first.
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        if self.is_greedy() {
            return vec![(argmax(logits), 1.0)];
        }
        let (ids, weights) = self.candidates(logits);
        let total: f64 = weights.iter().sum();
        ids.into_iter().zip(weights.into_iter().map(|w| w / total)).collect()
    }
}

/// A number in [0, 1) from `seed` and `position` alone: SplitMix64's finalizer over the two
/// (a counter-based generator), its top 53 bits as a fraction.
pub fn uniform(seed: u64, position: u64) -> f64 {
    let mut z = seed ^ position.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// A seed for a request that gave none: from the clock and a counter, returned to the caller so
/// the output can be reproduced.
pub fn fresh_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    // Kept within 2^53 so JSON clients (JavaScript numbers) read it back exactly.
    (uniform(nanos, COUNT.fetch_add(1, Ordering::Relaxed)) * (1u64 << 53) as f64) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        (0..50).map(|i| ((i * 37 % 50) as f32 - 25.0) / 6.0).collect()
    }

    #[test]
    fn temperature_zero_is_greedy_and_the_draw_depends_on_seed_and_position_alone() {
        let l = logits();
        assert_eq!(Sampling::new(0.0, 1).choose(&l, 3), argmax(&l));
        let s = Sampling::new(1.0, 42);
        let a: Vec<u32> = (0..200).map(|p| s.choose(&l, p)).collect();
        let b: Vec<u32> = (0..200).map(|p| s.choose(&l, p)).collect();
        assert_eq!(a, b);
        let c: Vec<u32> = (0..200).map(|p| Sampling::new(1.0, 43).choose(&l, p)).collect();
        assert_ne!(a, c, "another seed, other draws");
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 5, "it samples: {a:?}");
    }

    #[test]
    fn top_k_top_p_and_min_p_cut_the_candidates() {
        let l = logits();
        let d = |s: Sampling| s.distribution(&l);
        let base = Sampling::new(1.0, 0);
        assert_eq!(d(base).len(), 50);
        assert_eq!(d(Sampling { top_k: 3, ..base }).len(), 3);
        let p = d(Sampling { top_p: 0.5, ..base });
        let kept: f64 = p.iter().map(|x| x.1).sum();
        assert!((kept - 1.0).abs() < 1e-12 && p.len() < 50);
        let full = d(base);
        let mass: f64 = full[..p.len()].iter().map(|x| x.1).sum();
        let short: f64 = full[..p.len() - 1].iter().map(|x| x.1).sum();
        assert!(mass >= 0.5 && short < 0.5, "the smallest prefix reaching top_p: {mass} {short}");
        let m = d(Sampling { min_p: 0.5, ..base });
        assert!(m.iter().all(|x| x.1 >= 0.5 * m[0].1 - 1e-12));
        for (i, (id, _)) in d(Sampling { top_k: 5, ..base }).iter().enumerate() {
            assert_eq!(*id, full[i].0, "top-k keeps the most likely, in rank order");
        }
        assert!(Sampling { top_p: 0.0, ..base }.validate().is_err() && Sampling { temperature: -1.0, ..base }.validate().is_err());
    }

    /// Drawn many times (one position per draw), the tokens follow the distribution: a
    /// chi-square test at 99.9% over the bins expected to hold 5 or more.
    #[test]
    fn draws_follow_the_distribution() {
        let l = logits();
        let s = Sampling { top_k: 12, ..Sampling::new(0.8, 7) };
        let dist = s.distribution(&l);
        let n = 20_000;
        let mut counts = std::collections::HashMap::new();
        for p in 0..n {
            *counts.entry(s.choose(&l, p)).or_insert(0usize) += 1;
        }
        assert!(counts.keys().all(|id| dist.iter().any(|(d, _)| d == id)), "only candidates are drawn");
        let (mut chi2, mut bins) = (0.0, 0);
        for (id, prob) in &dist {
            let expected = prob * n as f64;
            if expected >= 5.0 {
                let got = *counts.get(id).unwrap_or(&0) as f64;
                chi2 += (got - expected).powi(2) / expected;
                bins += 1;
            }
        }
        // 99.9% quantile of chi-square with up to 11 degrees of freedom is 31.3.
        assert!(bins >= 6 && chi2 < 31.3, "chi2 {chi2} over {bins} bins");
    }
}
