//! What can go wrong talking to a hub, each saying what to do.

use std::path::PathBuf;

/// A fetch error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Offline mode (`HF_HUB_OFFLINE`) and the bytes are not here.
    #[error("{what} is not available offline (HF_HUB_OFFLINE is set); unset it to fetch, or run `deltafin warm` while online")]
    Offline { what: String },
    /// The hub answered with a status that retrying will not change.
    #[error("{url}: the hub answered {status}{}", advice(*status))]
    Status { url: String, status: u16 },
    /// The answer broke the protocol (wrong range, wrong length, no redirect target...).
    #[error("{url}: {why}")]
    Protocol { url: String, why: String },
    /// Retries ran out.
    #[error("{url}: gave up after {attempts} attempts: {last}")]
    GaveUp { url: String, attempts: u32, last: String },
    /// A downloaded file does not hash to what the hub published.
    #[error("{file}: its {algo} is {got}, the hub published {want}; the download was discarded, run the command again to refetch it")]
    HashMismatch { file: String, algo: &'static str, got: String, want: String },
    /// The repository reference cannot be parsed.
    #[error("{0}")]
    BadRef(String),
    // `err`, not `source`: the message carries the cause, and a source as well would print it
    // twice in a chain (`error: X: cause: cause`).
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
}

fn advice(status: u16) -> &'static str {
    match status {
        401 | 403 => " (not authorized: set HF_TOKEN or log in with `huggingface-cli login`, and accept the model's terms on its page)",
        404 => " (not found: check the repository name and revision)",
        _ => "",
    }
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |err| Error::Io { path, err }
    }
}

/// Results of this crate.
pub type Result<T> = std::result::Result<T, Error>;
