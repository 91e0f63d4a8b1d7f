//! Stamps the binary with the commit it was built from (`deltafin --version`), and notes which of
//! the clients the server tests drive are installed, so cargo reports the tests of a missing one
//! as ignored (with what to install) instead of passing them. In CI (`.ci/run` installs every
//! client) the tests run regardless and fail if one is missing.

/// Whether `program args...` runs and succeeds.
fn runs(program: &str, args: &[&str]) -> bool {
    std::process::Command::new(program)
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn clients() {
    let ci = std::env::var_os("CI").is_some();
    let manifest = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let node_client = manifest.join("tests/node/node_modules/openai/package.json");
    for (cfg, present) in [
        ("has_py_openai", ci || runs("python3", &["-c", "import openai"])),
        ("has_py_langchain", ci || runs("python3", &["-c", "import langchain_openai"])),
        ("has_node_openai", ci || (node_client.exists() && runs("node", &["--version"]))),
        ("has_chromium", ci || (runs("chromedriver", &["--version"]) && std::path::Path::new("/usr/bin/chromium").exists())),
    ] {
        println!("cargo:rustc-check-cfg=cfg({cfg})");
        if present {
            println!("cargo:rustc-cfg={cfg}");
        }
    }
    // Checked again when the Node client is installed or removed, or CI changes; a Python
    // package installed later needs `touch crates/deltafin-cli/build.rs` (the tests say so).
    // (the folder, not node_modules: a path that does not exist would rerun this on every build)
    println!("cargo:rerun-if-changed={}", manifest.join("tests/node").display());
    println!("cargo:rerun-if-env-changed=CI");
}

fn main() {
    clients();
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown commit".into());
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    println!("cargo:rustc-env=DELTAFIN_COMMIT={commit}{}", if dirty { ", modified" } else { "" });
    // Rebuilt when HEAD moves (a commit, a checkout), not on every build.
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        println!("cargo:rerun-if-changed={dir}/HEAD");
        println!("cargo:rerun-if-changed={dir}/index");
        if let Some(head) = git(&["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={dir}/{head}");
        }
    }
}
