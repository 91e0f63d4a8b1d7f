//! Sequences in lockstep: each job's ids and logits are bit-identical to running it alone,
//! whoever shares its steps, with jobs joining and leaving mid-way, in RAM and over a streamed
//! store under a tight budget on two drives; a job's own error fails it alone.

use std::collections::HashMap;
mod common;

use common::{fixture, min_budget, two_drive_store};

use deltafin_spec::FlakyDrafter;

use deltafin_sched::{BatchEvent, BatchJob, Batcher, EngineBuilder, FinishReason, GenerateOptions, LoadedModel, LogitRows, Sampling};

fn jobs() -> Vec<BatchJob> {
    let p = |seed: u32, n: u32| (0..n).map(|i| (i * 37 + seed * 101 + 5) % 1000).collect::<Vec<u32>>();
    vec![
        BatchJob::new(p(1, 9), GenerateOptions::new(12)),
        BatchJob::new(p(2, 3), GenerateOptions::new(5)),
        BatchJob::new(p(3, 17), GenerateOptions::new(20)),
        BatchJob::new(p(4, 6), GenerateOptions::new(9).stop_ids(vec![419, 163, 307, 775])),
        BatchJob::new(p(5, 1), GenerateOptions::new(1)),
        BatchJob::new(p(6, 11), GenerateOptions::new(0)).with_prompt_logits(),
        BatchJob::new(p(7, 8), GenerateOptions::new(7)).with_prompt_logits(),
        // Repeating text: prompt lookup drafts it (with `Batcher::drafting`).
        BatchJob::new([5, 6, 7, 8, 9].repeat(5), GenerateOptions::new(24)),
        // Sampled: the seeded draw at each position is the one it gets alone.
        BatchJob::new(p(8, 5), GenerateOptions::new(15).sampling(Some(Sampling { top_k: 40, ..Sampling::new(0.9, 11) }))),
    ]
}

type Bits = Vec<u32>;
/// A job's ids, its tokens' logits and its prompt rows' logits, as bits.
type Run = (Vec<u32>, Vec<Bits>, Vec<Bits>);

fn bits(v: &[f32]) -> Bits {
    v.iter().map(|x| x.to_bits()).collect()
}

/// (ids, logits bits per token, prompt logits bits per row)
fn solo(model: &LoadedModel, job: &BatchJob) -> Run {
    let mut prompt_rows = Vec::new();
    if job.prompt_logits {
        let mut seq = model.new_sequence();
        let (m, _) = model.engine().forward(&mut seq, &job.prompt, LogitRows::All).unwrap();
        prompt_rows = (0..m.rows).map(|r| bits(m.row(r))).collect();
    }
    let (mut ids, mut logits) = (Vec::new(), Vec::new());
    if job.opts.max_new > 0 {
        let mut seq = model.new_sequence();
        model
            .engine()
            .generate_with(&mut seq, &job.prompt, &job.opts, |s| {
                ids.push(s.id);
                logits.push(bits(s.logits));
                true
            })
            .unwrap();
    }
    (ids, logits, prompt_rows)
}

fn check(model: &LoadedModel, max_active: usize, label: &str) {
    check_drafting(model, max_active, Batcher::new(model, max_active), label);
}

