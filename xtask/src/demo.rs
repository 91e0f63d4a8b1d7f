//! `cargo xtask demo`: the README's first command. Installs the committed tiny trained K3
//! (`training/models/k3`, no download) as a store over two emulated drives (folders) and
//! generates English with a RAM budget whose expert cache holds a quarter of its experts,
//! streaming the text, drafting with the trained Qwen3 draft, and printing where the time and
//! bytes went.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("$ {}", format!("{cmd:?}").replace('"', ""));
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed");
    }
    Ok(())
}

pub fn demo(prompt: &str, max_new: usize, budget: &str) -> Result<()> {
    let root = root();
    let models = root.join("models");
    let ckpt = crate::trained::models_dir().join("k3");
    let draft = crate::trained::models_dir().join("draft");
    // Cargo's own progress shows: the first build takes minutes on two cores.
    run(crate::bench::cargo().current_dir(&root).args(["build", "--release", "-p", "deltafin-cli"]))?;
    let bin = crate::bench::target_dir().join("release/deltafin");
    let store = models.join("trained-demo-store");
    let (d0, d1) = (models.join("drive0"), models.join("drive1"));
    std::fs::create_dir_all(&d0)?;
    std::fs::create_dir_all(&d1)?;
    // The demo's store is the demo's own: one an older version made with other defaults (a
    // placement since changed) is replaced, not refused; one of this plan is resumed or checked.
    run(Command::new(&bin)
        .args(["setup", "--full", "--reinstall", "--from"])
        .arg(&ckpt)
        .arg("--out")
        .arg(&store)
        .arg("--home")
        .arg(&d0)
        .arg("--home")
        .arg(&d1))?;
    run(Command::new(&bin)
        .args(["run", "--model"])
        .arg(&store)
        .args(["--ram-budget", budget, "--max-new", &max_new.to_string(), "--context", "512", "--stats", "--prompt", prompt])
        .arg("--draft")
        .arg(&draft))?;
    eprintln!(
        "\n(a 25 MB model of K3's exact architecture trained for 7 minutes on 49 MB of books and docs: expect \
         fluent-looking, repetitive English; every token is checked by K3's exact math over streamed experts)"
    );
    Ok(())
}
