//! The store's fault matrix: every way a store, a setup or a checkpoint was seen to give wrong
//! tokens with exit code 0 (or a panic), each now failing loudly with advice that, followed
//! literally, fixes it, or repaired by setup. Driven through the `deltafin` binary on the tiny
//! fixture, so each case takes well under a second.

mod common;

use common::*;

use std::path::{Path, PathBuf};
use std::process::Command;

use deltafin_store::Manifest;

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

fn setup_cmd(from: &Path, out: &Path, extra: &[&str]) -> Command {
    let mut c = bin();
    c.args(["setup", "--full", "--from"]).arg(from).arg("--out").arg(out).args(extra);
    c
}

fn run_ids(store: &Path) -> Command {
    let mut c = bin();
    c.args(["run", "--model"]).arg(store).args(["--ids", PROMPT_IDS, "--max-new", "16", "--print-ids", "--ram-budget", "32M"]);
    c
}

fn flip(path: &Path, at: u64) {
    let mut b = std::fs::read(path).unwrap();
    b[at as usize] ^= 0x10;
    std::fs::write(path, b).unwrap();
}

/// Follows the advice at the end of an error literally: runs the last command quoted in
/// backticks (`deltafin ...` with this test's binary).
fn follow_advice(err: &str) {
    let cmd = err.rsplit('`').nth(1).unwrap_or_else(|| panic!("no command in {err}"));
    let mut words = cmd.split_whitespace();
    assert_eq!(words.next(), Some("deltafin"), "advice is not a deltafin command: {err}");
    ok(bin().args(words));
}

fn manifest(store: &Path) -> Manifest {
    Manifest::read(store).unwrap()
}

#[test]
fn damaged_spine_or_pack_fails_loudly_and_the_advice_repairs_it() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("s");
    ok(&mut setup_cmd(&fixture(), &store, &[]));
    let m = manifest(&store);
    for what in ["spine", "pack"] {
        let (path, at, name) = if what == "spine" {
            let t = &m.spine["language_model.model.embed_tokens.weight"];
            (store.join("spine.bin"), t.offset + 10, "embed_tokens".to_string())
        } else {
            let e = m.experts.iter().find(|e| e.layer == 1 && e.expert == 20).unwrap();
            (m.copy_path(&e.copies[0]), e.copies[0].offset + 100, "expert 1/20".to_string())
        };
        flip(&path, at);
        let err = fails(&mut run_ids(&store));
        assert!(err.contains(&name) && err.contains("checksum") && err.contains(&path.display().to_string()), "{err}");
        let doc = fails(bin().args(["doctor", "--verify", "--model"]).arg(&store));
        assert!(doc.contains(&name) && doc.contains("corrupt"), "{doc}");
        follow_advice(&err);
        ok(bin().args(["doctor", "--verify", "--model"]).arg(&store));
        assert_eq!(ok(&mut run_ids(&store)).trim(), REFERENCE_GREEDY);
    }
}

#[test]
fn a_truncated_spine_fails_naming_it_and_the_advice_repairs_it() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("s");
    ok(&mut setup_cmd(&fixture(), &store, &[]));
    let m = manifest(&store);
    // Cut into the last tensor of the file: found when the store opens, before any read.
    let (name, last) = m.spine.iter().max_by_key(|(_, t)| t.offset).unwrap();
    let path = store.join("spine.bin");
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(last.offset + last.len / 2).unwrap();
    let err = fails(&mut run_ids(&store));
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert!(err.contains(name.as_str()) && err.contains("truncated"), "{err}");
    follow_advice(&err);
    assert_eq!(ok(&mut run_ids(&store)).trim(), REFERENCE_GREEDY);
}