/// [`check`] with `batcher` (drafting as it was told to).
fn check_drafting(model: &LoadedModel, max_active: usize, mut batcher: Batcher<'_>, label: &str) -> deltafin_sched::BatchStats {
    let jobs = jobs();
    assert_eq!(batcher.max_active(), max_active.min(model.max_sequences()));
    for j in &jobs {
        batcher.submit(j.clone());
    }
    let mut got: HashMap<u64, Run> = HashMap::new();
    let mut finished = Vec::new();
    let mut most_active = 0;
    while !batcher.is_idle() {
        batcher.step(&mut |e: BatchEvent<'_>| {
            match e {
                BatchEvent::Token { job, step } => {
                    let g = got.entry(job).or_default();
                    g.0.push(step.id);
                    g.1.push(bits(step.logits));
                }
                BatchEvent::PromptLogits { job, first, logits } => {
                    let g = got.entry(job).or_default();
                    assert_eq!(g.2.len(), first, "prompt rows arrive in order");
                    g.2.extend((0..logits.rows).map(|r| bits(logits.row(r))));
                }
                BatchEvent::Finished { job, reason, .. } => finished.push((job, reason)),
                BatchEvent::Failed { job, error } => panic!("{label}: job {job} failed: {error}"),
                BatchEvent::Started { cached_tokens, .. } => assert_eq!(cached_tokens, 0, "nothing is kept by default"),
            }
            true
        });
        most_active = most_active.max(batcher.active());
    }
    assert_eq!(most_active, max_active.min(model.max_sequences()).min(jobs.len()), "{label}: slots filled");
    assert_eq!(finished.len(), jobs.len());
    for (i, job) in jobs.iter().enumerate() {
        let want = solo(model, job);
        let have = got.remove(&(i as u64)).unwrap_or_default();
        assert_eq!(have.0, want.0, "{label}: job {i}'s ids differ from its solo run");
        assert!(have.1 == want.1, "{label}: job {i}'s logits differ from its solo run");
        assert!(have.2 == want.2, "{label}: job {i}'s prompt logits differ from a solo forward");
        let reason = finished.iter().find(|(j, _)| *j == i as u64).unwrap().1;
        if job.opts.stop_ids.iter().any(|s| have.0.last() == Some(s)) {
            assert_eq!(reason, FinishReason::Stop);
        } else {
            assert_eq!(reason, FinishReason::Length);
        }
    }
    let s = batcher.stats();
    assert!(s.sequences_per_step() > 1.5, "{label}: sequences shared steps: {}", s.sequences_per_step());
    s.clone()
}

/// Issue 49: drafts inside a lockstep batch. Each job's drafter is an oracle of its solo run
/// that turns random after a while (accepted drafts, then rejected ones cut back), or prompt
/// lookup; every job's ids and logits stay its solo plain run's.
#[test]
fn drafting_jobs_in_lockstep_match_their_solo_plain_runs() {
    for (slots, chunk) in [(3, None), (4, Some(4))] {
        let model = EngineBuilder::new(fixture()).max_sequences(slots).prefill_chunk(chunk).open().unwrap();
        let scripts: Vec<(Vec<u32>, Vec<u32>)> =
            jobs().iter().map(|j| (j.prompt.clone(), [j.prompt.clone(), solo(&model, j).0].concat())).collect();
        let flaky: deltafin_sched::DrafterFactory = Box::new(move |job| {
            let script = scripts.iter().find(|(p, _)| *p == job.prompt).map(|(_, s)| s.clone()).unwrap();
            Box::new(FlakyDrafter::new(script, 1000, 2))
        });
        let label = format!("{slots} slots, chunk {chunk:?}");
        let s = check_drafting(&model, slots, Batcher::new(&model, slots).drafting_with(4, flaky), &format!("{label}, flaky drafts"));
        assert!(s.verifies > 0 && s.accepted > 0 && s.accepted < s.drafted, "drafts were kept and cut back: {s:?}");
        assert!(s.steps < s.generated_tokens, "accepted drafts saved steps: {s:?}");
        check_drafting(&model, slots, Batcher::new(&model, slots).drafting(4), &format!("{label}, prompt lookup"));
    }
}

#[test]
fn lockstep_jobs_match_their_solo_runs_bit_for_bit() {
    let model = EngineBuilder::new(fixture()).max_sequences(3).open().unwrap();
    check(&model, 3, "in RAM, 3 at a time");
    check(&model, 8, "in RAM, asking for more slots than the model has");
    let chunked = EngineBuilder::new(fixture()).max_sequences(4).prefill_chunk(Some(4)).open().unwrap();
    check(&chunked, 4, "prompts in chunks of 4 beside decode rows");
    // Issue 49: beside decoding jobs a prompt runs in short chunks (here 3 tokens, the model
    // setting no bound), whole while nothing decodes: the same bits either way.
    let s = check_drafting(&model, 3, Batcher::new(&model, 3).mixed_prompt_chunk(Some(3)), "prompts in chunks of 3 beside decode rows");
    let whole = check_drafting(&model, 3, Batcher::new(&model, 3).mixed_prompt_chunk(None), "prompts whole beside decode rows");
    assert!(s.steps > whole.steps, "chunked prompts took more, shorter steps: {} vs {}", s.steps, whole.steps);
}

