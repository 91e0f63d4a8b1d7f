//! A short run of `cargo xtask fuzz-store` in the suite (the committed 500-case result is in
//! docs/store-fuzz.md): planted store faults never give silent wrong output, never panic, are
//! all reported by doctor, and the advice of each repairs the store.

#[test]
fn planted_store_faults_fail_loudly_and_repair() {
    let tmp = tempfile::tempdir().unwrap();
    xtask::fuzz_store::run_fuzz(60, 7, None, Some(tmp.path())).unwrap();
}
