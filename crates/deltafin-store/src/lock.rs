//! Setup's lock on a folder: one writer at a time, and the second one is told who holds it.
//!
//! An advisory `flock` on `FOLDER/.deltafin-lock`, which holds the owner's pid while it is
//! locked. The kernel drops the lock when its process dies, so a crashed setup never leaves a
//! stale lock behind; the file itself stays (emptied on a clean release).

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Name of the lock file in a locked folder.
pub const LOCK_FILE: &str = ".deltafin-lock";

/// A held lock; released on drop.
pub struct DirLock {
    file: File,
    path: PathBuf,
}

impl DirLock {
    /// Takes the lock on `dir` (which must exist) or says which process holds it.
    pub fn acquire(dir: &Path) -> Result<DirLock> {
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(Error::io(&path))?;
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(Error::Io { path, err });
            }
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = match holder.trim() {
                "" => "another process".to_string(),
                h => h.to_string(),
            };
            return Err(Error::Locked { path: dir.to_path_buf(), holder });
        }
        let me = format!("process {} (deltafin setup)", std::process::id());
        let wrote = file.set_len(0).and_then(|_| file.rewind()).and_then(|_| file.write_all(me.as_bytes()));
        wrote.map_err(Error::io(&path))?;
        Ok(DirLock { file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // Emptied so a finished store's files do not depend on which process made them; the
        // lock itself goes with the descriptor.
        let _ = self.file.set_len(0);
    }
}
