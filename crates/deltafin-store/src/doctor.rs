//! `deltafin doctor`: checks a store against its manifest: every file present, no expert
//! truncated, and with `verify` every expert's bytes against its checksum.

use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::error::Result;
use crate::manifest::{checksum, Manifest};
use crate::setup::Progress;

/// What doctor found.
#[derive(Debug, Default)]
pub struct DoctorReport {
    pub experts_checked: usize,
    pub copies_checked: usize,
    /// One line per problem, naming the expert and the file.
    pub problems: Vec<String>,
}

impl DoctorReport {
    /// No problem found.
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Checks the store at `dir`; `verify` also reads every expert and compares checksums.
pub fn doctor(dir: &Path, verify: bool, progress: &dyn Progress) -> Result<DoctorReport> {
    let mut r = DoctorReport::default();
    let m = match Manifest::read(dir) {
        Ok(m) => m,
        Err(e) => {
            r.problems.push(e.to_string());
            return Ok(r);
        }
    };
    match std::fs::read(dir.join("config.json")) {
        Ok(c) if checksum(&c) == m.model_hash => {}
        Ok(_) => r.problems.push(format!("{}: config.json belongs to another model than this store's manifest", dir.display())),
        Err(e) => r.problems.push(format!("{}: {e}", dir.join("config.json").display())),
    }
    let spine = dir.join(&m.spine_file);
    match std::fs::metadata(&spine) {
        Ok(md) if md.len() == m.spine_bytes => {}
        Ok(md) => r.problems.push(format!("{}: {} bytes, expected {} (truncated)", spine.display(), md.len(), m.spine_bytes)),
        Err(e) => r.problems.push(format!("{}: {e}", spine.display())),
    }
    let total: u64 = m.experts.iter().map(|e| e.len * e.copies.len() as u64).sum();
    progress.begin(if verify { "verify" } else { "check" }, total);
    let mut buf = Vec::new();
    for e in &m.experts {
        r.experts_checked += 1;
        for c in &e.copies {
            r.copies_checked += 1;
            let path = m.copy_path(c);
            let name = format!("expert {}/{} in {} at offset {}", e.layer, e.expert, path.display(), c.offset);
            match std::fs::File::open(&path) {
                Err(err) => r.problems.push(format!("{name}: missing ({err})")),
                Ok(f) => {
                    let len = f.metadata().map(|md| md.len()).unwrap_or(0);
                    if len < c.offset + e.len {
                        r.problems.push(format!("{name}: truncated (file is {len} bytes)"));
                    } else if verify {
                        buf.resize(e.len as usize, 0);
                        match f.read_exact_at(&mut buf, c.offset) {
                            Err(err) => r.problems.push(format!("{name}: unreadable ({err})")),
                            Ok(()) if checksum(&buf) != e.xxh3 => r.problems.push(format!("{name}: corrupt (checksum mismatch)")),
                            Ok(()) => {}
                        }
                    }
                }
            }
            progress.advance(e.len);
        }
    }
    progress.end();
    Ok(r)
}
