//! Speculation is exact: for every drafter (prompt lookup, an oracle replaying the plain run, a
//! random one, one right for a while then wrong) the ids, and the sequence state left behind,
//! equal plain decoding's, across prompts, draft lengths, stop ids, chunking and a streamed store.

use std::path::{Path, PathBuf};

use deltafin_sched::{EngineBuilder, GenerateOptions, LoadedModel, Sequence, Stats};
use deltafin_spec::{Drafter, FlakyDrafter, NgramDrafter, OracleDrafter, RandomDrafter};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-k3-dev/checkpoint")
}

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

fn store(dir: &Path) -> PathBuf {
    let out = dir.join("store");
    let homes = vec![dir.join("d0"), dir.join("d1")];
    deltafin_store::setup(&deltafin_store::SetupOptions::new(fixture(), &out).homes(homes), &deltafin_store::NoProgress).unwrap();
    out
}

#[test]
fn speculation_over_a_streamed_store_under_a_tight_budget_is_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(tmp.path());
    let min = {
        let e = EngineBuilder::new(&s).ram_budget(Some(1)).open().err().unwrap().to_string();
        let at = e.find("at least ").unwrap() + "at least ".len();
        e[at..].split_whitespace().next().unwrap().parse::<u64>().unwrap()
    };
    check(&EngineBuilder::new(&s).ram_budget(Some(min + (1 << 20))).open().unwrap(), "streamed");
}
