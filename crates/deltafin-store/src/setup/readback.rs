//! Reading back a file setup wrote, before trusting it: every checksummed range must match and
//! every other byte must be the zero padding setup wrote, up to the length it wrote. A file that
//! passes is byte for byte what setup would write again, so a re-run may keep it.

use std::os::unix::fs::FileExt;
use std::path::Path;

use super::Progress;
use crate::manifest::{align_up, checksum};

/// Whether `path` holds exactly `ranges` (offset, length, xxh3) and zero padding, ending at the
/// last range rounded up to [`crate::ALIGN`].
pub(super) fn is_exact(path: &Path, ranges: &[(u64, u64, &str)], progress: &dyn Progress) -> bool {
    let Ok(f) = std::fs::File::open(path) else { return false };
    let mut sorted: Vec<(u64, u64, &str)> = ranges.to_vec();
    sorted.sort_unstable_by_key(|r| r.0);
    let end = align_up(sorted.last().map_or(0, |r| r.0 + r.1));
    if f.metadata().map(|m| m.len()).ok() != Some(end) {
        return false;
    }
    let mut buf = Vec::new();
    let mut at = 0u64;
    let mut good = true;
    for (off, len, sum) in sorted.into_iter().chain([(end, 0, "")]) {
        if off < at {
            good = false;
            break;
        }
        if off > at {
            buf.resize((off - at) as usize, 0);
            if f.read_exact_at(&mut buf, at).is_err() || buf.iter().any(|&b| b != 0) {
                good = false;
                break;
            }
        }
        if len > 0 {
            buf.resize(len as usize, 0);
            if f.read_exact_at(&mut buf, off).is_err() || checksum(&buf) != sum {
                good = false;
                break;
            }
            progress.advance(len);
        }
        at = off + len;
    }
    super::drop_cache(&f);
    good
}
