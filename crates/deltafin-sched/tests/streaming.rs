//! Streaming from a store gives exactly the ids of the in-RAM path: across RAM budgets from
//! "everything fits" to the minimum, 1 to 4 homes, page-cache bypass on and off, prefetch on and
//! off, prompt chunking; and survives failing drives by reading another copy.

use std::path::{Path, PathBuf};

use deltafin_sched::{CacheMode, EngineBuilder, GenerateOptions, LoadedModel};
use deltafin_store::{setup, ExpertLayoutKind, NoProgress, SetupOptions};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-k3-dev/checkpoint")
}

const PROMPT: &[u32] = &[78, 544, 115, 815, 284, 256, 101, 969, 111, 58, 32, 49, 50, 347, 266];
const NEW: usize = 12;

fn generate(model: &LoadedModel, on_token: &mut dyn FnMut(usize)) -> Result<Vec<u32>, deltafin_sched::Error> {
    let mut out = Vec::new();
    let mut seq = model.new_sequence();
    model.engine().generate(&mut seq, PROMPT, &GenerateOptions::new(NEW), |id| {
        out.push(id);
        on_token(out.len());
        true
    })?;
    Ok(out)
}

fn reference() -> Vec<u32> {
    generate(&EngineBuilder::new(fixture()).open().unwrap(), &mut |_| {}).unwrap()
}

fn make_store(dir: &Path, homes: usize, copies: usize, layout: ExpertLayoutKind) -> PathBuf {
    let out = dir.join("store");
    let homes: Vec<PathBuf> = (0..homes).map(|h| dir.join(format!("drive{h}"))).collect();
    for h in &homes {
        std::fs::create_dir_all(h).unwrap();
    }
    let homes = if layout == ExpertLayoutKind::InPlace { Vec::new() } else { homes };
    // Whole experts dealt in turn: the striped and weighted placements have their own test below.
    let opts = SetupOptions::new(fixture(), &out).homes(homes).layout(layout).copies(copies);
    setup(&opts.placement(deltafin_store::Placement::RoundRobin), &NoProgress).unwrap();
    out
}

/// The smallest budget the store accepts (parsed from the error it gives below it).
fn minimum_budget(store: &Path) -> u64 {
    let e = EngineBuilder::new(store).ram_budget(Some(1)).open().err().expect("1 byte is too small").to_string();
    assert!(e.contains("too small") && e.contains("at least"), "{e}");
    let after = e.split("at least ").nth(1).unwrap();
    after.split(' ').next().unwrap().parse().unwrap()
}

#[test]
fn identical_ids_across_budgets_homes_and_cache_modes() {
    let want = reference();
    let tmp = tempfile::tempdir().unwrap();
    for homes in 1..=4 {
        let store = make_store(&tmp.path().join(format!("h{homes}")), homes, 1, ExpertLayoutKind::Packs);
        let min = minimum_budget(&store);
        let expert = 16384u64;
        for budget in [None, Some(min + 400 * expert), Some(min + 8 * expert), Some(min)] {
            for mode in [CacheMode::Direct, CacheMode::Buffered] {
                let prefetch = budget != Some(min + 8 * expert);
                let model = EngineBuilder::new(&store)
                    .ram_budget(budget)
                    .cache_mode(mode)
                    .prefetch(prefetch)
                    .prefill_chunk(Some(4))
                    .open()
                    .unwrap();
                let got = generate(&model, &mut |_| {}).unwrap();
                assert_eq!(got, want, "homes {homes}, budget {budget:?}, {mode:?}");
                let s = model.engine().experts().stats();
                assert!(s.bytes_read > 0, "experts were streamed");
                if let Some(b) = budget {
                    let plan = model.memory_plan().unwrap();
                    assert!(
                        s.cache_peak_bytes <= plan.experts,
                        "expert buffers {} exceeded their share {} of budget {b}",
                        s.cache_peak_bytes,
                        plan.experts
                    );
                }
                if homes > 1 {
                    assert!(s.per_home.iter().all(|h| h.reads > 0), "every drive served reads: {:?}", s.per_home);
                }
            }
        }
        assert!(EngineBuilder::new(&store).ram_budget(Some(min - 1)).open().is_err());
    }
}

#[test]
fn in_place_store_matches() {
    let tmp = tempfile::tempdir().unwrap();
    let store = make_store(tmp.path(), 1, 1, ExpertLayoutKind::InPlace);
    let min = minimum_budget(&store);
    let model = EngineBuilder::new(&store).ram_budget(Some(min)).open().unwrap();
    assert_eq!(generate(&model, &mut |_| {}).unwrap(), reference());
}

