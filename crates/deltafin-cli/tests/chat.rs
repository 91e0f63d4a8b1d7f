//! `deltafin chat` inside a real pseudo-terminal (`chat_pty.py`, Python's standard `pty`): line
//! editing and history, unknown commands, Ctrl-C during a long prompt on `small` (stopped within
//! a second), and a conversation that outgrows the context trimmed with a notice.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

fn drive(model: &Path, scenario: &str) -> String {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/chat_pty.py");
    let out = Command::new("python3").arg(script).arg(env!("CARGO_BIN_EXE_deltafin")).arg(model).arg(scenario).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{scenario}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

#[test]
fn line_editing_history_and_unknown_commands_in_a_terminal() {
    drive(&common::fixture(), "edit");
}

#[test]
fn a_conversation_that_outgrows_the_context_drops_its_oldest_turns_with_a_notice() {
    drive(&common::fixture(), "overflow");
}

#[test]
fn ctrl_c_stops_a_long_prompt_on_small_within_a_second() {
    let tmp = tempfile::tempdir().unwrap();
    xtask::gen_k3::generate("small", 3, tmp.path()).unwrap();
    let out = drive(tmp.path(), "interrupt");
    assert!(out.contains("stopped"), "{out}");
}
