//! Speculation is exact: for every drafter (prompt lookup, an oracle replaying the plain run, a
//! random one, one right for a while then wrong) the ids, and the sequence state left behind,
//! equal plain decoding's, across prompts, draft lengths, stop ids, chunking and a streamed store.

mod common;

use common::{fixture, min_budget, two_drive_store};

use deltafin_sched::{EngineBuilder, GenerateOptions, LoadedModel, Sequence, Stats};
use deltafin_spec::{Drafter, FlakyDrafter, NgramDrafter, OracleDrafter, RandomDrafter};

fn prompts() -> Vec<Vec<u32>> {
    vec![
        // Repetitive text: prompt lookup has something to find.
        [78, 544, 115, 815, 284, 256, 101].repeat(3),
        (0..17).map(|i| (i * 53 + 11) % 1000).collect(),
        vec![969, 111, 58, 32, 49],
    ]
}

fn plain(model: &LoadedModel, prompt: &[u32], opts: &GenerateOptions) -> (Vec<u32>, Sequence) {
    let mut seq = model.new_sequence();
    let mut ids = Vec::new();
    model
        .engine()
        .generate(&mut seq, prompt, opts, |id| {
            ids.push(id);
            true
        })
        .unwrap();
    (ids, seq)
}

/// `k`: a fixed draft length, or `None` for the live cost gate choosing up to 4.
fn speculative(
    model: &LoadedModel,
    prompt: &[u32],
    opts: &GenerateOptions,
    d: &mut dyn Drafter,
    k: Option<usize>,
) -> (Vec<u32>, Sequence, Stats) {
    let mut seq = model.new_sequence();
    let mut ids = Vec::new();
    let opts = opts.clone().draft_max(k.unwrap_or(4)).draft_gate(k.is_none());
    let stats = model
        .engine()
        .generate_drafted(&mut seq, prompt, &opts, d, |s| {
            ids.push(s.id);
            true
        })
        .unwrap();
    (ids, seq, stats)
}

fn check(model: &LoadedModel, label: &str) {
    for prompt in prompts() {
        for opts in [GenerateOptions::new(24), GenerateOptions::new(24).stop_ids(vec![163, 307])] {
            let (want, want_seq) = plain(model, &prompt, &opts);
            let mut script = prompt.clone();
            script.extend(&want);
            let drafters: Vec<(&str, Box<dyn Drafter>)> = vec![
                ("ngram", Box::new(NgramDrafter::default())),
                ("oracle", Box::new(OracleDrafter { script: script.clone() })),
                ("random", Box::new(RandomDrafter { vocab: 1000, state: 3 })),
                ("flaky", Box::new(FlakyDrafter::new(script.clone(), 1000, 2))),
            ];
            for (name, mut d) in drafters {
                for k in [Some(2), Some(5), None] {
                    let (got, seq, stats) = speculative(model, &prompt, &opts, d.as_mut(), k);
                    assert_eq!(got, want, "{label}: {name} k={k:?} changed the output");
                    assert_eq!(seq.ids(), want_seq.ids(), "{label}: {name} k={k:?} left other tokens in the sequence");
                    assert!(seq.layer_states() == want_seq.layer_states(), "{label}: {name} k={k:?} left other state");
                    assert_eq!(stats.generated_tokens, want.len());
                    if name == "oracle" && want.len() > 1 && k.is_some() {
                        assert_eq!(stats.accepted, stats.drafted, "{label}: the oracle is always right");
                        assert!((stats.verifies as usize) < want.len(), "{label}: the oracle saves steps");
                    }
                }
            }
        }
    }
}

#[test]
fn every_drafter_gives_plain_decodings_ids_and_state() {
    check(&EngineBuilder::new(fixture()).open().unwrap(), "in RAM");
    check(&EngineBuilder::new(fixture()).prefill_chunk(Some(5)).prefetch(false).open().unwrap(), "chunked, no prefetch");
}

#[test]
fn speculation_over_a_streamed_store_under_a_tight_budget_is_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let s = two_drive_store(tmp.path());
    let min = min_budget(&s, 1);
    check(&EngineBuilder::new(&s).ram_budget(Some(min + (1 << 20))).open().unwrap(), "streamed");
}

/// A hidden-state drafter's view: it drafts like the oracle and records the states it is shown.
struct Watcher {
    oracle: OracleDrafter,
    layers: Vec<usize>,
    seen: Vec<(usize, Vec<deltafin_core::Mat>)>,
}

impl Drafter for Watcher {
    fn draft(&mut self, context: &[u32], n: usize) -> Vec<u32> {
        // Right twice, then wrong, so kept and rejected rows both occur.
        let mut d = self.oracle.draft(context, n);
        if let Some(last) = d.get_mut(2) {
            *last = last.wrapping_add(1) % 1000;
        }
        d
    }
    fn hidden_layers(&self) -> Vec<usize> {
        self.layers.clone()
    }
    fn observe_hidden(&mut self, first: usize, states: &[deltafin_core::Mat]) {
        self.seen.push((first, states.to_vec()));
    }
}

#[test]
fn hidden_state_drafters_see_k3s_states_of_every_kept_token() {
    use deltafin_sched::{Phase, Slot};
    let model = EngineBuilder::new(fixture()).open().unwrap();
    let layers = vec![0, model.engine().model().config().num_layers - 1];
    let prompt = prompts()[0].clone();
    let opts = GenerateOptions::new(16);
    let (want, _) = plain(&model, &prompt, &opts);
    let mut script = prompt.clone();
    script.extend(&want);
    let mut w = Watcher { oracle: OracleDrafter { script: script.clone() }, layers: layers.clone(), seen: Vec::new() };
    let (got, _, stats) = speculative(&model, &prompt, &opts, &mut w, Some(4));
    assert_eq!(got, want);
    assert!(stats.verifies > 0 && stats.accepted < stats.drafted, "some drafts kept, some rejected: {stats:?}");
    // Positions arrive in order, each once, for every token fed: the prompt and all generated
    // tokens but the last.
    let mut next = 0;
    for (first, states) in &w.seen {
        assert_eq!(*first, next, "positions in order, none repeated or skipped");
        assert_eq!(states.len(), layers.len());
        next += states[0].rows;
    }
    assert_eq!(next, prompt.len() + want.len() - 1);
    // And they are the states a plain pass over the same tokens computes, bit for bit.
    let fed = &script[..next];
    let mut seq = model.new_sequence();
    let out = model.engine().step(&mut [Slot::new(&mut seq, fed, Phase::Prompt).hidden_states(&layers)], None).unwrap();
    for (k, _) in layers.iter().enumerate() {
        let mut all = w.seen[0].1[k].clone();
        for (_, s) in &w.seen[1..] {
            all.append(&s[k]);
        }
        let bits = |m: &deltafin_core::Mat| m.data.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(bits(&all) == bits(&out.hidden[0][k]), "layer {}: the states shown differ from a plain pass", layers[k]);
    }
}