#[test]
fn corrupt_expert_is_an_error_naming_expert_and_file() {
    let tmp = tempfile::tempdir().unwrap();
    let store = make_store(tmp.path(), 1, 1, ExpertLayoutKind::Packs);
    let m = deltafin_store::Manifest::read(&store).unwrap();
    // Expert 20 of layer 1 is routed by the prompt's first token (fixture reference.json).
    let e = m.experts.iter().find(|e| e.layer == 1 && e.expert == 20).unwrap();
    let path = m.copy_path(&e.copies[0]);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[e.copies[0].offset as usize + 100] ^= 0x5a;
    std::fs::write(&path, bytes).unwrap();
    let model = EngineBuilder::new(&store).ram_budget(Some(minimum_budget(&store))).open().unwrap();
    let mut seq = model.new_sequence();
    let err = model
        .engine()
        .forward(&mut seq, PROMPT, deltafin_sched::LogitRows::Last)
        .expect_err("corruption must not pass silently")
        .to_string();
    assert!(
        err.contains(&format!("expert 1/{}", e.expert)) && err.contains(&path.display().to_string()) && err.contains("checksum"),
        "{err}"
    );
    // A failed forward leaves the sequence as it was.
    assert!(seq.ids().is_empty());
    let r = deltafin_store::doctor(&store, true, &NoProgress).unwrap();
    assert_eq!(r.problems.len(), 1, "{:?}", r.problems);
    assert!(r.problems[0].contains("corrupt"));
}

#[test]
fn a_corrupt_stripe_is_an_error_naming_its_drive_however_its_parts_land() {
    use deltafin_store::{DriveFacts, Placement};
    // Each stripe is checked on its own as its parts land (in order or not, with one reader
    // thread per drive or several): one flipped byte in any stripe names that stripe's file.
    for stripe in [0usize, 2] {
        for queue_depth in [1, 3] {
            let tmp = tempfile::tempdir().unwrap();
            let out = tmp.path().join("store");
            let dirs: Vec<PathBuf> = (0..3).map(|h| tmp.path().join(format!("drive{h}"))).collect();
            let facts = [136e6, 71e6, 57e6].iter().map(|&r| DriveFacts { capacity: None, rate: Some(r) }).collect();
            setup(&SetupOptions::new(fixture(), &out).homes(dirs).placement(Placement::Striped).drives(facts), &NoProgress).unwrap();
            let m = deltafin_store::Manifest::read(&out).unwrap();
            // Expert 20 of layer 1 is routed by the prompt's first token (fixture reference.json).
            let e = m.experts.iter().find(|e| e.layer == 1 && e.expert == 20).unwrap();
            let c = &e.copies[stripe];
            let path = m.copy_path(c);
            let mut bytes = std::fs::read(&path).unwrap();
            let (_, len) = c.range(e.len);
            bytes[(c.offset + len - 1) as usize] ^= 0x5a;
            std::fs::write(&path, bytes).unwrap();
            let model = EngineBuilder::new(&out).split_reads_min(8192).queue_depth(queue_depth).open().unwrap();
            let mut seq = model.new_sequence();
            let err = model
                .engine()
                .forward(&mut seq, PROMPT, deltafin_sched::LogitRows::Last)
                .expect_err("a corrupt stripe must not pass silently")
                .to_string();
            assert!(
                err.contains("expert 1/20") && err.contains(&path.display().to_string()) && err.contains("checksum"),
                "stripe {stripe}, queue depth {queue_depth}: {err}"
            );
        }
    }
}

#[test]
fn truncated_pack_is_found_by_doctor_and_fails_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let store = make_store(tmp.path(), 1, 1, ExpertLayoutKind::Packs);
    let m = deltafin_store::Manifest::read(&store).unwrap();
    let path = m.copy_path(&m.experts.iter().find(|e| e.layer == 2).unwrap().copies[0]);
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len / 2).unwrap();
    let r = deltafin_store::doctor(&store, false, &NoProgress).unwrap();
    assert!(!r.ok() && r.problems.iter().all(|p| p.contains("truncated")), "{:?}", r.problems);
    // Found when the store opens, before the spine is loaded, naming the expert and the file.
    let err = EngineBuilder::new(&store).open().err().expect("a truncated store cannot open").to_string();
    assert!(err.contains("no readable copy") && err.contains("truncated") && err.contains(&path.display().to_string()), "{err}");
}