/// A checkpoint with the fixture's config and other weights: one spine byte and one expert
/// byte changed.
fn other_checkpoint(dir: &Path) -> PathBuf {
    let b = dir.join("ckpt-b");
    copy_dir(&fixture(), &b);
    let shard = b.join("model-00003-of-000004.safetensors");
    let h = deltafin_store::read_header(&shard, 0).unwrap();
    flip(&shard, h["language_model.model.embed_tokens.weight"].offset + 99);
    let shard = b.join("model-00001-of-000004.safetensors");
    let h = deltafin_store::read_header(&shard, 0).unwrap();
    let t = h.iter().find(|(n, _)| n.contains("experts.3.w2.weight_packed")).unwrap().1;
    flip(&shard, t.offset + 5);
    b
}

#[test]
fn a_store_knows_its_checkpoint_and_never_mixes_two() {
    let tmp = tempfile::tempdir().unwrap();
    let b = other_checkpoint(tmp.path());
    let store = tmp.path().join("s");
    ok(&mut setup_cmd(&fixture(), &store, &[]));
    let id_a = manifest(&store).source_id;
    // Same config, other weights: refused, and the store keeps working as it was.
    let err = fails(&mut setup_cmd(&b, &store, &[]));
    assert!(err.contains("--reinstall") && err.contains("not this one"), "{err}");
    assert_eq!(ok(&mut run_ids(&store)).trim(), REFERENCE_GREEDY);
    // An interrupted setup of A cannot be resumed from B.
    let half = tmp.path().join("half");
    let crashed = setup_cmd(&fixture(), &half, &[]).env("DELTAFIN_SETUP_CRASH_AFTER_LAYERS", "4").output().unwrap();
    assert!(!crashed.status.success());
    let err = fails(&mut setup_cmd(&b, &half, &[]));
    assert!(err.contains("is being set up with") && err.contains("--reinstall"), "{err}");
    // ...and its advice to keep the old install, followed literally, finishes it.
    follow_advice(&err.replace("; to replace it with this checkpoint and these arguments, add --reinstall", ""));
    assert_eq!(ok(&mut run_ids(&half)).trim(), REFERENCE_GREEDY);
    // Asked to, setup replaces the store with B.
    ok(&mut setup_cmd(&b, &store, &["--reinstall"]));
    let m = manifest(&store);
    assert_ne!(m.source_id, id_a);
    ok(bin().args(["doctor", "--verify", "--model"]).arg(&store));
    // Two checkpoints installed into one home keep separate packs.
    let home = tmp.path().join("home");
    let (sa, sb) = (tmp.path().join("sa"), tmp.path().join("sb"));
    ok(&mut setup_cmd(&fixture(), &sa, &["--home", home.to_str().unwrap()]));
    ok(&mut setup_cmd(&b, &sb, &["--home", home.to_str().unwrap()]));
    assert_eq!(std::fs::read_dir(home.join("deltafin-experts")).unwrap().count(), 2);
    ok(bin().args(["doctor", "--verify", "--model"]).arg(&sa));
    ok(bin().args(["doctor", "--verify", "--model"]).arg(&sb));
    assert_eq!(ok(&mut run_ids(&sa)).trim(), REFERENCE_GREEDY);
}

#[test]
fn a_second_setup_is_refused_while_another_holds_the_lock() {
    let tmp = tempfile::tempdir().unwrap();
    let (store, home) = (tmp.path().join("s"), tmp.path().join("h"));
    std::fs::create_dir_all(&store).unwrap();
    let lock = deltafin_store::DirLock::acquire(&store).unwrap();
    let err = fails(&mut setup_cmd(&fixture(), &store, &["--home", home.to_str().unwrap()]));
    assert!(err.contains("locked by process") && err.contains(&std::process::id().to_string()), "{err}");
    assert!(!store.join("spine.bin").exists(), "nothing written while locked");
    drop(lock);
    ok(&mut setup_cmd(&fixture(), &store, &["--home", home.to_str().unwrap()]));
    // Each home's pack folder is locked too.
    let packs = std::fs::read_dir(home.join("deltafin-experts")).unwrap().next().unwrap().unwrap().path();
    let lock = deltafin_store::DirLock::acquire(&packs).unwrap();
    let err = fails(&mut setup_cmd(&fixture(), &store, &["--home", home.to_str().unwrap()]));
    assert!(err.contains("locked by process"), "{err}");
    drop(lock);
}

