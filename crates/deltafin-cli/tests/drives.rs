//! Drives as people have them: placement over unequal homes at one copy (striped, weighted,
//! round-robin), `setup --plan`, `setup --rebalance` (killed and resumed), and a failing drive of
//! a striped store named in the error. Through the `deltafin` binary on the tiny fixture.

mod common;

use common::*;

use std::path::{Path, PathBuf};
use std::process::Command;

use deltafin_store::Manifest;

fn run_ids(store: &Path) -> String {
    ok(bin().args(["run", "--model"]).arg(store).args(["--ids", PROMPT_IDS, "--max-new", "16", "--print-ids", "--ram-budget", "32M"]))
        .trim()
        .to_string()
}

/// `--home` arguments for `homes` (folder name, stated capacity, stated rate).
fn home_args(root: &Path, homes: &[(&str, &str, &str)]) -> Vec<String> {
    homes.iter().flat_map(|(name, size, rate)| ["--home".to_string(), format!("{}:{size}:{rate}", root.join(name).display())]).collect()
}

fn setup(from: &Path, out: &Path, extra: &[String]) -> Command {
    let mut c = bin();
    c.args(["setup", "--full", "--from"]).arg(from).arg("--out").arg(out).args(extra);
    c
}

fn pack_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir.join("deltafin-experts")) else { return 0 };
    rd.flatten()
        .flat_map(|d| std::fs::read_dir(d.path()).unwrap().flatten())
        .filter(|f| f.path().extension().is_some_and(|x| x == "pack"))
        .map(|f| f.metadata().unwrap().len())
        .sum()
}

#[test]
fn every_placement_and_drive_count_gives_the_reference_ids_within_stated_capacities() {
    let tmp = tempfile::tempdir().unwrap();
    // The fixture's experts take 3.5 MB (288 x 12 KiB, page-aligned); no drive can hold a full
    // copy, two hold 1.4x it. (Striping keeps a page per expert in reserve on each drive, a third
    // of these tiny experts, 0.002% of K3's.)
    let drives = [("d0", "3400K", "136M/s"), ("d1", "3000K", "71M/s"), ("d2", "3000K", "71M/s"), ("d3", "2600K", "57M/s")];
    let mut n = 0;
    for count in 2..=4 {
        for placement in ["striped", "weighted", "round-robin"] {
            n += 1;
            let root = tmp.path().join(format!("{n}"));
            // The drives' mount points exist; setup makes the homes in them.
            std::fs::create_dir_all(&root).unwrap();
            let mut extra = home_args(&root, &drives[..count]);
            extra.extend(["--placement".to_string(), placement.to_string()]);
            let store = root.join("store");
            let planned = ok(setup(&fixture(), &store, &extra).arg("--plan"));
            assert!(planned.contains(&format!("placement: {placement}")) && planned.contains("expected read rate"), "{planned}");
            assert!(!store.exists(), "--plan writes nothing");
            let made = setup(&fixture(), &store, &extra).output().unwrap();
            let err = String::from_utf8_lossy(&made.stderr);
            if !made.status.success() {
                // Whole experts dealt equally cannot fit two small drives; the error says so.
                assert!(placement == "round-robin" && err.contains("can hold"), "{placement} {count}: {err}");
                continue;
            }
            assert_eq!(run_ids(&store), REFERENCE_GREEDY, "{placement} over {count} drives");
            let mut total = 0;
            for (name, size, _) in &drives[..count] {
                let cap = size.trim_end_matches('K').parse::<u64>().unwrap() * 1000;
                let used = pack_bytes(&root.join(name));
                assert!(used <= cap, "{placement} {count}: {name} holds {used} of {cap}");
                total += used;
            }
            // One copy, no more (a 3-page expert cannot have a stripe on each of 4 drives).
            assert!((288 * 12288..2 * 288 * 12288).contains(&total), "{placement} {count}: {total}");
            let m = Manifest::read(&store).unwrap();
            assert_eq!(m.experts.iter().any(|e| e.is_striped()), placement == "striped");
            assert!(m.experts.iter().all(|e| e.copies.iter().map(|c| c.range(e.len).1).sum::<u64>() == e.len));
        }
    }
    // Stated capacities that cannot hold the experts: refused before anything is written.
    let root = tmp.path().join("small");
    std::fs::create_dir_all(&root).unwrap();
    let err = fails(&mut setup(&fixture(), &root.join("store"), &home_args(&root, &[("a", "1M", "1G/s"), ("b", "1M", "1G/s")])));
    assert!(err.contains("cannot hold the experts"), "{err}");
    assert_eq!(pack_bytes(&root.join("a")) + pack_bytes(&root.join("b")), 0);
}

