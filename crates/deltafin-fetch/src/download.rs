//! Whole files with resume: the bytes go to `NAME.partial` in 64 MiB ranges (a re-run continues
//! from what is there), the result is checked against the hash the hub published, and only then
//! renamed to its final name. A mismatch deletes the partial file, so the next run starts clean.

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::hub::{Hub, Priority, RemoteFile};

/// Bytes per range request of a download (what the hub serves without complaint).
const DOWNLOAD_CHUNK: u64 = 64 << 20;

/// Told how a download advances.
pub trait DownloadProgress {
    /// `bytes` more are on disk.
    fn advance(&self, bytes: u64);
}

impl DownloadProgress for () {
    fn advance(&self, _: u64) {}
}

/// SHA-256 of a file, hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    hash_file::<sha2::Sha256>(path, None)
}

/// `D` over an optional prefix and the file's bytes, hex.
fn hash_file<D: sha1::Digest>(path: &Path, prefix: Option<&[u8]>) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(Error::io(path))?;
    let mut h = D::new();
    if let Some(p) = prefix {
        h.update(p);
    }
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(Error::io(path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Checks `path` against what the hub published for `file` (its size, and its SHA-256 or git
/// blob id); `Ok(false)` on a mismatch.
pub(crate) fn matches(path: &Path, file: &RemoteFile) -> Result<Option<(String, &'static str, String)>> {
    let len = std::fs::metadata(path).map_err(Error::io(path))?.len();
    if len != file.size {
        return Ok(Some((format!("{len} bytes"), "size", format!("{} bytes", file.size))));
    }
    if let Some(want) = &file.sha256 {
        let got = hash_file::<sha2::Sha256>(path, None)?;
        return Ok((got != want.to_ascii_lowercase()).then(|| (got, "SHA-256", want.clone())));
    }
    if let Some(want) = &file.git_oid {
        let got = hash_file::<sha1::Sha1>(path, Some(format!("blob {len}\0").as_bytes()))?;
        return Ok((got != want.to_ascii_lowercase()).then(|| (got, "git blob id", want.clone())));
    }
    Ok(None)
}

impl Hub {
    /// Whether `dest` already holds `file` exactly as the hub published it.
    pub fn is_downloaded(&self, file: &RemoteFile, dest: &Path) -> Result<bool> {
        Ok(dest.exists() && matches(dest, file)?.is_none())
    }

    /// Fetches `file` to `dest` (see the module doc); `progress` hears of every byte written,
    /// including those an earlier run left.
    pub fn download(&self, file: &RemoteFile, dest: &Path, progress: &dyn DownloadProgress) -> Result<()> {
        let partial = PathBuf::from(format!("{}.partial", dest.display()));
        let mut out = OpenOptions::new().create(true).append(true).open(&partial).map_err(Error::io(&partial))?;
        let mut have = out.metadata().map_err(Error::io(&partial))?.len();
        if have > file.size {
            out.set_len(0).map_err(Error::io(&partial))?;
            have = 0;
        }
        progress.advance(have);
        let mut buf = Vec::new();
        while have < file.size {
            let n = DOWNLOAD_CHUNK.min(file.size - have);
            buf.resize(n as usize, 0);
            self.fetch_range(&file.path, have, &mut buf, Priority::Demand)?;
            out.write_all(&buf).map_err(Error::io(&partial))?;
            have += n;
            progress.advance(n);
        }
        out.sync_all().map_err(Error::io(&partial))?;
        drop(out);
        if let Some((got, algo, want)) = matches(&partial, file)? {
            let _ = std::fs::remove_file(&partial);
            return Err(Error::HashMismatch { file: file.path.clone(), algo, got, want });
        }
        std::fs::rename(&partial, dest).map_err(Error::io(dest))?;
        if let Some(dir) = dest.parent() {
            std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(Error::io(dir))?;
        }
        Ok(())
    }
}
