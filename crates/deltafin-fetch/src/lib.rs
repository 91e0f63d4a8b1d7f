//! The one place Deltafin makes outgoing HTTP: files and byte ranges of a model repository on a
//! Hugging Face hub (or anything that speaks its URL layout), with every answer checked exactly.
//!
//! - [`HubConfig`] follows the hub's conventions: `HF_ENDPOINT`, `HF_TOKEN` or the token file,
//!   `HF_HUB_OFFLINE`.
//! - [`Hub`] pins a revision to a commit id and lists the repository's files with their sizes and
//!   published hashes (the LFS SHA-256 of large files, the git blob id of small ones).
//! - [`Hub::fetch_range`] reads one byte range: redirects followed by hand and the signed URL
//!   they end at reused until it expires, a few keep-alive connections, demand requests ahead of
//!   background ones, retries with backoff and jitter, `Retry-After` honoured, stalls cut off and
//!   resumed where the body stopped, and an exact `206`, `Content-Range` and length demanded.
//! - [`Hub::download`] fetches a whole file with resume, checks its published hash, and only
//!   then gives it its final name.
//!
//! What it never does: write anywhere but the one file [`Hub::download`] is asked for, or decide
//! what to fetch (the store does).

mod download;
mod error;
mod hub;
mod range;

pub use crate::{
    download::{sha256_file, DownloadProgress},
    error::{Error, Result},
    hub::{Hub, HubConfig, Priority, RemoteFile, RepoRef},
    range::{RetryPolicy, SPLIT_MIN},
};
