//! `cargo xtask bench ab --base REV`: this tree against an earlier revision, in one run.
//!
//! Both `deltafin` binaries (the base built from `git archive REV` into `target/ab-base`) run the
//! same model (`small` unless `--model` names another `gen-k3` preset, e.g. `slice` for K3's
//! own expert and spine widths) through the CLI, configurations and binaries interleaved round by round
//! (the order of the two flips every round), so a change of the engine is judged by ratios
//! measured minutes apart on the same machine, never against an old table. Each binary gets its
//! own store (the store format may differ between revisions) made by its own `setup`. Outputs
//! must be identical token for token.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};

use super::{engine_runs, root};

/// One measured configuration: what to run and which stat is its speed.
struct Config {
    streamed: bool,
    prompt: usize,
    new: usize,
    /// `decode_tok_s` (higher is better) or `ttft_s` (lower is better).
    stat: &'static str,
}

const CONFIGS: [Config; 4] = [
    Config { streamed: false, prompt: 16, new: 48, stat: "decode_tok_s" },
    Config { streamed: false, prompt: 256, new: 1, stat: "ttft_s" },
    Config { streamed: true, prompt: 16, new: 48, stat: "decode_tok_s" },
    Config { streamed: true, prompt: 256, new: 1, stat: "ttft_s" },
];

impl Config {
    /// The table's row name, e.g. "decode, streamed under 320 MB (16-token prompt, 48 new)".
    fn label(&self, budget: &str) -> String {
        let place = if self.streamed { format!("streamed under {budget}") } else { "in RAM".into() };
        match self.stat {
            "ttft_s" => format!("prefill, {place} ({} tokens)", self.prompt),
            _ => format!("decode, {place} ({}-token prompt, {} new)", self.prompt, self.new),
        }
    }
}

fn build_base(rev: &str, dir: &Path) -> Result<PathBuf> {
    let src = dir.join("src");
    let _ = std::fs::remove_dir_all(&src);
    std::fs::create_dir_all(&src)?;
    let archive = Command::new("git").current_dir(root()).args(["archive", "--format=tar", rev]).output()?;
    ensure!(archive.status.success(), "git archive {rev}: {}", String::from_utf8_lossy(&archive.stderr));
    let mut tar = Command::new("tar").current_dir(&src).args(["-x"]).stdin(std::process::Stdio::piped()).spawn()?;
    std::io::Write::write_all(tar.stdin.as_mut().context("tar stdin")?, &archive.stdout)?;
    ensure!(tar.wait()?.success(), "unpacking {rev}");
    eprintln!("ab: building deltafin at {rev} (first time: a few minutes)");
    let st = super::cargo()
        .current_dir(&src)
        .env("CARGO_TARGET_DIR", dir.join("target"))
        .args(["build", "--release", "-q", "-p", "deltafin-cli"])
        .status()?;
    ensure!(st.success(), "building deltafin at {rev} failed");
    Ok(dir.join("target/release/deltafin"))
}

fn setup(bin: &Path, ckpt: &Path, store: &Path) -> Result<()> {
    let _ = std::fs::remove_dir_all(store);
    let out = Command::new(bin).args(["setup", "--full", "--from"]).arg(ckpt).arg("--out").arg(store).output()?;
    ensure!(out.status.success(), "{} setup: {}", bin.display(), String::from_utf8_lossy(&out.stderr));
    Ok(())
}

/// Runs one configuration with one binary: (the stat, the process's seconds outside the
/// generation, the ids). The seconds outside are mostly opening the model (reading and checking
/// the spine, starting the readers), which every revision's stats leave out of TTFT.
fn measure(bin: &Path, model: &Path, c: &Config, vocab: u32, budget: &str, json: &Path) -> Result<(f64, f64, String)> {
    let ids: Vec<String> = engine_runs::prompt(c.prompt, vocab).iter().map(u32::to_string).collect();
    let mut cmd = Command::new(bin);
    cmd.args(["run", "--model"]).arg(model).args(["--ids", &ids.join(","), "--max-new", &c.new.to_string(), "--print-ids"]);
    if c.streamed {
        cmd.args(["--ram-budget", budget]);
    }
    let started = std::time::Instant::now();
    let out = cmd.arg("--stats-json").arg(json).output()?;
    let wall = started.elapsed().as_secs_f64();
    if !out.status.success() {
        bail!("{} run: {}", bin.display(), String::from_utf8_lossy(&out.stderr));
    }
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(json)?)?;
    let x = v[c.stat].as_f64().with_context(|| format!("no {} in the stats", c.stat))?;
    let outside = wall - v["total_s"].as_f64().context("no total_s in the stats")?;
    Ok((x, outside, String::from_utf8_lossy(&out.stdout).trim().to_string()))
}