#[test]
fn manifest_changes_fail_loudly_and_never_panic() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("s");
    ok(&mut setup_cmd(&fixture(), &store, &[]));
    let pristine = std::fs::read(store.join("manifest.json")).unwrap();
    // One changed digit of the file as it is on disk: the seal no longer matches.
    let text = String::from_utf8(pristine.clone()).unwrap();
    let at = text.find("\"offset\": 1").unwrap() + "\"offset\": ".len();
    let changed = format!("{}5{}", &text[..at], &text[at + 1..]);
    std::fs::write(store.join("manifest.json"), changed).unwrap();
    let err = fails(&mut run_ids(&store));
    assert!(err.contains("manifest.json") && err.contains("checksum"), "{err}");
    fails(bin().args(["doctor", "--verify", "--model"]).arg(&store));
    follow_advice(&err);
    assert_eq!(ok(&mut run_ids(&store)).trim(), REFERENCE_GREEDY);
    // A manifest re-sealed by a buggy writer is still checked against the config and the bytes.
    type Edit = fn(&mut Manifest);
    let edits: [(&str, Edit); 6] = [
        ("not an expert of this config", |m| m.experts[5].layer = 0),
        ("listed twice", |m| m.experts[5].expert = m.experts[4].expert),
        ("checksum mismatch", |m| m.experts.iter_mut().find(|e| e.layer == 1 && e.expert == 20).unwrap().copies[0].offset += 4096),
        ("checksum mismatch", |m| m.spine.values_mut().next().unwrap().offset += 2),
        ("bytes for", |m| m.spine.values_mut().next().unwrap().len += 2),
        ("does not fit", |m| m.layouts[0].1[0] = 1 << 30),
    ];
    for (want, edit) in edits {
        let mut m = Manifest::read(&store).unwrap();
        edit(&mut m);
        m.write(&store).unwrap();
        let err = fails(&mut run_ids(&store));
        assert!(err.contains(want), "expected {want:?}: {err}");
        fails(bin().args(["doctor", "--verify", "--model"]).arg(&store));
        std::fs::write(store.join("manifest.json"), &pristine).unwrap();
    }
}

#[test]
fn rerunning_setup_repairs_what_it_used_to_skip() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("s");
    let homes = ["--home", tmp.path().join("h0").to_str().unwrap(), "--home", tmp.path().join("h1").to_str().unwrap()].map(String::from);
    let homes: Vec<&str> = homes.iter().map(String::as_str).collect();
    ok(&mut setup_cmd(&fixture(), &store, &homes));
    let m = manifest(&store);
    let t = m.spine.values().next().unwrap();
    flip(&store.join("spine.bin"), t.offset + 1);
    let e = &m.experts[40];
    flip(&m.copy_path(&e.copies[0]), e.copies[0].offset + 3);
    std::fs::write(store.join("tiktoken.model"), "broken").unwrap();
    std::fs::remove_file(store.join("spine.bin.json")).unwrap();
    fails(bin().args(["doctor", "--verify", "--model"]).arg(&store));
    ok(&mut setup_cmd(&fixture(), &store, &homes));
    ok(bin().args(["doctor", "--verify", "--model"]).arg(&store));
    assert_eq!(ok(&mut run_ids(&store)).trim(), REFERENCE_GREEDY);
}