#[test]
fn lockstep_over_a_streamed_store_under_a_tight_budget_is_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let s = two_drive_store(tmp.path());
    let min = min_budget(&s, 3);
    let model = EngineBuilder::new(&s).max_sequences(3).ram_budget(Some(min + (1 << 20))).open().unwrap();
    let one = EngineBuilder::new(&s).ram_budget(Some(min)).open().unwrap();
    assert!(
        model.memory_plan().unwrap().sequence_state >= 3 * one.memory_plan().unwrap().sequence_state,
        "the budget holds every slot's state"
    );
    check(&model, 3, "streamed, tight budget, two drives");
}

#[test]
fn a_bad_job_fails_alone() {
    let model = EngineBuilder::new(fixture()).max_sequences(2).open().unwrap();
    let mut b = Batcher::new(&model, 2);
    let good = b.submit(BatchJob::new(vec![5, 6, 7], GenerateOptions::new(4)));
    let bad = b.submit(BatchJob::new(vec![5, 99_999], GenerateOptions::new(4)));
    let empty = b.submit(BatchJob::new(vec![], GenerateOptions::new(4)));
    let mut failed = Vec::new();
    let mut tokens = 0;
    let stats = b.run(&mut |e: BatchEvent<'_>| {
        match e {
            BatchEvent::Failed { job, error } => failed.push((job, error.to_string())),
            BatchEvent::Token { job, .. } => {
                assert_eq!(job, good);
                tokens += 1;
            }
            _ => {}
        }
        true
    });
    assert_eq!(tokens, 4);
    assert_eq!(failed.len(), 2);
    assert!(failed.iter().any(|(j, e)| *j == bad && e.contains("outside the vocabulary")), "{failed:?}");
    assert!(failed.iter().any(|(j, e)| *j == empty && e.contains("empty")), "{failed:?}");
    assert_eq!((stats.jobs_finished, stats.jobs_failed), (1, 2));
}

#[test]
fn a_failed_step_fails_its_jobs_and_the_batch_goes_on() {
    // A store whose experts of the last MoE layer are corrupt: every step that reaches them fails,
    // is undone, and fails the jobs in it with the error; waiting jobs still get their turn.
    let tmp = tempfile::tempdir().unwrap();
    let s = two_drive_store(tmp.path());
    let m = deltafin_store::Manifest::read(&s).unwrap();
    let last = m.layouts.iter().map(|(l, _)| *l).max().unwrap();
    for e in m.experts.iter().filter(|e| e.layer == last) {
        for c in &e.copies {
            let path = m.copy_path(c);
            let mut bytes = std::fs::read(&path).unwrap();
            bytes[c.offset as usize + 11] ^= 0x40;
            std::fs::write(&path, bytes).unwrap();
        }
    }
    let model = EngineBuilder::new(&s).max_sequences(2).open().unwrap();
    let mut b = Batcher::new(&model, 2);
    for i in 0..5u32 {
        b.submit(BatchJob::new(vec![5 + i, 6, 7], GenerateOptions::new(3)));
    }
    let mut failed = Vec::new();
    let stats = b.run(&mut |e: BatchEvent<'_>| {
        match e {
            BatchEvent::Failed { job, error } => failed.push((job, error.to_string())),
            BatchEvent::Token { .. } | BatchEvent::Finished { .. } => panic!("a corrupt expert produced output"),
            BatchEvent::PromptLogits { .. } | BatchEvent::Started { .. } => {}
        }
        true
    });
    assert_eq!(failed.iter().map(|(j, _)| *j).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4], "every job failed, in order");
    assert!(failed.iter().all(|(_, e)| e.contains("checksum")), "{failed:?}");
    assert_eq!((stats.jobs_failed, stats.jobs_finished), (5, 0));
}

