//! The live cost gate: how many tokens to draft at each step (0 = plain decoding), from what
//! this generation's steps measurably cost and how often its drafts were right.
//!
//! Why a gate at all: verifying k drafts reads the *union* of the experts their k + 1 rows route
//! to, and with experts streamed from disk that union is most of a step's time. Peers measured a
//! 2-row verify at 2.2x a 1-row step and lost 35% to an eager drafter; drafting pays only when
//! the tokens a verify is expected to emit outweigh what it costs over a plain step. So the gate
//! prices each draft length from measurements of this run, never from acceptance alone:
//!
//! - **cost**: seconds of a plain step, and of a verify step with k drafts (drafting included),
//!   each the median of its last few measured steps (a stalled step does not move it); a length not yet measured is priced from the
//!   measured cost of one extra row (prior: half a plain step);
//! - **acceptance**: the chance a draft token is accepted given the ones before it were, from
//!   decayed counts, estimated low (accepted / (judged + 1)): drafting is adopted on evidence,
//!   never on hope, and a drafter that stops guessing well is priced down within a few
//!   verifies;
//! - a length k is worth `E(k) / cost(k)` tokens per second, `E(k) = 1 + p + ... + p^k`; the best
//!   length is drafted only when it beats plain decoding by [`MIN_GAIN`];
//! - **back-off and probes**: two verify steps in a row that each lose more than one plain step's
//!   time against plain decoding switch drafting off; while off (or not worth it), a probe of one
//!   draft runs after a number of plain steps that doubles with every probe that does not pay
//!   (up to [`PROBE_MAX`]), so a drafter that becomes right again is found, and one that never is
//!   costs a probe every [`PROBE_MAX`] steps.
//!
//! - **longer drafts measured**: a draft accepted whole is followed by one twice as long, if that
//!   length was never measured, since extrapolation from short verifies overprices long ones
//!   (rows share experts, so the union grows slower than the rows);
//! - **a fresh baseline**: after [`PLAIN_REFRESH`] verifies in a row, one plain step measures
//!   the plain cost again (prices are relative to it).
//!
//! No clock here: the engine measures and reports seconds.

/// The least speed-up over plain decoding (as a ratio of tokens per second) worth drafting for,
/// as in the upstream engine's probe: below it, noise in the measurements would decide.
pub const MIN_GAIN: f64 = 1.03;
/// Plain steps before the first probe: enough to price a plain step, few enough that a good
/// drafter starts almost at once.
pub const FIRST_PROBE: u32 = 4;
/// Plain steps between probes, first and at most.
pub const PROBE_MIN: u32 = 32;
pub const PROBE_MAX: u32 = 128;
/// Verify steps in a row after which one plain step runs to measure the baseline again: every
/// price is relative to it, and a stale one (the disk slowed down, another process took the
/// CPU while it was measured) would make verifies look cheap or dear for the rest of the run.
pub const PLAIN_REFRESH: u32 = 16;
/// Weight of the newest measurement in the moving averages.
const EWMA: f64 = 0.3;
/// Step times each cost remembers; the cost is their median, so one step stalled by the disk
/// or the CPU does not move it.
const WINDOW: usize = 7;

/// The median of the last [`WINDOW`] measurements.
#[derive(Clone, Debug, Default)]
struct Recent(std::collections::VecDeque<f64>);

impl Recent {
    fn note(&mut self, x: f64) {
        if self.0.len() == WINDOW {
            self.0.pop_front();
        }
        self.0.push_back(x);
    }
    fn median(&self) -> Option<f64> {
        let mut v: Vec<f64> = self.0.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    }
}
/// Factor by which older acceptance counts fade at each verify.
const FADE: f64 = 0.9;
/// Priced cost of one more verify row, in plain steps, before any verify was measured.
const PRIOR_EXTRA_ROW: f64 = 0.5;

/// Chooses draft lengths from live measurements (see the module doc).
#[derive(Clone, Debug)]
pub struct CostGate {
    max: usize,
    plain_s: Recent,
    /// Measured seconds of a verify step with k drafts, at index k - 1.
    verify_s: Vec<Recent>,
    extra_row: f64,
    hits: f64,
    tries: f64,
    /// Verify steps in a row that lost more than one plain step's time, and whether that
    /// switched drafting off (until a probe pays).
    losses: u32,
    off: bool,
    /// Plain steps since the last verify, and how many must pass before the next probe.
    plain_streak: u32,
    /// Verify steps since the last plain step.
    verify_streak: u32,
    probe_after: u32,
    /// The chosen length was a probe (judged on its own when it is noted).
    probing: bool,
    /// A longer draft to try next: the last one was accepted whole, and a length never measured
    /// is priced pessimistically (rows share experts, so the union grows slower than linearly).
    try_longer: Option<usize>,
    probes: u64,
}

