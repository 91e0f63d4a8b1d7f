//! A model already in the local Hugging Face hub cache is used where it is: `run --model
//! hf://OWNER/REPO` reads the snapshot's symlinked blobs, `setup --full --in-place --from hf://...`
//! makes a store that copies none of it, and an incomplete download is a clear error naming the
//! missing files, never a half-loaded model.

mod common;

use common::*;

use std::path::{Path, PathBuf};

const COMMIT: &str = "4f1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c";

/// Lays the fixture out as `huggingface_hub` does: files in `blobs/`, the snapshot as symlinks.
fn hf_cache(root: &Path) -> PathBuf {
    let repo = root.join("hub").join("models--acme--k3-tiny");
    let snap = repo.join("snapshots").join(COMMIT);
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), COMMIT).unwrap();
    for (i, e) in std::fs::read_dir(fixture()).unwrap().enumerate() {
        let e = e.unwrap();
        if !e.file_type().unwrap().is_file() {
            continue;
        }
        let blob = format!("blob{i:04}");
        std::fs::copy(e.path(), repo.join("blobs").join(&blob)).unwrap();
        std::os::unix::fs::symlink(Path::new("../../blobs").join(&blob), snap.join(e.file_name())).unwrap();
    }
    repo
}

fn run_hf(root: &Path, model: &str, extra: &[&str]) -> std::process::Command {
    let mut c = bin();
    c.env_remove("HF_HUB_CACHE").env("HF_HOME", root).args(["run", "--model", model]);
    c.args(["--ids", PROMPT_IDS, "--max-new", "16", "--print-ids"]).args(extra);
    c
}

fn dir_bytes(d: &Path) -> u64 {
    std::fs::read_dir(d).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum()
}

#[test]
fn a_cached_model_runs_and_installs_in_place_without_a_copy() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = hf_cache(tmp.path());
    assert_eq!(ok(&mut run_hf(tmp.path(), "hf://acme/k3-tiny", &[])).trim(), REFERENCE_GREEDY);
    assert_eq!(ok(&mut run_hf(tmp.path(), &format!("hf://acme/k3-tiny@{COMMIT}"), &[])).trim(), REFERENCE_GREEDY);
    // The cache's repository folder itself works too (its `main` snapshot).
    assert_eq!(ok(&mut run_hf(tmp.path(), repo.to_str().unwrap(), &[])).trim(), REFERENCE_GREEDY);

    let store = tmp.path().join("store");
    ok(bin()
        .env("HF_HUB_CACHE", tmp.path().join("hub"))
        .args(["setup", "--full", "--in-place", "--from", "hf://acme/k3-tiny", "--out"])
        .arg(&store));
    let blobs = dir_bytes(&repo.join("blobs"));
    assert!(dir_bytes(&store) < blobs / 10, "the store copied the model: {} of {blobs} bytes", dir_bytes(&store));
    let out = ok(&mut run_hf(tmp.path(), store.to_str().unwrap(), &["--ram-budget", "32M"]));
    assert_eq!(out.trim(), REFERENCE_GREEDY);
}

#[test]
fn an_incomplete_or_missing_cached_model_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = hf_cache(tmp.path());
    // An interrupted download: one shard's blob never arrived, its link dangles.
    let snap = repo.join("snapshots").join(COMMIT);
    let shard =
        std::fs::read_dir(&snap).unwrap().map(|e| e.unwrap().path()).find(|p| p.to_string_lossy().ends_with(".safetensors")).unwrap();
    std::fs::remove_file(snap.join(std::fs::read_link(&shard).unwrap())).unwrap();
    let name = shard.file_name().unwrap().to_string_lossy().into_owned();
    for model in ["hf://acme/k3-tiny", "hf://acme/other", "hf://acme/k3-tiny@v9"] {
        let out = run_hf(tmp.path(), model, &[]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{model}: {err}");
        assert!(err.contains("not in the Hugging Face cache") && err.contains("huggingface-cli download acme/"), "{model}: {err}");
        if model == "hf://acme/k3-tiny" {
            assert!(err.contains("incomplete") && err.contains(&name), "{err}");
        }
    }
}
