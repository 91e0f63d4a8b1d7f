//! Which checkpoint is which: a fingerprint of a checkpoint folder, taken before setup reads it.
//!
//! Two checkpoints can share a config and differ in every weight (fine-tunes, re-releases,
//! another seed of `gen-k3`), so the config alone cannot name one. The fingerprint covers the
//! small files (config, tokenizer), and for each shard its name, size, safetensors header and
//! content: all of it for shards up to [`WHOLE_SHARD_MAX`], else [`SAMPLES`] blocks spread over
//! the file (a full read of a 1.5 TB checkpoint just to name it would take longer than setup's
//! own copy). Setup then records a checksum of every byte it installs, and compares them with
//! what an earlier, interrupted run recorded, so a changed checkpoint that the samples miss is
//! still caught wherever setup reads it again.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;

use crate::checksum::Xxh3Wide;

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::manifest::STORE_FILES;
use crate::setup::Progress;

/// Shards up to this size are hashed whole.
pub const WHOLE_SHARD_MAX: u64 = 256 << 20;
/// Blocks sampled from a larger shard.
pub const SAMPLES: u64 = 64;
/// Bytes per sampled block.
pub const SAMPLE_BYTES: u64 = 64 << 10;

/// The fingerprint of `ckpt`'s folder: 32 hex digits.
pub fn source_id(ckpt: &Checkpoint, progress: &dyn Progress) -> Result<String> {
    let mut h = Xxh3Wide::new();
    for f in STORE_FILES {
        let p = ckpt.dir().join(f);
        match std::fs::read(&p) {
            Ok(bytes) => {
                h.update(format!("file {f} {}\n", bytes.len()).as_bytes());
                h.update(&bytes);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => h.update(format!("no {f}\n").as_bytes()),
            Err(e) => return Err(Error::Io { path: p, err: e }),
        }
    }
    let lens: Vec<u64> =
        ckpt.shards().iter().map(|p| std::fs::metadata(p).map(|m| m.len()).map_err(Error::io(p))).collect::<Result<_>>()?;
    let hashed: u64 = lens.iter().map(|&n| if n <= WHOLE_SHARD_MAX { n } else { SAMPLES * SAMPLE_BYTES }).sum();
    progress.begin("identify", hashed);
    let mut buf = vec![0u8; 1 << 20];
    for (p, &len) in ckpt.shards().iter().zip(&lens) {
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        h.update(format!("shard {name} {len}\n").as_bytes());
        let mut f = File::open(p).map_err(Error::io(p))?;
        if len <= WHOLE_SHARD_MAX {
            loop {
                let n = f.read(&mut buf).map_err(Error::io(p))?;
                if n == 0 {
                    break;
                }
                h.update(&buf[..n]);
                progress.advance(n as u64);
            }
        } else {
            // The header names every tensor, its dtype, shape and offsets.
            let mut n = [0u8; 8];
            f.read_exact_at(&mut n, 0).map_err(Error::io(p))?;
            let hlen = u64::from_le_bytes(n).min(len - 8);
            let mut header = vec![0u8; hlen as usize];
            f.read_exact_at(&mut header, 8).map_err(Error::io(p))?;
            h.update(&header);
            let block = &mut buf[..SAMPLE_BYTES as usize];
            for i in 0..SAMPLES {
                let at = i * (len - SAMPLE_BYTES) / (SAMPLES - 1);
                f.read_exact_at(block, at).map_err(Error::io(p))?;
                h.update(block);
                progress.advance(SAMPLE_BYTES);
            }
        }
        crate::setup::drop_cache(&f);
    }
    progress.end();
    Ok(format!("{:032x}", h.digest128()))
}
