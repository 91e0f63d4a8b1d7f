//! Tidy: the architecture's invariants and the style rules, checked with the suite.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            if !p.ends_with("target") && !p.ends_with("models") && !p.ends_with(".git") {
                rust_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn sources(sub: &str) -> Vec<(PathBuf, String)> {
    let mut files = Vec::new();
    rust_files(&root().join(sub), &mut files);
    files.into_iter().map(|p| (p.clone(), std::fs::read_to_string(&p).unwrap())).collect()
}

#[test]
fn every_rust_file_opens_with_a_module_doc_and_stays_short() {
    let mut bad = Vec::new();
    for sub in ["crates", "xtask", "examples"] {
        for (p, text) in sources(sub) {
            let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
            if !first.starts_with("//!") {
                bad.push(format!("{}: does not start with a `//!` doc", p.display()));
            }
            if text.lines().count() > 800 {
                bad.push(format!("{}: {} lines (keep files under ~800)", p.display(), text.lines().count()));
            }
            for (i, l) in text.lines().enumerate() {
                let banned = [concat!("dbg", "!("), concat!("todo", "!("), concat!("unimplemented", "!(")];
                if banned.iter().any(|b| l.contains(b)) {
                    bad.push(format!("{}:{}: stray debugging or unfinished code", p.display(), i + 1));
                }
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

fn non_test_sources(krate: &str) -> Vec<(PathBuf, String)> {
    sources(&format!("crates/{krate}/src"))
        .into_iter()
        .filter(|(p, _)| !p.ends_with("tests.rs") && !p.to_string_lossy().contains("/tests/"))
        // A file's own `#[cfg(test)] mod tests` at its end is test code too.
        .map(|(p, text)| match text.find("#[cfg(test)]\nmod tests") {
            Some(at) => (p, text[..at].to_string()),
            None => (p, text),
        })
        .collect()
}

#[test]
fn crate_boundaries_hold() {
    let mut bad = Vec::new();
    // deltafin-core: pure computation, no file or network I/O.
    for (p, text) in non_test_sources("deltafin-core") {
        for needle in ["std::fs", "File::", "std::net", "memmap2", "OpenOptions"] {
            if text.contains(needle) {
                bad.push(format!("{}: deltafin-core does no I/O but mentions {needle}", p.display()));
            }
        }
    }
    // deltafin-core computes with no libm function: its `exp` and `tanh` (`math/transcendental.rs`)
    // give the same bits on every platform and in vectorized loops; square roots and divisions
    // are IEEE operations, correctly rounded everywhere.
    for (p, text) in non_test_sources("deltafin-core") {
        for (i, l) in text.lines().enumerate() {
            let code = l.split("//").next().unwrap_or("");
            for call in
                [".exp()", ".exp_m1()", ".tanh()", ".ln()", ".ln_1p()", ".log2()", ".powf(", ".sin()", ".cos()", ".sin_cos()", ".exp2()"]
            {
                if code.contains(call) {
                    bad.push(format!("{}:{}: deltafin-core calls libm `{call}`: use crate::math's own", p.display(), i + 1));
                }
            }
        }
    }
    // deltafin-sched: decides order, never touches files itself (the store does).
    for (p, text) in non_test_sources("deltafin-sched") {
        for needle in ["std::fs", "File::", "OpenOptions", "std::net"] {
            if text.contains(needle) {
                bad.push(format!("{}: deltafin-sched must leave file access to deltafin-store ({needle})", p.display()));
            }
        }
    }
    // deltafin-store: no half-written file under a final name, no rename without a directory
    // sync: files are created under temporary names and renamed only by `rename_synced`.
    for (p, text) in non_test_sources("deltafin-store") {
        for (i, l) in text.lines().enumerate() {
            if (l.contains("File::create(") || l.contains("std::fs::write(")) && !l.contains("tmp") {
                bad.push(format!("{}:{}: deltafin-store writes a file that is not a temporary (write_atomic)", p.display(), i + 1));
            }
            if l.contains("std::fs::rename(") && !p.ends_with("manifest.rs") {
                bad.push(format!("{}:{}: rename through manifest::rename_synced (it syncs the directory)", p.display(), i + 1));
            }
        }
    }
    // Only the server knows HTTP.
    for krate in ["deltafin", "deltafin-core", "deltafin-store", "deltafin-sched", "deltafin-spec", "deltafin-cli", "deltafin-fetch"] {
        let manifest = std::fs::read_to_string(root().join(format!("crates/{krate}/Cargo.toml"))).unwrap();
        for dep in ["axum", "hyper", "tokio"] {
            if manifest
                .lines()
                .any(|l| l.starts_with(&format!("{dep} ")) || l.starts_with(&format!("{dep}.")) || l.starts_with(&format!("{dep}=")))
            {
                bad.push(format!("{krate} depends on {dep}: only deltafin-server speaks HTTP"));
            }
        }
    }
    // Only deltafin-fetch makes outgoing HTTP.
    for krate in ["deltafin", "deltafin-core", "deltafin-store", "deltafin-sched", "deltafin-spec", "deltafin-cli", "deltafin-server"] {
        let manifest = std::fs::read_to_string(root().join(format!("crates/{krate}/Cargo.toml"))).unwrap();
        let deps = manifest.split("[dependencies]").nth(1).unwrap_or("").split("\n[").next().unwrap_or("");
        for client in ["ureq", "reqwest", "hyper-util", "isahc", "curl", "attohttpc"] {
            if deps.lines().any(|l| {
                let named =
                    l.starts_with(&format!("{client} ")) || l.starts_with(&format!("{client}.")) || l.starts_with(&format!("{client}="));
                // hyper-util's server half is the server's to use (connections with a header
                // deadline); its client half is not.
                let server_half = krate == "deltafin-server" && client == "hyper-util" && !l.contains("client");
                named && !server_half
            }) {
                bad.push(format!("{krate} depends on {client}: only deltafin-fetch makes outgoing HTTP"));
            }
        }
    }
    // Front ends (the CLI, the server, the examples) use the `deltafin` facade, nothing beneath.
    for manifest in ["crates/deltafin-cli/Cargo.toml", "crates/deltafin-server/Cargo.toml", "examples/Cargo.toml"] {
        let text = std::fs::read_to_string(root().join(manifest)).unwrap();
        let deps = text.split("[dependencies]").nth(1).unwrap_or("").split("\n[").next().unwrap_or("");
        for inner in ["deltafin-core", "deltafin-sched", "deltafin-store", "deltafin-spec"] {
            if deps.lines().any(|l| l.starts_with(inner)) {
                bad.push(format!("{manifest} depends on {inner}: front ends use the `deltafin` crate"));
            }
        }
    }
    // Wire formats live at the edges (the CLI's --stats-json, the server's JSON), not in the
    // engine: it does not even depend on serde.
    let sched = std::fs::read_to_string(root().join("crates/deltafin-sched/Cargo.toml")).unwrap();
    let sched_deps = sched.split("[dependencies]").nth(1).unwrap_or("").split("\n[").next().unwrap_or("");
    if sched_deps.lines().any(|l| l.starts_with("serde")) {
        bad.push("deltafin-sched depends on serde: serializable formats belong to the CLI and the server".into());
    }
    // The facade documents everything it adds.
    if !std::fs::read_to_string(root().join("crates/deltafin/src/lib.rs")).unwrap().contains("#![deny(missing_docs)]") {
        bad.push("crates/deltafin must #![deny(missing_docs)]".into());
    }
    // Library crates use their own error enums; anyhow only in binaries and xtask.
    // Constrained decoding: llguidance in deltafin-grammar alone, which does no I/O of its own.
    for e in std::fs::read_dir(root().join("crates")).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        let manifest = std::fs::read_to_string(root().join(format!("crates/{name}/Cargo.toml"))).unwrap();
        if name != "deltafin-grammar" && manifest.contains("llguidance") {
            bad.push(format!("{name} depends on llguidance: grammars belong to deltafin-grammar"));
        }
        if name == "deltafin-grammar" && ["deltafin-store", "deltafin-fetch", "deltafin-server"].iter().any(|d| manifest.contains(d)) {
            bad.push("deltafin-grammar depends on a crate that does I/O".into());
        }
    }
    for krate in ["deltafin", "deltafin-core", "deltafin-store", "deltafin-sched", "deltafin-spec", "deltafin-server", "deltafin-grammar"] {
        let manifest = std::fs::read_to_string(root().join(format!("crates/{krate}/Cargo.toml"))).unwrap();
        let deps = manifest.split("[dependencies]").nth(1).unwrap_or("").split("\n[").next().unwrap_or("");
        if deps.lines().any(|l| l.starts_with("anyhow")) {
            bad.push(format!("{krate} is a library and must not depend on anyhow"));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn manifests_and_docs_cover_every_crate() {
    let arch = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let ci = std::fs::read_to_string(root().join(".ci/run")).unwrap();
    let mut bad = Vec::new();
    for e in std::fs::read_dir(root().join("crates")).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        if !arch.contains(&format!("`{name}`")) {
            bad.push(format!("ARCHITECTURE.md does not describe `{name}`"));
        }
        let manifest = std::fs::read_to_string(root().join(format!("crates/{name}/Cargo.toml"))).unwrap();
        for key in ["version.workspace = true", "publish.workspace = true", "[lints]"] {
            if !manifest.contains(key) {
                bad.push(format!("crates/{name}/Cargo.toml lacks `{key}`"));
            }
        }
    }
    // The README's test command is the one CI runs.
    let test_cmd = readme.lines().find(|l| l.starts_with("cargo test")).expect("README shows a `cargo test` command");
    if !ci.contains(test_cmd.trim()) {
        bad.push(format!(".ci/run does not run the README's test command `{test_cmd}`"));
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
