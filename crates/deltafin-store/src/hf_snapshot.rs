//! Models already in the local Hugging Face hub cache, used where they are.
//!
//! `huggingface-cli download` (and every `huggingface_hub` client) keeps a repository as
//! `HUB_CACHE/models--OWNER--NAME/` with `blobs/` (content-addressed files), `refs/REV` (the commit
//! a branch or tag pointed at) and `snapshots/COMMIT/` (the release layout, as symlinks into
//! `blobs/`). A snapshot folder is a checkpoint folder, so `run` and `setup --in-place` read it
//! directly: no second copy of 1.56 TB. This module only finds that folder and says precisely
//! what is missing when the download is incomplete; it never writes into the cache.

use std::path::{Path, PathBuf};

use deltafin_fetch::RepoRef;

use crate::error::{Error, Result};

/// The files besides the shards that a checkpoint folder must hold.
const REQUIRED: [&str; 4] = ["config.json", "model.safetensors.index.json", "tiktoken.model", "tokenizer_config.json"];

/// The hub cache folder as `huggingface_hub` finds it: `HF_HUB_CACHE`, else `HF_HOME/hub`, else
/// `XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`.
pub fn hf_hub_cache() -> PathBuf {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = var("HF_HUB_CACHE") {
        return d;
    }
    if let Some(d) = var("HF_HOME") {
        return d.join("hub");
    }
    let cache = var("XDG_CACHE_HOME").unwrap_or_else(|| var("HOME").unwrap_or_else(|| PathBuf::from(".")).join(".cache"));
    cache.join("huggingface").join("hub")
}

/// Resolves what a user gave as `--model` or `--from`: `hf://OWNER/REPO[@REV]` becomes the
/// snapshot folder in the local hub cache, a `models--OWNER--NAME` cache folder becomes its `main`
/// snapshot; anything else is returned as it is.
pub fn resolve_model_dir(given: &Path) -> Result<PathBuf> {
    let text = given.to_string_lossy();
    if text.starts_with("hf://") {
        let r = RepoRef::parse(&text)?;
        return snapshot(&hf_hub_cache(), &r);
    }
    let is_cache_repo = given.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("models--"));
    if is_cache_repo && given.join("snapshots").is_dir() {
        return snapshot_in(given, &text, "main");
    }
    Ok(given.to_path_buf())
}

/// The complete snapshot of `r` in the hub cache `cache`, or an error saying what is missing and
/// how to get it.
pub fn snapshot(cache: &Path, r: &RepoRef) -> Result<PathBuf> {
    let repo_dir = cache.join(format!("models--{}", r.repo.replace('/', "--")));
    let spec = format!("hf://{}@{}", r.repo, r.revision);
    if !repo_dir.is_dir() {
        return Err(not_cached(&spec, &r.repo, &repo_dir, "it has never been downloaded here".into()));
    }
    snapshot_in(&repo_dir, &spec, &r.revision)
}

fn snapshot_in(repo_dir: &Path, spec: &str, revision: &str) -> Result<PathBuf> {
    let repo = repo_name(repo_dir);
    let is_commit = revision.len() == 40 && revision.bytes().all(|b| b.is_ascii_hexdigit());
    let commit = if is_commit {
        revision.to_string()
    } else {
        let r = repo_dir.join("refs").join(revision);
        match std::fs::read_to_string(&r) {
            Ok(c) => c.trim().to_string(),
            Err(_) => {
                return Err(not_cached(spec, &repo, repo_dir, format!("revision `{revision}` was never downloaded (no {})", r.display())))
            }
        }
    };
    let snap = repo_dir.join("snapshots").join(&commit);
    if !snap.is_dir() {
        return Err(not_cached(spec, &repo, repo_dir, format!("no snapshot of commit {commit}")));
    }
    let mut missing: Vec<String> = REQUIRED.iter().filter(|f| !snap.join(f).exists()).map(|f| f.to_string()).collect();
    if snap.join("model.safetensors.index.json").exists() {
        let idx = snap.join("model.safetensors.index.json");
        let text = std::fs::read_to_string(&idx).map_err(Error::io(&idx))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::format(&idx, e.to_string()))?;
        let mut shards: Vec<&str> = v["weight_map"].as_object().into_iter().flat_map(|m| m.values().filter_map(|s| s.as_str())).collect();
        shards.sort_unstable();
        shards.dedup();
        // `exists` follows the symlink: a link whose blob is gone counts as missing.
        missing.extend(shards.into_iter().filter(|s| !snap.join(s).exists()).map(str::to_string));
    }
    if !missing.is_empty() {
        let n = missing.len();
        let shown: Vec<&str> = missing.iter().take(4).map(String::as_str).collect();
        let more = if n > shown.len() { format!(" and {} more", n - shown.len()) } else { String::new() };
        return Err(not_cached(
            spec,
            &repo,
            repo_dir,
            format!("the download is incomplete: {n} file(s) missing ({}{more})", shown.join(", ")),
        ));
    }
    Ok(snap)
}

