//! Free space, checked before setup writes anything: a full disk found halfway through a 1.5 TB
//! copy wastes hours. Files already in place at their final size are counted as needing nothing
//! (a resumed or repairing setup); every other file needs its full size, since its old version
//! stays until the new one is renamed over it.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::{spine::spine_file_bytes, Install, PACKS_DIR};
use crate::error::{Error, Result};

/// Bytes free to an unprivileged writer on the filesystem holding `dir`.
pub fn free_bytes(dir: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    // Fault injection for the full-disk test (a real full filesystem needs a mount).
    if let Some(n) = std::env::var("DELTAFIN_SETUP_FREE_BYTES").ok().and_then(|v| v.parse().ok()) {
        return Ok(n);
    }
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).map_err(|_| Error::format(dir, "path contains a NUL byte"))?;
    // SAFETY: statvfs writes into the struct we pass; the path is NUL-terminated.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return Err(Error::Io { path: dir.to_path_buf(), err: std::io::Error::last_os_error() });
    }
    Ok(s.f_bavail as u64 * s.f_frsize as u64)
}

/// Fails with [`Error::NoSpace`] if some filesystem lacks room for what this plan writes.
pub(super) fn check(plan: &Install) -> Result<()> {
    let cfg = plan.ckpt.config();
    let mut files: Vec<(PathBuf, u64)> = vec![(plan.out.join("spine.bin"), spine_file_bytes(plan.ckpt))];
    let len = cfg.expert_shape().total_bytes() as u64;
    for l in cfg.moe_layers() {
        for (h, b) in plan.layout.layer_bytes(l, len).into_iter().enumerate() {
            files.push((plan.homes[h].join(PACKS_DIR).join(&plan.pack_dirs[h]).join(format!("L{l:03}.pack")), b));
        }
    }
    // Needed bytes per filesystem, named by the first folder seen on it.
    let mut need: BTreeMap<u64, (PathBuf, u64)> = BTreeMap::new();
    for (path, size) in files {
        let dir = path.parent().expect("a file in a folder").to_path_buf();
        let dev = std::fs::metadata(&dir).map_err(Error::io(&dir))?.dev();
        let have = std::fs::metadata(&path).map(|m| m.len()).ok();
        let add = if have == Some(size) { 0 } else { size };
        need.entry(dev).or_insert((dir, 0)).1 += add;
    }
    for (dir, bytes) in need.into_values() {
        let free = free_bytes(&dir)?;
        if bytes > free {
            return Err(Error::NoSpace { path: dir, need: bytes, free });
        }
    }
    Ok(())
}
