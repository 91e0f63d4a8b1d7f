//! The store behind `--ram-budget` on a checkpoint folder: an in-place store (spine and experts
//! read from the checkpoint's own shards, nothing copied) kept under the Deltafin home, made on
//! first use and remade when the checkpoint changes. It holds what a budgeted run needs and a
//! bare folder lacks: the checksum of every spine tensor and expert, so every byte read is checked.

use std::path::{Path, PathBuf};

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::manifest::{Manifest, LAYOUT_IN_PLACE};
use crate::setup::{setup, ExpertLayoutKind, NoProgress, Progress, SetupOptions};

/// Where Deltafin keeps what it derives from models: `DELTAFIN_HOME`, else
/// `XDG_CACHE_HOME/deltafin`, else `~/.cache/deltafin`.
pub fn deltafin_home() -> PathBuf {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = var("DELTAFIN_HOME") {
        return d;
    }
    let cache = var("XDG_CACHE_HOME").unwrap_or_else(|| var("HOME").unwrap_or_else(|| PathBuf::from(".")).join(".cache"));
    cache.join("deltafin")
}

/// The in-place store for the checkpoint folder `ckpt`, set up first if there is none yet (an
/// earlier setup cut short resumes). Setting up reads every byte of the checkpoint once to
/// checksum it (`progress` shows it). A checkpoint whose fingerprint changed since is an error
/// saying how to check it again.
pub fn checkpoint_store(ckpt: &Path, progress: &dyn Progress) -> Result<PathBuf> {
    let dir = std::fs::canonicalize(ckpt).map_err(Error::io(ckpt))?;
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    let key = crate::checksum::xxh3_64(dir.as_os_str().as_encoded_bytes());
    let store = deltafin_home().join("in-place").join(format!("{name}-{key:016x}"));
    let fingerprint = crate::identity::source_id(&Checkpoint::open(&dir)?, &NoProgress)?;
    // A manifest exists only once a setup has finished.
    if let Ok(m) = Manifest::read(&store) {
        if m.source_id == fingerprint && m.layout == LAYOUT_IN_PLACE && m.setup.source == dir {
            return Ok(store);
        }
        // Not re-checked silently: damage that reached a sampled block would be blessed.
        return Err(Error::BadStore {
            path: dir.clone(),
            why: "the checkpoint changed since deltafin checked it for budgeted runs (its fingerprint differs)".into(),
            advice: format!(
                "restore its original files, or check it again as it is now with `deltafin setup --full --in-place --reinstall --from {} --out {}`",
                dir.display(),
                store.display()
            ),
        });
    } else {
        eprintln!(
            "deltafin: checking every byte of {} once for budgeted runs (an in-place store at {}: nothing is copied)",
            dir.display(),
            store.display()
        );
    }
    let opts = SetupOptions::new(&dir, &store).layout(ExpertLayoutKind::InPlace).reinstall(true);
    setup(&opts, progress)?;
    Ok(store)
}