/// `OWNER/NAME` from a `models--OWNER--NAME` folder.
fn repo_name(repo_dir: &Path) -> String {
    let n = repo_dir.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    n.strip_prefix("models--").unwrap_or(n).replacen("--", "/", 1)
}

fn not_cached(spec: &str, repo: &str, looked: &Path, why: String) -> Error {
    Error::NotInHfCache {
        spec: spec.to_string(),
        looked: looked.to_path_buf(),
        why,
        advice: format!(
            "download it with `huggingface-cli download {repo}` (set HF_HUB_CACHE or HF_HOME if your cache is elsewhere), or install it from the hub with `deltafin setup --stream --from hf://{repo} --out STORE`"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_repo(cache: &Path, commit: &str, files: &[&str]) -> PathBuf {
        let repo = cache.join("models--o--r");
        let snap = repo.join("snapshots").join(commit);
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::create_dir_all(repo.join("blobs")).unwrap();
        std::fs::write(repo.join("refs/main"), commit).unwrap();
        for f in files {
            let blob = repo.join("blobs").join(format!("b-{f}"));
            let body =
                if *f == "model.safetensors.index.json" { r#"{"weight_map":{"a":"s1.safetensors","b":"s2.safetensors"}}"# } else { "x" };
            std::fs::write(&blob, body).unwrap();
            std::os::unix::fs::symlink(Path::new("../../blobs").join(format!("b-{f}")), snap.join(f)).unwrap();
        }
        repo
    }

    const C: &str = "0123456789abcdef0123456789abcdef01234567";
    const ALL: [&str; 6] =
        ["config.json", "model.safetensors.index.json", "tiktoken.model", "tokenizer_config.json", "s1.safetensors", "s2.safetensors"];

    #[test]
    fn finds_the_snapshot_by_branch_by_commit_and_by_repo_folder() {
        let t = tempfile::tempdir().unwrap();
        let repo = fake_repo(t.path(), C, &ALL);
        let want = repo.join("snapshots").join(C);
        let main = RepoRef::parse("hf://o/r").unwrap();
        assert_eq!(snapshot(t.path(), &main).unwrap(), want);
        assert_eq!(snapshot(t.path(), &RepoRef::parse(&format!("hf://o/r@{C}")).unwrap()).unwrap(), want);
        assert_eq!(resolve_model_dir(&repo).unwrap(), want);
        let other = Path::new("/some/checkpoint");
        assert_eq!(resolve_model_dir(other).unwrap(), other);
    }

    #[test]
    fn an_incomplete_download_names_what_is_missing() {
        let t = tempfile::tempdir().unwrap();
        let repo = fake_repo(t.path(), C, &ALL);
        // A blob deleted under its symlink (interrupted download, cache cleanup).
        std::fs::remove_file(repo.join("blobs/b-s2.safetensors")).unwrap();
        let e = snapshot(t.path(), &RepoRef::parse("hf://o/r").unwrap()).unwrap_err().to_string();
        assert!(e.contains("incomplete") && e.contains("s2.safetensors") && !e.contains("s1.safetensors"), "{e}");
        assert!(e.contains("huggingface-cli download o/r"), "{e}");
        let e = snapshot(t.path(), &RepoRef::parse("hf://o/r@v2").unwrap()).unwrap_err().to_string();
        assert!(e.contains("revision `v2`"), "{e}");
        let e = snapshot(t.path(), &RepoRef::parse("hf://o/other").unwrap()).unwrap_err().to_string();
        assert!(e.contains("never been downloaded") && e.contains("models--o--other"), "{e}");
    }
}