#[test]
fn a_drive_that_disappears_or_fails_mid_run_fails_over() {
    let want = reference();
    for failure in ["disappear", "truncate"] {
        let tmp = tempfile::tempdir().unwrap();
        let store = make_store(tmp.path(), 2, 2, ExpertLayoutKind::Packs);
        let m = deltafin_store::Manifest::read(&store).unwrap();
        let home1 = m.homes[1].clone();
        // Split reads on (tiny experts split at page granularity) so parts fail over too.
        let model = EngineBuilder::new(&store).ram_budget(Some(minimum_budget(&store))).split_reads_min(8192).open().unwrap();
        let got = generate(&model, &mut |n| {
            if n == 3 {
                match failure {
                    "disappear" => std::fs::remove_dir_all(&home1).unwrap(),
                    _ => {
                        for e in std::fs::read_dir(home1.join("deltafin-experts")).unwrap() {
                            for f in std::fs::read_dir(e.unwrap().path()).unwrap() {
                                let f = f.unwrap().path();
                                if f.extension().is_some_and(|x| x == "pack") {
                                    std::fs::OpenOptions::new().write(true).open(&f).unwrap().set_len(0).unwrap();
                                }
                            }
                        }
                    }
                }
            }
        })
        .unwrap();
        assert_eq!(got, want, "{failure}");
        let s = model.engine().experts().stats();
        assert!(s.per_home[1].errors > 0, "{failure}: the failing drive was noticed: {:?}", s.per_home);
        assert!(s.per_home[0].reads > 0);
    }
}

#[test]
fn split_reads_over_copies_and_reader_threads_give_identical_ids() {
    let want = reference();
    // One drive (parts spread over its reader threads) and three drives holding every expert.
    for (homes, queue_depth) in [(1, 4), (3, 1), (3, 2)] {
        let tmp = tempfile::tempdir().unwrap();
        let store = make_store(tmp.path(), homes, homes, ExpertLayoutKind::Packs);
        let min = minimum_budget(&store);
        // Prefetch on: guesses are split too, and cancelled part-way when wrong.
        let open = |budget| {
            EngineBuilder::new(&store).ram_budget(budget).queue_depth(queue_depth).split_reads_min(8192).prefetch(true).open().unwrap()
        };
        for budget in [Some(min), Some(min + 20 * 16384), None] {
            let model = open(budget);
            assert_eq!(generate(&model, &mut |_| {}).unwrap(), want, "{homes} homes, budget {budget:?}");
            let s = model.engine().experts().stats();
            assert!(s.per_home.iter().all(|h| h.reads > 0), "{:?}", s.per_home);
            // Parts are counted as reads: more reads than experts fetched shows the splitting.
            let reads: u64 = s.per_home.iter().map(|h| h.reads).sum();
            assert!(reads > s.misses, "{homes} homes: reads {reads} vs misses {}", s.misses);
        }
        // A corrupt copy is still found and named when reads are split.
        let m = deltafin_store::Manifest::read(&store).unwrap();
        let e = m.experts.iter().find(|e| e.layer == 1 && e.expert == 20).unwrap();
        for c in &e.copies {
            let path = m.copy_path(c);
            let mut bytes = std::fs::read(&path).unwrap();
            bytes[c.offset as usize + 5000] ^= 0x77;
            std::fs::write(&path, bytes).unwrap();
        }
        let err = generate(&open(Some(min)), &mut |_| {}).expect_err("corrupt everywhere must fail").to_string();
        assert!(err.contains("expert 1/20") && err.contains("checksum"), "{homes} homes: {err}");
    }
}

#[test]
fn pinned_hot_tier_from_heat_history_serves_hits_without_changing_ids() {
    let want = reference();
    let tmp = tempfile::tempdir().unwrap();
    let store = make_store(tmp.path(), 1, 1, ExpertLayoutKind::Packs);
    let min = minimum_budget(&store);
    let budget = Some(min + 40 * 16384);
    let cold = EngineBuilder::new(&store).ram_budget(budget).open().unwrap();
    assert_eq!(generate(&cold, &mut |_| {}).unwrap(), want);
    let cold_hits = cold.engine().experts().stats().hits;
    cold.save_heat().unwrap();
    assert!(store.join("heat.json").exists());
    // Pin the 24 hottest experts (about 24 x 12 KiB aligned).
    let pinned = EngineBuilder::new(&store).ram_budget(budget).pin_bytes(24 * 16384).open().unwrap();
    let before = pinned.engine().experts().stats();
    assert_eq!(generate(&pinned, &mut |_| {}).unwrap(), want);
    let after = pinned.engine().experts().stats();
    assert!(after.hits - before.hits > cold_hits, "pinned experts are served from RAM ({} vs {cold_hits} hits)", after.hits - before.hits);
}

#[test]
fn read_caps_bound_what_each_drive_delivers_and_leave_ids_alone() {
    let want = reference();
    let tmp = tempfile::tempdir().unwrap();
    let store = make_store(tmp.path(), 2, 2, ExpertLayoutKind::Packs);
    let cap = 8_000_000u64;
    let start = std::time::Instant::now();
    let model = EngineBuilder::new(&store).read_caps(vec![cap, cap / 2]).open().unwrap();
    assert_eq!(generate(&model, &mut |_| {}).unwrap(), want);
    let elapsed = start.elapsed().as_secs_f64();
    let s = model.engine().experts().stats();
    // A read returns no earlier than the end of its slot on the drive's byte clock, so no drive
    // can have delivered more than its cap times the time since the first read.
    for (h, cap) in s.per_home.iter().zip([cap, cap / 2]) {
        assert!(h.bytes > 0, "{:?}", s.per_home);
        assert!(
            h.bytes as f64 <= cap as f64 * elapsed,
            "drive {} delivered {} bytes in {elapsed:.3} s under a cap of {cap} B/s",
            h.path,
            h.bytes
        );
    }
}