#[test]
fn kept_states_let_conversations_take_turns_in_lockstep() {
    let model = EngineBuilder::new(fixture()).max_sequences(2).kept_states(2).open().unwrap();
    let mut b = Batcher::new(&model, 2).keep_states();
    let p = |seed: u32, n: u32| (0..n).map(|i| (i * 29 + seed * 97 + 1) % 1000).collect::<Vec<u32>>();
    let turn1 = [p(1, 12), p(2, 7), p(3, 10)];
    // Turn two of each conversation: its first prompt, a reply that is not the model's, more.
    let turn2: Vec<Vec<u32>> = turn1.iter().enumerate().map(|(i, t)| [t.clone(), vec![40 + i as u32, 41, 42, 43]].concat()).collect();
    let opts = GenerateOptions::new(5);
    for t in &turn1 {
        b.submit(BatchJob::new(t.clone(), opts.clone()));
    }
    b.run(&mut |_: BatchEvent<'_>| true);
    let mut cached = HashMap::new();
    let mut got: HashMap<u64, Vec<u32>> = HashMap::new();
    let ids: Vec<u64> = turn2.iter().map(|t| b.submit(BatchJob::new(t.clone(), opts.clone()))).collect();
    let stats = b.run(&mut |e: BatchEvent<'_>| {
        match e {
            BatchEvent::Started { job, cached_tokens } => {
                cached.insert(job, cached_tokens);
            }
            BatchEvent::Token { job, step } => got.entry(job).or_default().push(step.id),
            BatchEvent::Failed { job, error } => panic!("job {job} failed: {error}"),
            _ => {}
        }
        true
    });
    for (i, id) in ids.iter().enumerate() {
        let want = solo(&model, &BatchJob::new(turn2[i].clone(), opts.clone())).0;
        assert_eq!(got[id], want, "conversation {i}: reuse changed the output");
    }
    // Three conversations' states (and after-prompt copies) under an allowance of two
    // full-context sequences: short ones all fit.
    assert_eq!(ids.iter().map(|id| cached[id]).collect::<Vec<_>>(), turn1.iter().map(Vec::len).collect::<Vec<_>>());
    assert_eq!(stats.cached_tokens as usize, turn1.iter().map(Vec::len).sum::<usize>());
}

#[test]
fn scoring_prompts_share_steps_on_transient_state_without_sequence_slots() {
    // One sequence slot, steps of at most 40 rows.
    let model = EngineBuilder::new(fixture()).max_sequences(1).prefill_chunk(Some(40)).open().unwrap();
    let mut b = Batcher::new(&model, 1);
    let p = |seed: u32, n: u32| (0..n).map(|i| (i * 43 + seed * 59 + 2) % 1000).collect::<Vec<u32>>();
    let mut jobs: Vec<BatchJob> = (0..12).map(|i| BatchJob::new(p(i, 5 + i % 4), GenerateOptions::new(0)).with_prompt_logits()).collect();
    jobs.push(BatchJob::new(p(99, 6), GenerateOptions::new(4)));
    // Longer than a step's rows: scored chunk by chunk on a sequence slot instead.
    jobs.push(BatchJob::new(p(7, 57), GenerateOptions::new(0)).with_prompt_logits());
    for j in &jobs {
        b.submit(j.clone());
    }
    let mut got: HashMap<u64, Run> = HashMap::new();
    let stats = b.run(&mut |e: BatchEvent<'_>| {
        match e {
            BatchEvent::PromptLogits { job, first, logits } => {
                let g = got.entry(job).or_default();
                assert_eq!(g.2.len(), first);
                g.2.extend((0..logits.rows).map(|r| bits(logits.row(r))));
            }
            BatchEvent::Token { job, step } => got.entry(job).or_default().0.push(step.id),
            BatchEvent::Failed { job, error } => panic!("job {job} failed: {error}"),
            _ => {}
        }
        true
    });
    for (i, job) in jobs.iter().enumerate() {
        let want = solo(&model, job);
        let have = got.remove(&(i as u64)).unwrap_or_default();
        assert_eq!(have.0, want.0, "job {i}'s ids");
        assert!(have.2 == want.2, "job {i}'s prompt logits differ from a solo forward");
    }
    // 81 scoring rows in steps of 40 (3 steps, the generation's prompt joining the last), four
    // decode steps, two chunks of the long prompt: far fewer steps than jobs.
    assert_eq!(stats.jobs_finished, jobs.len() as u64);
    assert!(stats.steps <= 9, "{} steps", stats.steps);
    assert!(stats.sequences_per_step() > 1.5, "{}", stats.sequences_per_step());
}

