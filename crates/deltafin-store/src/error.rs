//! The store's error type: every variant names the file (and tensor or expert) involved.

use std::path::PathBuf;

/// Errors raised while reading or writing model data.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O error on a named file.
    // `err`, not `source`: the message carries the cause, and a source as well would print it
    // twice in a chain (`error: X: cause: cause`).
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    /// A file's contents do not parse.
    #[error("{path}: {why}")]
    Format { path: PathBuf, why: String },
    /// A tensor's bytes run past the end of its shard.
    #[error(
        "tensor `{tensor}` in {path}: the file is truncated ({have} bytes, the tensor ends at {need}); re-download or re-copy the shard"
    )]
    Truncated { tensor: String, path: PathBuf, have: u64, need: u64 },
    /// An expert's bytes do not match the checksum recorded at setup.
    #[error("expert {layer}/{expert} in {path} at offset {offset}: checksum mismatch (stored data is corrupt); {advice}")]
    Corrupt { layer: usize, expert: usize, path: PathBuf, offset: u64, advice: String },
    /// A spine tensor's bytes do not match the checksum recorded at setup.
    #[error("spine tensor `{tensor}` in {path} at offset {offset}: checksum mismatch (stored data is corrupt); {advice}")]
    SpineCorrupt { tensor: String, path: PathBuf, offset: u64, advice: String },
    /// A store file (manifest, config, tokenizer, spine file) is missing, changed or malformed.
    #[error("{path}: {why}; {advice}")]
    BadStore { path: PathBuf, why: String, advice: String },
    /// The checkpoint being installed is not the one the store (or a half-finished setup) holds,
    /// or was set up with other arguments.
    #[error("{path}: {why}")]
    OtherCheckpoint { path: PathBuf, why: String },
    /// The checkpoint's bytes differ from what an earlier setup recorded for them.
    #[error("{path}: {why}; the checkpoint changed since this store was set up: restore its original files, or install it as it is now with `--reinstall`")]
    SourceChanged { path: PathBuf, why: String },
    /// Another process holds the setup lock.
    #[error("{path} is locked by {holder}: another `deltafin setup` is writing there; wait for it to finish or stop it")]
    Locked { path: PathBuf, holder: String },
    /// Not enough free space for what setup must write.
    #[error("not enough free space for setup on {path}: it needs {need} more bytes ({need_gb:.2} GB), {free} bytes ({free_gb:.2} GB) are free; free some space or choose other --home/--out folders", need_gb = *.need as f64 / 1e9, free_gb = *.free as f64 / 1e9)]
    NoSpace { path: PathBuf, need: u64, free: u64 },
    /// No working home holds a copy of the expert.
    #[error("expert {layer}/{expert}: no working drive holds it (last error: {last})")]
    Unavailable { layer: usize, expert: usize, last: String },
    /// A reader thread panicked while reading this expert (a bug): its waiters get this instead of
    /// waiting forever.
    #[error("expert {layer}/{expert}: a reader thread failed ({why}); this is a bug in deltafin, please report it")]
    ReaderFailed { layer: usize, expert: usize, why: String },
    /// The RAM budget is too small to run at all.
    #[error(
        "RAM budget {budget} bytes ({}) is too small: this model needs at least {minimum} bytes ({}: {why}); try --ram-budget {}",
        human(*.budget), human(*.minimum), suggest(*.minimum)
    )]
    BudgetTooSmall { budget: u64, minimum: u64, why: String },
    /// A `hf://` model asked for in the local Hugging Face cache is not there (or incomplete).
    #[error("{spec} is not in the Hugging Face cache at {looked}: {why}; {advice}")]
    NotInHfCache { spec: String, looked: PathBuf, why: String, advice: String },
    /// Bytes of a stream store's shard did not match the hub's SHA-256 and were repaired from a
    /// fresh fetch that did: the run that met them may have computed with the wrong bytes.
    #[error(
        "{path}: {} did not match the SHA-256 the hub publishes for shard {shard} (corrupted in transit); fetched again and repaired, so run again: this run may have computed with the wrong bytes",
        parts.join(", ")
    )]
    Repaired { shard: String, parts: Vec<String>, path: PathBuf },
    /// The hub could not give what a stream store needs.
    #[error(transparent)]
    Fetch(#[from] deltafin_fetch::Error),
    /// Model math rejected something (config, tensor shape).
    #[error(transparent)]
    Model(#[from] deltafin_core::Error),
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |err| Error::Io { path, err }
    }
    pub(crate) fn format(path: impl Into<PathBuf>, why: impl Into<String>) -> Error {
        Error::Format { path: path.into(), why: why.into() }
    }
}

/// What an error caused by this process running out of file handles says (it is neither the
/// drive's fault nor damage to the store).
pub(crate) const OUT_OF_HANDLES: &str = "the process has no file handle left";

/// A hint for an I/O error whose cause is not the file: running out of file handles.
pub(crate) fn io_hint(e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(23) | Some(24) => format!(" ({OUT_OF_HANDLES}: raise its limit with `ulimit -n`; the drive and the store are fine)"),
        _ => String::new(),
    }
}

/// Result alias used across the crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Bytes as MB or GB, for people.
fn human(b: u64) -> String {
    if b >= 1_000_000_000 {
        format!("{:.2} GB", b as f64 / 1e9)
    } else {
        format!("{:.1} MB", b as f64 / 1e6)
    }
}

/// A `--ram-budget` value at or just above `minimum`: whole megabytes below a gigabyte, else
/// tenths of a gigabyte, rounded up.
fn suggest(minimum: u64) -> String {
    if minimum < 1_000_000_000 {
        format!("{}M", minimum.div_ceil(1_000_000))
    } else {
        format!("{:.1}G", minimum.div_ceil(100_000_000) as f64 / 10.0)
    }
}
