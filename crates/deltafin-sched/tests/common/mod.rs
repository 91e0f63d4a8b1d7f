//! What the engine's test files share: the fixture, a two-drive store of it, and the smallest
//! budget a store opens with.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use deltafin_sched::EngineBuilder;

/// The tiny fixture checkpoint.
pub fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-k3-dev/checkpoint")
}

/// The fixture installed over two drives under `dir`.
pub fn two_drive_store(dir: &Path) -> PathBuf {
    let out = dir.join("store");
    let homes = vec![dir.join("d0"), dir.join("d1")];
    deltafin_store::setup(&deltafin_store::SetupOptions::new(fixture(), &out).homes(homes), &deltafin_store::NoProgress).unwrap();
    out
}

/// The least RAM budget `store` opens with for `sequences` sequences, read from the error a
/// 1-byte budget gives (which must name that many sequences).
pub fn min_budget(store: &Path, sequences: usize) -> u64 {
    let e = EngineBuilder::new(store).max_sequences(sequences).ram_budget(Some(1)).open().err().unwrap().to_string();
    assert!(e.contains(&format!("{sequences} sequence(s)")), "{e}");
    let at = e.find("at least ").unwrap() + "at least ".len();
    e[at..].split_whitespace().next().unwrap().parse::<u64>().unwrap()
}