impl CostGate {
    /// A gate choosing lengths up to `max`. The first [`FIRST_PROBE`] steps are plain (to price
    /// them), then a probe.
    pub fn new(max: usize) -> CostGate {
        CostGate {
            max,
            plain_s: Recent::default(),
            verify_s: vec![Recent::default(); max],
            extra_row: PRIOR_EXTRA_ROW,
            hits: 0.0,
            tries: 0.0,
            losses: 0,
            off: false,
            plain_streak: 0,
            verify_streak: 0,
            probe_after: FIRST_PROBE,
            probing: false,
            try_longer: None,
            probes: 0,
        }
    }

    /// The estimated chance that a draft token is accepted, given the ones before it were:
    /// pessimistic (no acceptance is assumed without evidence; probes gather it), since a verify
    /// that costs little more than a plain step would otherwise be run on hope.
    pub fn acceptance(&self) -> f64 {
        self.hits / (self.tries + 1.0)
    }

    /// The gate's view, for tracing: (plain seconds, verify seconds per length, acceptance).
    pub fn view(&self) -> (Option<f64>, Vec<Option<f64>>, f64) {
        (self.plain_s.median(), self.verify_s.iter().map(Recent::median).collect(), self.acceptance())
    }

    /// Probes verified so far (a probe the drafter had nothing for does not count).
    pub fn probes(&self) -> u64 {
        self.probes
    }

    /// Expected tokens emitted by a verify of `k` drafts: the accepted prefix plus K3's own.
    fn expected_tokens(&self, k: usize) -> f64 {
        let p = self.acceptance();
        (0..=k).map(|i| p.powi(i as i32)).sum()
    }

    /// Priced seconds of a verify with `k` drafts.
    fn cost(&self, k: usize, plain: f64) -> f64 {
        self.verify_s[k - 1].median().unwrap_or(plain * (1.0 + self.extra_row * k as f64))
    }

    /// The draft length for the next step: 0 for a plain step.
    pub fn choose(&mut self) -> usize {
        self.probing = false;
        let Some(plain) = self.plain_s.median() else { return 0 };
        if self.max == 0 || self.verify_streak >= PLAIN_REFRESH {
            return 0;
        }
        if let Some(k) = self.try_longer.take() {
            if !self.off {
                return k;
            }
        }
        let (best, rate) =
            (1..=self.max)
                .map(|k| (k, self.expected_tokens(k) / self.cost(k, plain)))
                .fold((0, 0.0), |acc, x| if x.1 > acc.1 { x } else { acc });
        if !self.off && rate >= MIN_GAIN / plain {
            return best;
        }
        if self.plain_streak >= self.probe_after {
            self.probing = true;
            return 1;
        }
        0
    }

    /// A plain step took `secs` (also when a drafter had nothing to offer).
    pub fn note_plain(&mut self, secs: f64) {
        self.plain_s.note(secs);
        self.plain_streak = self.plain_streak.saturating_add(1);
        self.verify_streak = 0;
    }