#[test]
fn interrupted_setup_with_other_arguments_leaves_no_stale_manifest() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("s");
    let (h0, h1) = (tmp.path().join("h0"), tmp.path().join("h1"));
    let two = ["--home", h0.to_str().unwrap(), "--home", h1.to_str().unwrap(), "--copies", "2"];
    let one = ["--home", h0.to_str().unwrap(), "--home", h1.to_str().unwrap(), "--copies", "1"];
    ok(&mut setup_cmd(&fixture(), &store, &two));
    let err = fails(&mut setup_cmd(&fixture(), &store, &one));
    assert!(err.contains("2 copies") && err.contains("--reinstall"), "{err}");
    let mut c = setup_cmd(&fixture(), &store, &one);
    let crashed = c.arg("--reinstall").env("DELTAFIN_SETUP_CRASH_AFTER_LAYERS", "2").output().unwrap();
    assert!(!crashed.status.success());
    assert!(!store.join("manifest.json").exists(), "no manifest may point at packs being rewritten");
    let err = fails(&mut run_ids(&store));
    assert!(err.contains("did not finish"), "{err}");
    // Resuming with the new arguments continues the new install.
    ok(&mut setup_cmd(&fixture(), &store, &one));
    assert_eq!(manifest(&store).setup.copies, 1);
    assert_eq!(ok(&mut run_ids(&store)).trim(), REFERENCE_GREEDY);
}

/// Rewrites a shard's header in place (same length, padded with spaces).
fn edit_header(shard: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let mut b = std::fs::read(shard).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let mut h: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    edit(h.as_object_mut().unwrap());
    let mut text = serde_json::to_vec(&h).unwrap();
    assert!(text.len() <= n);
    text.resize(n, b' ');
    b[8..8 + n].copy_from_slice(&text);
    std::fs::write(shard, b).unwrap();
}

#[test]
fn setup_rejects_every_checkpoint_run_rejects() {
    let tmp = tempfile::tempdir().unwrap();
    type Break = fn(&Path);
    let cases: [(&str, Break); 4] = [
        ("swapped shape", |c| {
            edit_header(&c.join("model-00003-of-000004.safetensors"), |h| {
                h["language_model.lm_head.weight"]["shape"] = serde_json::json!([128, 1256]);
            })
        }),
        ("dtype change", |c| {
            edit_header(&c.join("model-00003-of-000004.safetensors"), |h| {
                h["language_model.model.norm.weight"]["dtype"] = "F32".into();
                h["language_model.model.norm.weight"]["shape"] = serde_json::json!([64]);
            })
        }),
        ("num_experts", |c| {
            let p = c.join("config.json");
            let text = std::fs::read_to_string(&p).unwrap().replace("\"num_experts\": 32", "\"num_experts\": 16");
            std::fs::write(p, text).unwrap();
        }),
        ("no tokenizer", |c| std::fs::remove_file(c.join("tiktoken.model")).unwrap()),
    ];
    for (name, brk) in cases {
        let ckpt = tmp.path().join(name.replace(' ', "-"));
        copy_dir(&fixture(), &ckpt);
        brk(&ckpt);
        let run = fails(bin().args(["run", "--model"]).arg(&ckpt).args(["--ids", "1,2", "--max-new", "1"]));
        let store = tmp.path().join(format!("{}-store", name.replace(' ', "-")));
        let setup = fails(&mut setup_cmd(&ckpt, &store, &[]));
        assert!(!store.join("manifest.json").exists(), "{name}: setup wrote a manifest");
        let last = |s: &str| s.lines().last().unwrap_or_default().to_string();
        assert_eq!(last(&run).split(": ").last(), last(&setup).split(": ").last(), "{name}: run and setup disagree: {run} / {setup}");
    }
}

