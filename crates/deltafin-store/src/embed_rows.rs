//! The embedding table read by row instead of held (K3's is 2.35 GB and a token needs one 14 KB
//! row). Opening reads the table once, in chunks, checking it whole against the manifest's
//! checksum while taking a checksum of every row (8 bytes a row, 1.3 MB for K3); each row read
//! later is checked against its own, so no byte computed with goes unchecked.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use crate::checksum::{xxh3_64, Xxh3};

use crate::error::{Error, Result};

/// Rows of one BF16 table in a file, each checked as it is read.
pub struct RowReader {
    name: String,
    path: PathBuf,
    file: File,
    offset: u64,
    row_bytes: usize,
    sums: Vec<u64>,
}

impl RowReader {
    /// Opens tensor `name` (`rows` rows of `row_bytes` at `offset` of `path`), checking it whole
    /// against `xxh3` (hex) while taking each row's checksum. `advice` says what to do if it is
    /// damaged.
    pub(crate) fn open(
        name: &str,
        path: PathBuf,
        offset: u64,
        rows: usize,
        row_bytes: usize,
        xxh3: &str,
        advice: String,
    ) -> Result<RowReader> {
        let file = File::open(&path).map_err(Error::io(&path))?;
        let mut whole = Xxh3::new();
        let mut sums = Vec::with_capacity(rows);
        let chunk_rows = ((8 << 20) / row_bytes.max(1)).max(1);
        let mut buf = vec![0u8; chunk_rows * row_bytes];
        let mut r = 0;
        while r < rows {
            let n = chunk_rows.min(rows - r);
            let b = &mut buf[..n * row_bytes];
            file.read_exact_at(b, offset + (r * row_bytes) as u64).map_err(|e| Error::BadStore {
                path: path.clone(),
                why: format!("spine tensor `{name}` cannot be read at row {r}: {e} (truncated?)"),
                advice: advice.clone(),
            })?;
            whole.update(b);
            sums.extend(b.chunks_exact(row_bytes).map(xxh3_64));
            r += n;
        }
        crate::setup::drop_cache(&file);
        if format!("{:016x}", whole.digest()) != xxh3 {
            return Err(Error::SpineCorrupt { tensor: name.into(), path, offset, advice });
        }
        Ok(RowReader { name: name.into(), path, file, offset, row_bytes, sums })
    }

    /// Bytes held in RAM (the row checksums).
    pub fn held_bytes(&self) -> usize {
        self.sums.len() * 8
    }
}

impl deltafin_core::EmbedRows for RowReader {
    fn row(&self, r: usize) -> deltafin_core::Result<Vec<u8>> {
        let bad = |found: String| deltafin_core::Error::BadTensor {
            name: format!("{} row {r}", self.name),
            file: self.path.display().to_string(),
            expected: "the bytes checked when the model was opened".into(),
            found,
        };
        let mut v = vec![0u8; self.row_bytes];
        self.file.read_exact_at(&mut v, self.offset + (r * self.row_bytes) as u64).map_err(|e| bad(format!("a read error: {e}")))?;
        if self.sums.get(r) != Some(&xxh3_64(&v)) {
            return Err(bad("other bytes (checksum mismatch: the file changed or the drive returned bad data)".into()));
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_core::EmbedRows;

    #[test]
    fn rows_are_checked_whole_at_open_and_each_when_read() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("table");
        let table: Vec<u8> = (0..40 * 6).map(|i| (i * 7 % 251) as u8).collect();
        let mut file = vec![9u8; 16];
        file.extend_from_slice(&table);
        std::fs::write(&path, &file).unwrap();
        let sum = format!("{:016x}", xxh3_64(&table));
        let r = RowReader::open("emb", path.clone(), 16, 40, 6, &sum, "advice".into()).unwrap();
        assert_eq!(r.row(3).unwrap(), &table[18..24]);
        assert!(RowReader::open("emb", path.clone(), 16, 40, 6, "0000000000000000", "advice".into()).is_err());
        // A byte changed after opening is caught in its row, not in the others.
        file[16 + 6 * 7 + 2] ^= 1;
        std::fs::write(&path, &file).unwrap();
        let r2 = RowReader::open("emb", path.clone(), 16, 40, 6, &sum, "advice".into());
        assert!(r2.is_err(), "the whole check at open sees it");
        let e = r.row(7).unwrap_err().to_string();
        assert!(e.contains("emb row 7") && e.contains("checksum"), "{e}");
        assert_eq!(r.row(8).unwrap(), &table[48..54]);
    }
}
