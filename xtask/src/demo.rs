//! `cargo xtask demo`: the README's first command. Installs the committed tiny trained K3
//! (`training/models/k3`, no download) as a store over two emulated drives (folders) and
//! generates English with a RAM budget whose expert cache holds a quarter of its experts,
//! streaming the text and printing where the time and bytes went; then shows drafting where it
//! pays (a prompt the model continues by repeating itself, prompt lookup drafts), beside the plain
//! run of the same prompt: the same text in fewer passes over the experts.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The command as one would type it: the program's name and its arguments, paths relative to
/// the checkout (not the environment cargo's variables were cleared from).
fn shown(cmd: &Command) -> String {
    let root = root().canonicalize().unwrap_or_else(|_| root());
    let rel = |s: &std::ffi::OsStr| {
        let p = Path::new(s);
        let p = p.canonicalize().unwrap_or_else(|_| p.to_path_buf());
        p.strip_prefix(&root).map(|r| r.display().to_string()).unwrap_or_else(|_| s.to_string_lossy().into_owned())
    };
    let program = Path::new(cmd.get_program()).file_name().map_or_else(|| rel(cmd.get_program()), |n| n.to_string_lossy().into_owned());
    let args: Vec<String> = cmd
        .get_args()
        .map(|a| {
            let a = rel(a);
            if a.contains(' ') {
                format!("\"{a}\"")
            } else {
                a
            }
        })
        .collect();
    format!("{program} {}", args.join(" "))
}

fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("$ {}", shown(cmd));
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed");
    }
    Ok(())
}

pub fn demo(prompt: &str, max_new: usize, budget: &str) -> Result<()> {
    let root = root().canonicalize().unwrap_or_else(|_| root());
    let models = root.join("models");
    let ckpt = crate::trained::models_dir().join("k3");
    // Cargo's own progress shows: the first build takes minutes on two cores.
    run(crate::bench::cargo().current_dir(&root).args(["build", "--release", "-p", "deltafin-cli"]))?;
    let bin = crate::bench::target_dir().join("release/deltafin");
    let store = models.join("trained-demo-store");
    let (d0, d1) = (models.join("drive0"), models.join("drive1"));
    std::fs::create_dir_all(&d0)?;
    std::fs::create_dir_all(&d1)?;
    eprintln!("\nInstalling the model as a store over two folders that stand in for two drives (on this one disk)\n");
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
    // 1. Streaming: the experts a quarter-sized cache cannot hold are read from the drives as
    // each token routes to them (and prefetched where the next layer's routes can be guessed).
    eprintln!("\n1. Streaming: generate under a RAM budget whose expert cache holds about a quarter of the experts\n");
    run(Command::new(&bin).args(["run", "--model"]).arg(&store).args([
        "--ram-budget",
        budget,
        "--max-new",
        &max_new.to_string(),
        "--context",
        "512",
        "--stats",
        "--prompt",
        prompt,
    ]))?;
    // 2. Drafting, where it pays: text the model continues by repeating what it has read, which
    // prompt lookup drafts and K3 verifies several tokens per pass over the experts. Run plain and
    // drafted on the same prompt: the same text, fewer passes.
    eprintln!("\n2. Drafting: the same budget, a prompt the model continues by repeating itself; plain, then drafted (prompt lookup)\n");
    let quote = "I am a man of honour and a man whose name is Ernest. I am a man of honour and a man whose name is Ernest. I am a man of honour and";
    let tmp = std::env::temp_dir().join(format!("deltafin-demo-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let mut texts = Vec::new();
    let mut stats = Vec::new();
    for (i, draft) in [None, Some("ngram")].into_iter().enumerate() {
        let json = tmp.join(format!("stats-{i}.json"));
        let mut c = Command::new(&bin);
        c.args(["run", "--model"]).arg(&store);
        c.args(["--ram-budget", budget, "--max-new", "96", "--context", "512", "--prompt", quote, "--stats-json"]).arg(&json);
        if let Some(d) = draft {
            c.args(["--draft", d]);
        }
        let out = c.output().with_context(|| format!("running {c:?}"))?;
        if !out.status.success() {
            bail!("{c:?} failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        texts.push(String::from_utf8_lossy(&out.stdout).into_owned());
        stats.push(serde_json::from_slice::<serde_json::Value>(&std::fs::read(&json)?)?);
    }
    let _ = std::fs::remove_dir_all(&tmp);
    println!("{quote}{}", texts[1].trim_end());
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(0.0);
    eprintln!(
        "plain: {:.0} tok/s, {:.1} MB of experts read; drafted: {:.0} tok/s ({:.2}x), {:.1} MB read, {} of {} drafts accepted, \
         {:.2} tokens per pass over the experts; the same text: {}",
        f(&stats[0], "decode_tok_s"),
        f(&stats[0], "expert_bytes_read") / 1e6,
        f(&stats[1], "decode_tok_s"),
        f(&stats[1], "decode_tok_s") / f(&stats[0], "decode_tok_s").max(1e-9),
        f(&stats[1], "expert_bytes_read") / 1e6,
        f(&stats[1], "accepted"),
        f(&stats[1], "drafted"),
        f(&stats[1], "tokens_per_verify"),
        if texts[0] == texts[1] { "yes" } else { "NO" }
    );
    if texts[0] != texts[1] {
        bail!("the drafted text differs from the plain one: a bug, please report it");
    }
    eprintln!(
        "\n(a 25 MB model of K3's exact architecture trained for 7 minutes on 49 MB of books and docs: expect \
         fluent-looking, repetitive English; every token is checked by K3's exact math over streamed experts)"
    );
    Ok(())
}
