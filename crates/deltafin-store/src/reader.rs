//! One read per expert, straight from a drive into an aligned buffer, bypassing the page cache
//! (`O_DIRECT` on Linux, `F_NOCACHE` on macOS) unless told otherwise.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::memory::BUF_ALIGN;

/// How reads touch the page cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheMode {
    /// Bypass it: the engine's own cache is the only copy in RAM.
    Direct,
    /// Go through it (for file systems without direct I/O, or comparison).
    Buffered,
}

/// Opens `path` for reading in `mode`. Direct I/O that the file system refuses falls back to
/// buffered reads (tmpfs, some network mounts), reported by the returned flag.
pub fn open_for_read(path: &Path, mode: CacheMode) -> std::io::Result<(File, bool)> {
    if mode == CacheMode::Direct {
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::fs::OpenOptionsExt;
            match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path) {
                Ok(f) => return Ok((f, true)),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                Err(e) => return Err(e),
            }
        }
        #[cfg(target_os = "macos")]
        {
            use std::os::fd::AsRawFd;
            let f = File::open(path)?;
            // SAFETY: fcntl on a valid descriptor.
            unsafe { libc::fcntl(f.as_raw_fd(), libc::F_NOCACHE, 1) };
            return Ok((f, true));
        }
    }
    Ok((File::open(path)?, false))
}

/// The aligned window `[start, end)` that covers `[offset, offset + len)`.
pub fn aligned_window(offset: u64, len: u64) -> (u64, u64) {
    let a = BUF_ALIGN as u64;
    (offset / a * a, (offset + len).div_ceil(a) * a)
}

/// Reads `[offset, offset + len)` of `file` into `buf` (which covers the aligned window) and
/// returns where the wanted bytes start in `buf`. A file that ends early is an error.
pub fn read_aligned(file: &File, offset: u64, len: u64, buf: &mut [u8]) -> std::io::Result<usize> {
    let (start, end) = aligned_window(offset, len);
    let want = (offset + len - start) as usize;
    let buf = &mut buf[..(end - start) as usize];
    let mut got = 0usize;
    while got < want {
        // Read whole aligned blocks: the tail past EOF is simply not filled.
        let n = file.read_at(&mut buf[got..], start + got as u64)?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("file ends at {} but the bytes read end at {}", start + got as u64, offset + len),
            ));
        }
        got += n;
    }
    Ok((offset - start) as usize)
}