#[test]
fn both_cache_policies_with_prefetch_give_identical_ids() {
    let want = reference();
    let tmp = tempfile::tempdir().unwrap();
    let store = make_store(tmp.path(), 2, 1, ExpertLayoutKind::Packs);
    let min = minimum_budget(&store);
    for policy in [deltafin_sched::CachePolicy::Lru, deltafin_sched::CachePolicy::NextUse] {
        for budget in [Some(min), Some(min + 16 * 16384)] {
            // Split reads on, so guesses are split and can be dropped part-way.
            let model =
                EngineBuilder::new(&store).ram_budget(budget).cache_policy(policy).prefetch(true).split_reads_min(8192).open().unwrap();
            assert_eq!(generate(&model, &mut |_| {}).unwrap(), want, "{policy:?}, budget {budget:?}");
        }
    }
}

#[test]
fn striped_and_weighted_stores_give_identical_ids_and_a_dead_stripe_drive_is_named() {
    use deltafin_store::{DriveFacts, Placement};
    let want = reference();
    let rates = [136e6, 71e6, 71e6, 57e6];
    for placement in [Placement::Striped, Placement::Weighted] {
        for homes in 2..=4 {
            let tmp = tempfile::tempdir().unwrap();
            let out = tmp.path().join("store");
            let dirs: Vec<PathBuf> = (0..homes).map(|h| tmp.path().join(format!("drive{h}"))).collect();
            let facts = rates[..homes].iter().map(|&r| DriveFacts { capacity: None, rate: Some(r) }).collect();
            setup(&SetupOptions::new(fixture(), &out).homes(dirs).placement(placement).drives(facts), &NoProgress).unwrap();
            let min = minimum_budget(&out);
            for (budget, split_min, queue_depth) in [(Some(min), 8192, 1), (Some(min + 20 * 16384), 8192, 3), (None, u64::MAX, 2)] {
                let model = EngineBuilder::new(&out)
                    .ram_budget(budget)
                    .split_reads_min(split_min)
                    .queue_depth(queue_depth)
                    .prefetch(true)
                    .open()
                    .unwrap();
                assert_eq!(generate(&model, &mut |_| {}).unwrap(), want, "{placement:?} over {homes}, budget {budget:?}");
            }
        }
    }
    // A striped store keeps one copy of every byte: a drive that dies mid-run is an error naming
    // it and the bytes it held, never a wrong token.
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("store");
    let dirs: Vec<PathBuf> = (0..2).map(|h| tmp.path().join(format!("drive{h}"))).collect();
    setup(&SetupOptions::new(fixture(), &out).homes(dirs.clone()), &NoProgress).unwrap();
    let model = EngineBuilder::new(&out).ram_budget(Some(minimum_budget(&out))).open().unwrap();
    let gone = deltafin_store::Manifest::read(&out).unwrap().homes[1].clone();
    let err = generate(&model, &mut |n| {
        if n == 2 {
            std::fs::remove_dir_all(&gone).unwrap();
        }
    })
    .expect_err("a dead drive with the only copy of a stripe must fail")
    .to_string();
    assert!(err.contains(&gone.display().to_string()) && err.contains("no other drive has them"), "{err}");
}

/// Records every progress phase: (name, total, bytes advanced).
#[derive(Default)]
struct Phases(std::sync::Mutex<Vec<(String, u64, u64)>>);

impl deltafin_store::Progress for Phases {
    fn begin(&self, phase: &str, total: u64) {
        self.0.lock().unwrap().push((phase.to_string(), total, 0));
    }
    fn advance(&self, bytes: u64) {
        self.0.lock().unwrap().last_mut().expect("advance after begin").2 += bytes;
    }
}

#[test]
fn opening_a_store_reports_the_spine_read_in_full() {
    let tmp = tempfile::tempdir().unwrap();
    let store = make_store(tmp.path(), 1, 1, ExpertLayoutKind::Packs);
    let phases = std::sync::Arc::new(Phases::default());
    let model = EngineBuilder::new(&store).progress(phases.clone()).open().unwrap();
    let spine: u64 = deltafin_store::Manifest::read(&store).unwrap().spine.values().map(|t| t.len).sum();
    assert_eq!(*phases.0.lock().unwrap(), [("spine".to_string(), spine, spine)]);
    assert_eq!(generate(&model, &mut |_| {}).unwrap(), reference());
}