    /// A verify of `drafted` tokens, of which `accepted` were K3's, took `secs` (drafting
    /// included).
    pub fn note_verify(&mut self, drafted: usize, accepted: usize, secs: f64) {
        if drafted == 0 || drafted > self.max {
            return;
        }
        self.hits = self.hits * FADE + accepted as f64;
        // Positions judged: the accepted ones and the first rejected one, if any.
        self.tries = self.tries * FADE + (accepted + usize::from(accepted < drafted)) as f64;
        self.verify_s[drafted - 1].note(secs);
        let Some(plain) = self.plain_s.median() else { return };
        let extra = ((secs / plain - 1.0) / drafted as f64).max(0.0);
        self.extra_row += EWMA * (extra - self.extra_row);
        // What plain decoding would have spent on the tokens this verify emitted.
        let lost = secs - (accepted + 1) as f64 * plain;
        self.losses = if lost > plain { self.losses + 1 } else { 0 };
        let paid = secs * MIN_GAIN < (accepted + 1) as f64 * plain;
        if self.probing {
            self.probes += 1;
            if paid {
                self.off = false;
                self.probe_after = PROBE_MIN;
            } else {
                self.probe_after = (self.probe_after * 2).clamp(PROBE_MIN, PROBE_MAX);
            }
        } else if self.losses >= 2 {
            self.off = true;
            self.probe_after = PROBE_MIN;
        }
        self.plain_streak = 0;
        self.verify_streak += 1;
        self.probing = false;
        // Accepted whole, and the next longer length never measured: measure it.
        let longer = (drafted * 2).min(self.max);
        if accepted == drafted && longer > drafted && self.verify_s[longer - 1].median().is_none() {
            self.try_longer = Some(longer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the gate for `steps` steps against a world where a plain step costs 1 s, a verify of
    /// k drafts `1 + extra * k` s, and each draft token is accepted when `right(step, i)`.
    /// Returns (tokens emitted, seconds spent, verify steps).
    fn simulate(max: usize, extra: f64, steps: usize, right: impl Fn(usize, usize) -> bool) -> (usize, f64, usize) {
        let mut g = CostGate::new(max);
        let (mut tokens, mut secs, mut verifies) = (0, 0.0, 0);
        for s in 0..steps {
            let k = g.choose();
            if k == 0 {
                g.note_plain(1.0);
                tokens += 1;
                secs += 1.0;
            } else {
                let a = (0..k).take_while(|&i| right(s, i)).count();
                let t = 1.0 + extra * k as f64;
                g.note_verify(k, a, t);
                tokens += a + 1;
                secs += t;
                verifies += 1;
            }
        }
        (tokens, secs, verifies)
    }

    #[test]
    fn a_stale_baseline_is_measured_again() {
        // The first plain step was slow (a cold cache, a busy CPU): verifies look cheap at first,
        // but the refreshed baseline shows what they cost, and drafting that never pays stops.
        let mut g = CostGate::new(4);
        g.note_plain(5.0);
        let mut verifies_late = 0;
        for s in 0..300 {
            let k = g.choose();
            if k == 0 {
                g.note_plain(1.0);
            } else {
                g.note_verify(k, 0, 1.0 + 0.8 * k as f64);
                verifies_late += usize::from(s >= 100);
            }
        }
        assert!(verifies_late <= 3, "{verifies_late} verifies after the baseline was measured again");
    }

    #[test]
    fn a_drafter_that_is_always_wrong_costs_almost_nothing() {
        let (tokens, secs, verifies) = simulate(4, 0.6, 400, |_, _| false);
        let slowdown = secs / tokens as f64;
        assert!(slowdown < 1.03, "always-wrong drafts cost {slowdown:.3}x plain ({verifies} verifies)");
        assert!(verifies >= 3, "it keeps probing now and then: {verifies}");
    }

    #[test]
    fn a_drafter_that_is_always_right_drafts_the_most() {
        let (tokens, secs, _) = simulate(4, 0.3, 200, |_, _| true);
        let speedup = tokens as f64 / secs;
        // Every verify of 4 emits 5 tokens for 2.2 s: the bound is 2.27x.
        assert!(speedup > 2.0, "speed-up {speedup:.2}x");
    }

    #[test]
    fn when_rows_share_experts_long_drafts_are_found() {
        // A verify's union grows slower than its rows (as measured on slice: 5 rows read 3.3x
        // one row): one extra draft barely pays, four pay well.
        let mut g = CostGate::new(4);
        let cost = |k: usize| 1.0 + 0.83 * (k as f64).powf(0.7);
        let mut lengths = Vec::new();
        for _ in 0..100 {
            let k = g.choose();
            lengths.push(k);
            if k == 0 {
                g.note_plain(1.0);
            } else {
                g.note_verify(k, k, cost(k));
            }
        }
        assert!(lengths[20..].iter().filter(|&&k| k == 4).count() >= 70, "{lengths:?}");
    }

    #[test]
    fn expensive_verifies_are_not_worth_even_good_drafts() {
        // A verify row costs a whole plain step: even 70% acceptance cannot pay for it.
        let (tokens, secs, _) = simulate(4, 1.0, 400, |s, i| (s * 7 + i * 3) % 10 < 7);
        assert!(secs / tokens as f64 <= 1.03, "{:.3}", secs / tokens as f64);
    }

    #[test]
    fn drafting_stops_when_the_drafter_turns_bad_and_resumes_when_it_recovers() {
        // Right for 100 steps, wrong for 200, right again.
        let phase = |s: usize| !(100..300).contains(&s);
        let mut g = CostGate::new(4);
        let mut lengths = Vec::new();
        for s in 0..500 {
            let k = g.choose();
            lengths.push(k);
            if k == 0 {
                g.note_plain(1.0);
            } else {
                g.note_verify(k, if phase(s) { k } else { 0 }, 1.0 + 0.3 * k as f64);
            }
        }
        assert!(lengths[50..100].iter().filter(|&&k| k == 4).count() >= 45, "drafting at full length while right");
        let bad = lengths[120..300].iter().filter(|&&k| k > 0).count();
        assert!(bad <= 6, "{bad} verifies while wrong");
        assert!(lengths[440..500].iter().filter(|&&k| k == 4).count() >= 55, "drafting again after recovery: {:?}", &lengths[300..500]);
    }
}