#[test]
fn heat_saving_never_fails_a_run() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("s");
    ok(&mut setup_cmd(&fixture(), &store, &[]));
    // Runs at once on one store all save their heat.
    let kids: Vec<_> = (0..4).map(|_| run_ids(&store).stdout(std::process::Stdio::piped()).spawn().unwrap()).collect();
    for k in kids {
        let out = k.wait_with_output().unwrap();
        assert!(out.status.success());
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), REFERENCE_GREEDY);
    }
    // A heat file that cannot be replaced (as on a read-only store): a warning, the run succeeds.
    std::fs::remove_file(store.join("heat.json")).unwrap();
    std::fs::create_dir(store.join("heat.json")).unwrap();
    let out = run_ids(&store).output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), REFERENCE_GREEDY);
    assert!(String::from_utf8_lossy(&out.stderr).contains("warning: expert heat not saved"));
}

fn dir_bytes(d: &Path) -> u64 {
    std::fs::read_dir(d).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum()
}

#[test]
fn in_place_leaves_the_spine_in_the_shards_and_checks_it() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    copy_dir(&fixture(), &ckpt);
    let store = tmp.path().join("s");
    ok(&mut setup_cmd(&ckpt, &store, &["--in-place"]));
    assert!(!store.join("spine.bin").exists());
    assert!(dir_bytes(&store) < dir_bytes(&ckpt) / 10, "the store copied the model: {} bytes", dir_bytes(&store));
    assert_eq!(ok(&mut run_ids(&store)).trim(), REFERENCE_GREEDY);
    // The shards are the store: a changed spine byte there is found, and repair does not bless it.
    let shard = ckpt.join("model-00003-of-000004.safetensors");
    let h = deltafin_store::read_header(&shard, 0).unwrap();
    flip(&shard, h["language_model.model.norm.weight"].offset + 3);
    let err = fails(&mut run_ids(&store));
    assert!(err.contains("norm.weight") && err.contains("restore its original files"), "{err}");
    let repair = fails(bin().args(["doctor", "--repair", "--model"]).arg(&store));
    assert!(repair.contains("changed"), "{repair}");
    // Following the advice literally installs the checkpoint as it is now.
    follow_advice(&err);
    ok(bin().args(["doctor", "--verify", "--model"]).arg(&store));
    ok(&mut run_ids(&store));
}

#[test]
fn a_copying_setup_checks_free_space_first() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("s");
    let err = fails(setup_cmd(&fixture(), &store, &[]).env("DELTAFIN_SETUP_FREE_BYTES", "100000"));
    assert!(err.contains("not enough free space") && err.contains("needs"), "{err}");
    assert!(!store.join("spine.bin").exists() && !store.join("deltafin-experts").exists() || dir_bytes(&store) < 100_000);
    // In place needs no room for a copy.
    ok(setup_cmd(&fixture(), &tmp.path().join("p"), &["--in-place"]).env("DELTAFIN_SETUP_FREE_BYTES", "100000"));
}

#[test]
fn the_context_limit_ends_generation_like_max_new() {
    let tmp = tempfile::tempdir().unwrap();
    let stats = tmp.path().join("stats.json");
    let out = bin()
        .args(["run", "--model"])
        .arg(fixture())
        .args(["--ids", PROMPT_IDS, "--max-new", "16", "--print-ids", "--context", "30", "--stats-json"])
        .arg(&stats)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // 27 prompt tokens + 3 decode steps fill 30 positions: 4 tokens, the reference's first four.
    let want: Vec<&str> = REFERENCE_GREEDY.split(',').take(4).collect();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), want.join(","));
    assert!(String::from_utf8_lossy(&out.stderr).contains("context limit of 30"));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
    assert_eq!(v["generated_tokens"], 4);
    assert_eq!(v["context_limit_reached"], true);
}