#[test]
fn a_transient_sequence_runs_one_step_and_keeps_no_state() {
    use deltafin_sched::{Phase, Sequence, Slot};
    let model = EngineBuilder::new(fixture()).open().unwrap();
    let ids = [5u32, 9, 14, 3];
    let mut t = Sequence::transient(model.engine().model(), ids.len());
    let out = model.engine().step(&mut [Slot::new(&mut t, &ids, Phase::Prompt).logit_rows(LogitRows::All)], None).unwrap();
    let mut plain = model.new_sequence();
    let (want, _) = model.engine().forward(&mut plain, &ids, LogitRows::All).unwrap();
    assert!(out.logits[0].data == want.data, "transient logits differ from a plain forward");
    assert_eq!(t.bytes(model.engine().model().config()), 0, "every layer's state was released");
    let again = model.engine().step(&mut [Slot::new(&mut t, &[7], Phase::Decode)], None);
    assert!(again.unwrap_err().to_string().contains("one step only"));
}

/// Issue 49: requests sharing a system prompt in one batch run it once: the first to start runs
/// the prefix and keeps its state, the others wait for it and start there. Every job's ids and
/// logits are its solo run's; the prompt tokens computed drop by the prefix for each later job.
#[test]
fn a_shared_system_prompt_runs_once_per_batch_with_every_job_exact() {
    let system: Vec<u32> = (0..24).map(|i| (i * 53 + 7) % 1000).collect();
    let job = |suffix: &[u32], n: usize| BatchJob::new([&system[..], suffix].concat(), GenerateOptions::new(n));
    let jobs = vec![
        job(&[11, 12, 13], 6),
        job(&[21, 22], 8),
        job(&[31, 32, 33, 34, 35, 36, 37], 4),
        job(&[41], 5),
        // Another prompt, no prefix shared: runs beside them as usual.
        BatchJob::new((0..9).map(|i| (i * 17 + 400) % 1000).collect(), GenerateOptions::new(6)),
    ];
    let submitted: u64 = jobs.iter().map(|j| j.prompt.len() as u64).sum();
    for chunk in [None, Some(5)] {
        let model = EngineBuilder::new(fixture()).max_sequences(3).kept_states(1).prefill_chunk(chunk).open().unwrap();
        let mut batcher = Batcher::new(&model, 3).share_prefixes(8);
        for j in &jobs {
            batcher.submit(j.clone());
        }
        let mut got: HashMap<u64, Run> = HashMap::new();
        let mut cached = Vec::new();
        batcher.run(&mut |e: BatchEvent<'_>| {
            match e {
                BatchEvent::Token { job, step } => {
                    let g = got.entry(job).or_default();
                    g.0.push(step.id);
                    g.1.push(bits(step.logits));
                }
                BatchEvent::Started { job, cached_tokens } => cached.push((job, cached_tokens)),
                BatchEvent::Failed { job, error } => panic!("job {job} failed: {error}"),
                _ => {}
            }
            true
        });
        for (i, j) in jobs.iter().enumerate() {
            let want = solo(&model, j);
            let have = got.remove(&(i as u64)).unwrap();
            assert_eq!(have.0, want.0, "chunk {chunk:?}: job {i}'s ids differ from its solo run");
            assert!(have.1 == want.1, "chunk {chunk:?}: job {i}'s logits differ from its solo run");
        }
        cached.sort();
        assert_eq!(cached, vec![(0, 0), (1, 24), (2, 24), (3, 24), (4, 0)], "chunk {chunk:?}: who started from the shared prefix");
        let s = batcher.stats();
        assert_eq!(s.shared_prefixes, 1);
        assert_eq!(s.prompt_tokens, submitted - 3 * 24, "chunk {chunk:?}: the prefix ran once");
        assert_eq!(s.cached_tokens, 3 * 24);
    }
}

/// Issue 49: a draft model drafts inside a lockstep batch too (each job its own drafter and
/// cache): the trained K3 with its trained Qwen3 draft, every job's ids and logits its solo
/// plain run's.
#[test]
fn a_draft_model_drafts_for_every_job_in_lockstep_with_solo_outputs() {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../training/models");
    let model = EngineBuilder::new(root.join("k3"))
        .max_sequences(3)
        .draft(Some(deltafin_sched::DraftWith::Model(root.join("draft"))))
        .open()
        .unwrap();
    let s = check_drafting(&model, 3, Batcher::new(&model, 3).drafting_as_opened(4), "trained draft model");
    assert!(s.verifies > 0 && s.drafted > 0, "the draft model drafted: {s:?}");
    assert!(s.accepted > 0, "some of its drafts were K3's choices: {s:?}");
}
