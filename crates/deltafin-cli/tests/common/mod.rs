//! What the CLI's test files share: the binary, the fixture and its reference output.
#![allow(dead_code)]

pub mod server;

use std::path::PathBuf;
use std::process::Command;

/// The fixture prompt as ids, its text, and the reference implementation's 16 greedy ids.
pub const PROMPT_IDS: &str = "78,544,115,815,284,256,101,969,111,58,32,49,50,347,266,115,907,32,52,50,32,281,115,119,256,115,46";
pub const PROMPT_TEXT: &str = "Numbers matter here too: 12 boats and 42 answers.";
pub const REFERENCE_GREEDY: &str = "419,163,307,775,448,336,178,818,526,97,40,606,165,14,688,912";

/// The `deltafin` binary under test.
pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_deltafin"))
}

/// The tiny fixture checkpoint.
pub fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-k3-dev/checkpoint")
}

/// Runs a command that must succeed; returns its stdout.
pub fn ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// Runs a command that must fail cleanly (an error, not a panic); returns its stderr.
pub fn fails(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{cmd:?} succeeded: stdout {}", String::from_utf8_lossy(&out.stdout));
    assert!(!err.contains("panicked") && out.status.code() == Some(1), "{cmd:?} must fail with an error, not a panic: {err}");
    err
}

/// A test that cannot run here says so. In CI, where `.ci/run` installs what it needs (`ci_has_it`),
/// a missing client is a failure, not a pass.
pub fn skipped(why: &str, ci_has_it: bool) {
    assert!(!(ci_has_it && std::env::var_os("CI").is_some()), "{why}, but .ci/run installs it: the test must run in CI");
    eprintln!("SKIPPED: {why}; .ci/run installs it");
}

/// Whether npm is here (`.ci/run` installs the Node client only then).
pub fn has_npm() -> bool {
    Command::new("npm").arg("--version").output().is_ok_and(|o| o.status.success())
}