/// Measures `rounds` interleaved rounds; returns the markdown section.
pub fn run(base: &str, quick: bool, preset: &str) -> Result<String> {
    let dir = root().join("target/ab-base");
    // The model first: a misspelled preset fails here, before minutes of building.
    let ckpt = root().join("models").join(preset);
    if !ckpt.join("config.json").exists() {
        crate::gen_k3::generate(preset, 0, &ckpt)?;
    }
    let base_bin = build_base(base, &dir)?;
    let head_bin = super::build_cli()?;
    let vocab: u32 = {
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ckpt.join("config.json"))?)?;
        v["text_config"]["vocab_size"].as_u64().context("vocab_size")? as u32
    };
    let stores = [dir.join(format!("store-base-{preset}")), dir.join(format!("store-head-{preset}"))];
    setup(&base_bin, &ckpt, &stores[0])?;
    setup(&head_bin, &ckpt, &stores[1])?;
    let bins = [&base_bin, &head_bin];
    let rounds = if quick { 3 } else { 7 };
    // Streamed runs hold a fraction of the experts: 320 MB of `small`'s; `slice`'s spine alone
    // needs more (its minimum is about 480 MB), so 1.5 GB, as `bench decode` gives it.
    let (budget, budget_label) = if preset == "small" { ("320M", "320 MB") } else { ("1500M", "1.5 GB") };
    // results[config][binary] = per-round stats
    let mut results = vec![[Vec::new(), Vec::new()]; CONFIGS.len()];
    let mut same = vec![true; CONFIGS.len()];
    // Per binary, the seconds outside generation of every streamed run (opening a store).
    let mut outside = [Vec::new(), Vec::new()];
    let json = dir.join("stats.json");
    for r in 0..rounds {
        eprintln!("ab: round {}/{rounds}", r + 1);
        for (ci, c) in CONFIGS.iter().enumerate() {
            let order = if r % 2 == 0 { [0, 1] } else { [1, 0] };
            let mut ids = [String::new(), String::new()];
            for b in order {
                let model = if c.streamed { stores[b].clone() } else { ckpt.clone() };
                let (x, o, out) = measure(bins[b], &model, c, vocab, budget, &json)?;
                results[ci][b].push(x);
                if c.streamed {
                    outside[b].push(o);
                }
                ids[b] = out;
            }
            same[ci] &= ids[0] == ids[1];
        }
    }
    // `small` is the default: its section keeps the plain title and command.
    let (on, flag) =
        if preset == "small" { (String::new(), String::new()) } else { (format!(", on `{preset}`"), format!(" --model {preset}")) };
    let mut md = format!(
        "## This tree against an earlier revision{on}\n\n`cargo xtask bench ab --base {base}{}{flag}` — the `{preset}` model through the `deltafin` CLI of both revisions, {rounds} rounds, configurations and binaries interleaved (the order flips every round); each revision streams from a store its own `setup` made. *Speed ratio* = this tree's speed / the base's (tok/s ratio for decode, TTFT base / this tree for prefill), per round, min / median / max; above 1 is faster.\n\n| configuration | base (median) | this tree (median) | speed ratio min / median / max | same ids |\n|---|---|---|---|---|\n",
        if quick { " --quick" } else { "" },
    );
    for (ci, c) in CONFIGS.iter().enumerate() {
        let [b, h] = &results[ci];
        let ratios: Vec<f64> = b.iter().zip(h).map(|(b, h)| if c.stat == "ttft_s" { b / h } else { h / b }).collect();
        let (ra, rb, rc) = engine_runs::spread(&ratios);
        let unit = if c.stat == "ttft_s" { "s TTFT" } else { "tok/s" };
        md += &format!(
            "| {} | {:.3} {unit} | {:.3} {unit} | {ra:.3} / {rb:.3} / {rc:.3} | {} |\n",
            c.label(budget_label),
            engine_runs::spread(b).1,
            engine_runs::spread(h).1,
            same[ci]
        );
    }
    let [b, h] = &outside;
    let ratios: Vec<f64> = b.iter().zip(h).map(|(b, h)| b / h).collect();
    let (ra, rb, rc) = engine_runs::spread(&ratios);
    md += &format!(
        "| opening the store, streamed (process wall time outside the generation, every streamed run) | {:.3} s | {:.3} s | {ra:.3} / {rb:.3} / {rc:.3} | |\n",
        engine_runs::spread(b).1,
        engine_runs::spread(h).1,
    );
    Ok(md)
}

#[cfg(test)]
mod tests {
    #[test]
    fn row_names_are_the_tables_own() {
        let names: Vec<String> = super::CONFIGS.iter().map(|c| c.label("320 MB")).collect();
        assert_eq!(
            names,
            [
                "decode, in RAM (16-token prompt, 48 new)",
                "prefill, in RAM (256 tokens)",
                "decode, streamed under 320 MB (16-token prompt, 48 new)",
                "prefill, streamed under 320 MB (256 tokens)",
            ]
        );
    }
}