#[test]
fn a_killed_rebalance_resumes_and_moves_the_store_onto_other_drives() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    // A copy of the checkpoint, deleted before the rebalance: it reads the store, not the source.
    let ckpt = tmp.path().join("ckpt");
    copy_dir(&fixture(), &ckpt);
    let three = home_args(tmp.path(), &[("a", "", "136M/s"), ("b", "", "71M/s"), ("c", "", "57M/s")]);
    ok(&mut setup(&ckpt, &store, &three));
    assert_eq!(run_ids(&store), REFERENCE_GREEDY);
    // Drive c goes, drive d comes: the same setup with other homes is refused, naming --rebalance.
    let two = home_args(tmp.path(), &[("a", "", "136M/s"), ("d", "", "100M/s")]);
    let err = fails(&mut setup(&ckpt, &store, &two));
    assert!(err.contains("--rebalance"), "{err}");
    // Said for people: paths and shares, not Rust's debug lists.
    assert!(!err.contains("[\"") && !err.contains("copies, not") && err.contains("1 copy"), "{err}");
    std::fs::remove_dir_all(&ckpt).unwrap();
    let rebalance = || {
        let mut c = bin();
        c.args(["setup", "--rebalance", "--out"]).arg(&store).args(&two);
        c
    };
    let crashed = rebalance().env("DELTAFIN_SETUP_CRASH_AFTER_LAYERS", "3").output().unwrap();
    assert!(!crashed.status.success(), "the injected crash happened");
    let err = fails(bin().args(["run", "--model"]).arg(&store).args(["--prompt", "x"]));
    assert!(err.contains("did not finish"), "{err}");
    ok(&mut rebalance());
    assert_eq!(run_ids(&store), REFERENCE_GREEDY);
    let m = Manifest::read(&store).unwrap();
    assert_eq!(m.homes.len(), 2);
    assert!(m.homes[1].ends_with("d"));
    assert_eq!(pack_bytes(&tmp.path().join("b")) + pack_bytes(&tmp.path().join("c")), 0, "the removed drives hold nothing");
    assert!(pack_bytes(&tmp.path().join("d")) > 0);
    ok(bin().args(["doctor", "--verify", "--model"]).arg(&store));
    // Back to whole experts, weighted, over three drives.
    let weighted = home_args(tmp.path(), &[("a", "", "136M/s"), ("b", "", "71M/s"), ("d", "", "100M/s")]);
    ok(bin().args(["setup", "--rebalance", "--placement", "weighted", "--out"]).arg(&store).args(&weighted));
    assert_eq!(run_ids(&store), REFERENCE_GREEDY);
    assert!(!Manifest::read(&store).unwrap().experts.iter().any(|e| e.is_striped()));
    let again = bin().args(["setup", "--rebalance", "--placement", "weighted", "--out"]).arg(&store).args(&weighted).output().unwrap();
    assert!(again.status.success() && String::from_utf8_lossy(&again.stderr).contains("already laid out"));
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

#[test]
fn a_failing_drive_of_a_striped_store_is_named_with_what_it_held() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    ok(&mut setup(&fixture(), &store, &home_args(tmp.path(), &[("a", "", "100M/s"), ("b", "", "100M/s")])));
    let b: PathBuf = Manifest::read(&store).unwrap().homes[1].clone();
    for d in std::fs::read_dir(b.join("deltafin-experts")).unwrap().flatten() {
        for f in std::fs::read_dir(d.path()).unwrap().flatten() {
            if f.path().extension().is_some_and(|x| x == "pack") {
                // The drive still lists its files but every read past the start fails.
                std::fs::OpenOptions::new().write(true).open(f.path()).unwrap().set_len(0).unwrap();
            }
        }
    }
    // Found when the store opens (the stripes are truncated) ...
    let err = fails(bin().args(["run", "--model"]).arg(&store).args(["--prompt", "x"]));
    assert!(err.contains("no readable copy") && err.contains(&b.display().to_string()), "{err}");
}

#[test]
fn a_store_made_round_robin_is_kept_by_following_the_refusal_literally() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let homes = home_args(tmp.path(), &[("a", "", "100M/s"), ("b", "", "100M/s")]);
    let mut rr = homes.clone();
    rr.extend(["--placement".to_string(), "round-robin".to_string()]);
    ok(&mut setup(&fixture(), &store, &rr));
    // The same homes without --placement now mean striped: refused, with the command that keeps it.
    let err = fails(&mut setup(&fixture(), &store, &homes));
    let cmd = err.split('`').nth(1).unwrap_or_else(|| panic!("no command in {err}"));
    let mut words = cmd.split_whitespace();
    assert_eq!(words.next(), Some("deltafin"));
    ok(bin().args(words));
    assert_eq!(Manifest::read(&store).unwrap().setup.placement, "round-robin");
    assert_eq!(run_ids(&store), REFERENCE_GREEDY);
}
