//! The generator: a follow-up prompt that extends the last one reuses the kept state and gives
//! the ids a cold run gives; the output trait sees begin, every token and finish.

use std::path::PathBuf;

use deltafin_sched::{EngineBuilder, GenerateOptions, Generator, Output, Stats, Step};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-k3-dev/checkpoint")
}

#[derive(Default)]
struct Record {
    cached: Option<usize>,
    ids: Vec<u32>,
    finished: Option<usize>,
}

impl Output for Record {
    fn begin(&mut self, cached_tokens: usize) {
        self.cached = Some(cached_tokens);
    }
    fn token(&mut self, step: Step<'_>) -> bool {
        self.ids.push(step.id);
        true
    }
    fn finish(&mut self, stats: &Stats) {
        self.finished = Some(stats.generated_tokens);
    }
}

#[test]
fn a_follow_up_reuses_kept_state_with_the_ids_of_a_cold_run() {
    let model = EngineBuilder::new(fixture()).open().unwrap();
    let opts = GenerateOptions::new(6);
    let first: Vec<u32> = (0..20).map(|i| (i * 31 + 7) % 1000).collect();
    let mut warm = Generator::new(&model);
    let mut turn1 = Record::default();
    warm.generate(&first, &opts, &mut turn1).unwrap();
    assert_eq!(turn1.cached, Some(0));
    assert_eq!(turn1.finished, Some(6));
    // The next prompt: the first, a different reply than the model's, and a new question.
    let mut second = first.clone();
    second.extend([5, 6, 7, 8, 9, 10]);
    let mut turn2 = Record::default();
    let stats = warm.generate(&second, &opts, &mut turn2).unwrap();
    assert_eq!(turn2.cached, Some(first.len()), "the state after the first prompt is reused");
    assert_eq!(stats.cached_tokens, first.len());
    assert_eq!(stats.prompt_tokens, second.len() - first.len());
    let mut cold = Record::default();
    Generator::new(&model).generate(&second, &opts, &mut cold).unwrap();
    assert_eq!(turn2.ids, cold.ids, "reuse changed the output");
    // Reset forgets.
    warm.reset();
    let mut again = Record::default();
    warm.generate(&second, &opts, &mut again).unwrap();
    assert_eq!(again.cached, Some(0));
    assert_eq!(again.ids, cold.ids);
}

/// A prompt of `n` tokens for conversation `seed`.
fn conversation(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| (i * 53 + seed * 211 + 3) % 1000).collect()
}

#[test]
fn two_conversations_taking_turns_both_reuse_their_state() {
    let model = EngineBuilder::new(fixture()).open().unwrap();
    let opts = GenerateOptions::new(4);
    let mut warm = Generator::new(&model);
    let (a1, b1) = (conversation(1, 14), conversation(2, 9));
    for p in [&a1, &b1] {
        let mut r = Record::default();
        warm.generate(p, &opts, &mut r).unwrap();
        assert_eq!(r.cached, Some(0));
    }
    // Each conversation's next turn, alternating: both find their own state.
    for (p1, extra) in [(&a1, [11u32, 12, 13]), (&b1, [21, 22, 23])] {
        let mut p2 = p1.clone();
        p2.extend(extra);
        let mut turn = Record::default();
        warm.generate(&p2, &opts, &mut turn).unwrap();
        assert_eq!(turn.cached, Some(p1.len()), "the other conversation's turn evicted this one");
        let mut cold = Record::default();
        Generator::new(&model).generate(&p2, &opts, &mut cold).unwrap();
        assert_eq!(turn.ids, cold.ids, "reuse changed the output");
    }
    assert!(warm.kept_states() >= 2, "{} states kept", warm.kept_states());
}

#[test]
fn no_allowance_keeps_nothing() {
    let model = EngineBuilder::new(fixture()).kept_states(0).open().unwrap();
    let opts = GenerateOptions::new(3);
    let mut g = Generator::new(&model);
    let p1 = conversation(3, 10);
    g.generate(&p1, &opts, &mut Record::default()).unwrap();
    assert_eq!(g.kept_states(), 0);
    let mut p2 = p1.clone();
    p2.push(17);
    let mut r = Record::default();
    g.generate(&p2, &opts, &mut r).unwrap();
    assert_eq!(r.cached, Some(0));
}
