//! Seeded sampling: the same seed gives the same ids run after run and with drafts (which are
//! verified by the plain draw itself), temperature 0 is greedy, and the first sampled token
//! follows the distribution its logits give (a chi-square test that fails on a wrong sampler).

mod common;

use common::fixture;
use deltafin_sched::{EngineBuilder, GenerateOptions, LoadedModel, LogitRows, Sampling};
use deltafin_spec::Drafter;

/// Proposes the greedy continuation: at low temperatures the draw often agrees, so drafts are
/// both accepted and rejected.
struct Greedy(Vec<u32>);
impl Drafter for Greedy {
    fn draft(&mut self, context: &[u32], n: usize) -> Vec<u32> {
        let done = context.len() - prompt().len();
        self.0.iter().skip(done).take(n).copied().collect()
    }
}

fn prompt() -> Vec<u32> {
    // Repeats, so prompt lookup has drafts to propose.
    [17u32, 230, 5, 99, 41, 17, 230, 5, 99, 41, 17, 230].to_vec()
}

fn generate(model: &LoadedModel, opts: &GenerateOptions, drafter: Option<&mut dyn Drafter>) -> Vec<u32> {
    let mut ids = Vec::new();
    let mut seq = model.new_sequence();
    let on = |s: deltafin_sched::Step<'_>| {
        ids.push(s.id);
        true
    };
    match drafter {
        Some(d) => model.engine().generate_drafted(&mut seq, &prompt(), opts, d, on),
        None => model.engine().generate_with(&mut seq, &prompt(), opts, on),
    }
    .unwrap();
    ids
}

#[test]
fn a_seed_gives_the_same_ids_every_run_and_with_drafts() {
    let model = EngineBuilder::new(fixture()).open().unwrap();
    let greedy = generate(&model, &GenerateOptions::new(12), None);
    let zero = GenerateOptions::new(12).sampling(Some(Sampling::new(0.0, 5)));
    assert_eq!(generate(&model, &zero, None), greedy, "temperature 0 is greedy");
    let mut differ = 0;
    let mut accepted = 0;
    let mut drafted_n = 0;
    for seed in 0..40 {
        let t = if seed % 2 == 0 { 1.2 } else { 0.4 };
        let s = Sampling { top_p: 0.95, ..Sampling::new(t, seed) };
        let opts = GenerateOptions::new(12).sampling(Some(s));
        let plain = generate(&model, &opts, None);
        assert_eq!(generate(&model, &opts, None), plain, "seed {seed}: the same ids again");
        let mut d = Greedy(greedy.clone());
        let drafted_opts = opts.clone().draft_max(3).draft_gate(false);
        let mut seq = model.new_sequence();
        let mut drafted = Vec::new();
        let stats = model
            .engine()
            .generate_drafted(&mut seq, &prompt(), &drafted_opts, &mut d, |st| {
                drafted.push(st.id);
                true
            })
            .unwrap();
        assert_eq!(drafted, plain, "seed {seed}: drafts change nothing");
        accepted += stats.accepted;
        drafted_n += stats.drafted;
        differ += usize::from(plain != greedy);
    }
    assert!(differ > 20, "sampling samples: {differ} of 40 differ from greedy");
    assert!(accepted > 0 && accepted < drafted_n, "drafts were both accepted and rejected: {accepted} of {drafted_n}");
}

#[test]
fn the_first_sampled_token_follows_its_distribution() {
    let model = EngineBuilder::new(fixture()).open().unwrap();
    let mut seq = model.new_sequence();
    let (logits, _) = model.engine().forward(&mut seq, &prompt(), LogitRows::Last).unwrap();
    let n = 2000;
    let base = Sampling { top_k: 30, ..Sampling::new(1.5, 0) };
    let dist = base.distribution(logits.row(0));
    let mut counts = std::collections::HashMap::new();
    for seed in 0..n {
        let ids = generate(&model, &GenerateOptions::new(1).sampling(Some(Sampling { seed, ..base })), None);
        *counts.entry(ids[0]).or_insert(0usize) += 1;
    }
    let (mut chi2, mut bins) = (0.0, 0);
    for (id, p) in &dist {
        let expected = p * n as f64;
        if expected >= 5.0 {
            let got = *counts.get(id).unwrap_or(&0) as f64;
            chi2 += (got - expected).powi(2) / expected;
            bins += 1;
        }
    }
    // The 99.9% quantile of chi-square with 29 degrees of freedom is 58.3.
    assert!(bins >= 10 && chi2 < 58.3, "chi2 {chi2} over {bins} bins");
}