#[test]
fn a_budget_on_a_checkpoint_folder_runs_through_a_checked_in_place_store() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    copy_dir(&fixture(), &ckpt);
    let home = tmp.path().join("home");
    let run = || {
        let mut c = run_ids(&ckpt);
        c.env("DELTAFIN_HOME", &home);
        c
    };
    let out = run().output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), REFERENCE_GREEDY);
    assert!(err.contains("checking every byte"), "{err}");
    let stores: Vec<PathBuf> = std::fs::read_dir(home.join("in-place")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(stores.len(), 1);
    assert!(dir_bytes(&stores[0]) < dir_bytes(&ckpt) / 10, "the store copied the model");
    // Later runs use it as it is.
    let out = run().output().unwrap();
    assert!(!String::from_utf8_lossy(&out.stderr).contains("checking"));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), REFERENCE_GREEDY);
    // A changed byte is never blessed by a silent re-check; the advice re-checks on purpose.
    let shard = ckpt.join("model-00003-of-000004.safetensors");
    let h = deltafin_store::read_header(&shard, 0).unwrap();
    flip(&shard, h["language_model.model.norm.weight"].offset + 3);
    let err = fails(&mut run());
    assert!(err.contains("changed since deltafin checked it") && err.contains("--reinstall"), "{err}");
    follow_advice(&err);
    ok(&mut run());
}

#[test]
fn a_spine_that_does_not_fit_is_read_per_pass_checked_with_identical_ids() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("s");
    ok(&mut setup_cmd(&fixture(), &store, &[]));
    let run = |budget: &str| {
        let mut c = bin();
        c.args(["run", "--model"]).arg(&store).args(["--ids", PROMPT_IDS, "--max-new", "16", "--print-ids", "--stats"]);
        c.args(["--ram-budget", budget]);
        c
    };
    // From the whole spine resident down to every layer read each pass: the same ids.
    let mut streamed = Vec::new();
    for budget in ["32M", "28M", "27M", "25.8M"] {
        let out = run(budget).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{budget}: {err}");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), REFERENCE_GREEDY, "{budget}");
        let n: usize =
            err.split(" layers read each pass").next().and_then(|h| h.rsplit('(').next()).and_then(|n| n.parse().ok()).unwrap_or(0);
        streamed.push(n);
    }
    assert_eq!(streamed[0], 0);
    assert!(streamed.windows(2).all(|w| w[0] <= w[1]) && streamed[3] == 10, "{streamed:?}");
    // Below the minimum: an error stating it and what it is made of.
    let err = fails(&mut run("8M"));
    assert!(err.contains("two streamed spine layers") && err.contains("needs at least"), "{err}");
    // The embedding, read by row under a short budget, is checked whole when the model opens.
    let m = manifest(&store);
    let e = &m.spine["language_model.model.embed_tokens.weight"];
    flip(&store.join("spine.bin"), e.offset + 5);
    let err = fails(&mut run("25.8M"));
    assert!(err.contains("embed_tokens") && err.contains("checksum"), "{err}");
    flip(&store.join("spine.bin"), e.offset + 5);
    // A streamed layer is checked as it is read each pass.
    let t = &manifest(&store).spine["language_model.model.layers.5.self_attn.o_proj.weight"];
    flip(&store.join("spine.bin"), t.offset + 7);
    let err = fails(&mut run("25.8M"));
    assert!(err.contains("layers.5.self_attn.o_proj.weight") && err.contains("checksum"), "{err}");
}

/// `doctor` without `--verify` reads the spine against its checksums, as opening the store does:
/// a store `run` refuses is never reported OK. It says what it did not read (the experts).
#[test]
fn doctor_without_verify_finds_a_flipped_spine_byte_and_says_what_it_did_not_read() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    ok(&mut setup_cmd(&fixture(), &store, &[]));
    let out = bin().args(["doctor", "--model"]).arg(&store).output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && said.contains("spine tensors verified") && said.contains("not read (--verify"), "{said}");
    let spine = store.join("spine.bin");
    flip(&spine, std::fs::metadata(&spine).unwrap().len() / 2);
    let err = fails(bin().args(["doctor", "--model"]).arg(&store));
    assert!(err.contains("spine tensor") && err.contains("checksum"), "{err}");
    fails(&mut run_ids(&store));
}
