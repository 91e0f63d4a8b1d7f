//! The store's error type: every variant names the file (and tensor or expert) involved.

use std::path::PathBuf;

/// Errors raised while reading or writing model data.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O error on a named file.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// A file's contents do not parse.
    #[error("{path}: {why}")]
    Format { path: PathBuf, why: String },
    /// A tensor's bytes run past the end of its shard.
    #[error(
        "tensor `{tensor}` in {path}: the file is truncated ({have} bytes, the tensor ends at {need}); re-download or re-copy the shard"
    )]
    Truncated { tensor: String, path: PathBuf, have: u64, need: u64 },
    /// An expert's bytes do not match the checksum recorded at setup.
    #[error("expert {layer}/{expert} in {path} at offset {offset}: checksum mismatch (stored data is corrupt); run `deltafin doctor --verify` and re-run setup to repair")]
    Corrupt { layer: usize, expert: usize, path: PathBuf, offset: u64 },
    /// No working home holds a copy of the expert.
    #[error("expert {layer}/{expert}: no working drive holds it (last error: {last})")]
    Unavailable { layer: usize, expert: usize, last: String },
    /// A reader thread panicked while reading this expert (a bug): its waiters get this instead of
    /// waiting forever.
    #[error("expert {layer}/{expert}: a reader thread failed ({why}); this is a bug in deltafin, please report it")]
    ReaderFailed { layer: usize, expert: usize, why: String },
    /// The RAM budget is too small to run at all.
    #[error("RAM budget {budget} bytes is too small: this model needs at least {minimum} bytes ({why})")]
    BudgetTooSmall { budget: u64, minimum: u64, why: String },
    /// The store was built for a different model.
    #[error("store {path} belongs to another model (config hash {found}, this model {expected})")]
    WrongModel { path: PathBuf, found: String, expected: String },
    /// Model math rejected something (config, tensor shape).
    #[error(transparent)]
    Model(#[from] deltafin_core::Error),
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { path, source }
    }
    pub(crate) fn format(path: impl Into<PathBuf>, why: impl Into<String>) -> Error {
        Error::Format { path: path.into(), why: why.into() }
    }
}

/// Result alias used across the crate.
pub type Result<T> = std::result::Result<T, Error>;
