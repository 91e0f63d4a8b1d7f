//! `cargo xtask fuzz-store`: plants one fault at a time in a store and checks the engine never
//! computes with it silently.
//!
//! Two `tiny` checkpoints with one config and other weights (seeds 1 and 2) are installed over
//! two homes. Each case changes one file of store A: a random byte flipped, a random digit of a
//! text file changed, or the whole file swapped for store B's counterpart; then `deltafin run`
//! must either print A's reference ids or fail with a clear error (exit 1, `error:` and a path),
//! and `deltafin doctor --verify` must report the fault. Silent wrong output, a panic, or a fault
//! doctor misses fails the command. The file is restored before the next case.
//!
//! Targets are every file whose bytes the engine or setup trusts: manifest, setup record, spine
//! file and sidecar, config and tokenizer, each pack and pack sidecar. Not targeted: the lock
//! files (empty), the marker file and `heat.json` (advisory: never computed with).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Result};

const PROMPT: &str = "5,17,300,42,7,911,64,2000,13,8,123,77,1500,3,29,640,88,1024";
const MAX_NEW: &str = "8";

/// What one planted fault did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    /// Exit 0 with the reference ids (the fault touched nothing this prompt computes with).
    Unaffected,
    /// A clear error.
    Loud,
    /// Exit 0 with other ids: the worst bug there is.
    SilentWrong,
    /// A panic or a crash.
    Panic,
    /// A non-zero exit that is not a clear error (no `error:` or no path).
    Unclear,
}

/// A small deterministic generator (cases replay from the seed).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

struct Store {
    dir: PathBuf,
    homes: Vec<PathBuf>,
}

/// Files of a store by role (the same role names the counterpart in the other store).
fn targets(s: &Store) -> Result<BTreeMap<String, PathBuf>> {
    let mut t = BTreeMap::new();
    for f in [
        "manifest.json",
        "setup.json",
        "spine.bin",
        "spine.bin.json",
        "config.json",
        "tiktoken.model",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        if s.dir.join(f).exists() {
            t.insert(f.to_string(), s.dir.join(f));
        }
    }
    for (h, home) in s.homes.iter().enumerate() {
        for d in std::fs::read_dir(home.join(deltafin_store::PACKS_DIR))? {
            for f in std::fs::read_dir(d?.path())? {
                let p = f?.path();
                let name = p.file_name().unwrap_or_default().to_string_lossy().into_owned();
                if name.starts_with('L') {
                    t.insert(format!("home{h}/{name}"), p);
                }
            }
        }
    }
    Ok(t)
}

fn setup(bin: &Path, ckpt: &Path, root: &Path) -> Result<Store> {
    let dir = root.join("store");
    let homes: Vec<PathBuf> = (0..2).map(|h| root.join(format!("drive{h}"))).collect();
    // The drives' mount point: setup makes the homes in it, not the folders above them.
    std::fs::create_dir_all(root)?;
    let mut c = Command::new(bin);
    c.args(["setup", "--full", "--from"]).arg(ckpt).arg("--out").arg(&dir);
    for h in &homes {
        c.arg("--home").arg(h);
    }
    let out = c.output()?;
    ensure!(out.status.success(), "setup failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(Store { dir, homes })
}

/// Runs the engine on the store: (exit code, stdout, stderr); `None` for a kill by signal.
fn run(bin: &Path, store: &Path) -> Result<(Option<i32>, String, String)> {
    let mut c = Command::new("timeout");
    c.arg("120").arg(bin).args(["run", "--model"]).arg(store).args(["--ids", PROMPT, "--max-new", MAX_NEW, "--print-ids"]);
    if deltafin_store::Store::is_store(store) {
        c.args(["--ram-budget", "64M"]);
    }
    let out = c.output()?;
    Ok((out.status.code(), String::from_utf8_lossy(&out.stdout).trim().to_string(), String::from_utf8_lossy(&out.stderr).into_owned()))
}

/// Whether `doctor --verify` reports a problem, and its advice (stderr).
fn doctor(bin: &Path, store: &Path) -> Result<(bool, String)> {
    let out = Command::new(bin).args(["doctor", "--verify", "--model"]).arg(store).output()?;
    Ok((!out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned()))
}

fn doctor_reports(bin: &Path, store: &Path) -> Result<bool> {
    Ok(doctor(bin, store)?.0)
}

/// Follows the advice that ends an error literally: runs the last `deltafin ...` command quoted
/// in backticks. Whether there was one and it succeeded.
fn follow_advice(bin: &Path, err: &str) -> Result<bool> {
    let Some(cmd) = err.trim_end().rsplit('`').nth(1) else { return Ok(false) };
    let mut words = cmd.split_whitespace();
    if words.next() != Some("deltafin") {
        return Ok(false);
    }
    Ok(Command::new(bin).args(words).output()?.status.success())
}

/// Every file under `dir`, relative to it.
fn files_under(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let p = e?.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(dir)?.to_path_buf());
            }
        }
    }
    Ok(out)
}

/// Makes `live` byte for byte `pristine` again (a repair may have rewritten any file, and a
/// case must never inherit the last one's state). Returns how many files differed.
fn restore(pristine: &Path, live: &Path) -> Result<usize> {
    let want = files_under(pristine)?;
    let mut fixed = 0;
    for f in files_under(live)? {
        if !want.contains(&f) {
            std::fs::remove_file(live.join(&f))?;
            fixed += 1;
        }
    }
    for f in &want {
        let good = std::fs::read(pristine.join(f))?;
        if std::fs::read(live.join(f)).ok().as_deref() != Some(good.as_slice()) {
            std::fs::create_dir_all(live.join(f).parent().expect("a file in a folder"))?;
            std::fs::write(live.join(f), good)?;
            fixed += 1;
        }
    }
    Ok(fixed)
}

/// The kind of file a target is: its name, or `pack` / `pack sidecar` for any home's packs.
fn role_of(name: &str) -> String {
    match name.split_once('/') {
        Some((_, f)) if f.ends_with(".json") => "pack sidecar".into(),
        Some(_) => "pack".into(),
        None => name.into(),
    }
}

/// Plants a fault in `path`; returns a description, or `None` if this draw changes nothing.
fn plant(rng: &mut Rng, path: &Path, counterpart: Option<&PathBuf>) -> Result<Option<(String, Vec<u8>)>> {
    let bytes = std::fs::read(path)?;
    let text = path.extension().is_some_and(|e| e == "json") || path.ends_with("tiktoken.model");
    let mut changed = bytes.clone();
    let kind = match rng.below(10) {
        0..=1 => {
            let Some(other) = counterpart else { return Ok(None) };
            changed = std::fs::read(other)?;
            "swap".to_string()
        }
        2..=5 if text => {
            let digits: Vec<usize> = (0..bytes.len()).filter(|&i| bytes[i].is_ascii_digit()).collect();
            if digits.is_empty() {
                return Ok(None);
            }
            let at = digits[rng.below(digits.len())];
            changed[at] = b'0' + ((changed[at] - b'0') as usize + 1 + rng.below(9)) as u8 % 10;
            format!("digit@{at}")
        }
        _ => {
            if bytes.is_empty() {
                return Ok(None);
            }
            let at = rng.below(bytes.len());
            changed[at] ^= 1 + rng.below(255) as u8;
            format!("flip@{at}")
        }
    };
    if changed == bytes {
        return Ok(None);
    }
    std::fs::write(path, &changed)?;
    Ok(Some((kind, bytes)))
}

/// Runs `cases` planted faults in `work` (default `target/fuzz-store`); writes the summary to
/// `report` (markdown) and fails on any silent wrong output, panic, unclear error, fault doctor
/// missed, or advice that did not repair.
pub fn run_fuzz(cases: usize, seed: u64, report: Option<&Path>, work: Option<&Path>) -> Result<()> {
    let bin = crate::bench::build_cli()?;
    let work = work.map(Path::to_path_buf).unwrap_or_else(|| crate::bench::root().join("target/fuzz-store"));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let work = std::fs::canonicalize(&work)?;
    for s in [1, 2] {
        crate::gen_k3::generate("tiny", s, &work.join(format!("ckpt{s}")))?;
    }
    let a = setup(&bin, &work.join("ckpt1"), &work.join("a"))?;
    let pristine = work.join("pristine-a");
    for f in files_under(&work.join("a"))? {
        std::fs::create_dir_all(pristine.join(&f).parent().expect("a file in a folder"))?;
        std::fs::copy(work.join("a").join(&f), pristine.join(&f))?;
    }
    let b = setup(&bin, &work.join("ckpt2"), &work.join("b"))?;
    let (code, reference, err) = run(&bin, &a.dir)?;
    ensure!(code == Some(0), "the pristine store does not run: {err}");
    let (code, direct, err) = run(&bin, &work.join("ckpt1"))?;
    ensure!(code == Some(0) && direct == reference, "store and checkpoint disagree ({direct} vs {reference}): {err}");
    let (_, other, _) = run(&bin, &b.dir)?;
    ensure!(other != reference, "the two checkpoints give the same ids; the swap cases would prove nothing");
    ensure!(!doctor_reports(&bin, &a.dir)?, "doctor reports a problem in the pristine store");
    let ta = targets(&a)?;
    let tb = targets(&b)?;
    // Each kind of file is as likely as any other (there are many packs and one manifest).
    let mut by_role: BTreeMap<String, Vec<&String>> = BTreeMap::new();
    for n in ta.keys() {
        by_role.entry(role_of(n)).or_default().push(n);
    }
    let roles: Vec<&Vec<&String>> = by_role.values().collect();
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut table: BTreeMap<(String, String), BTreeMap<Outcome, usize>> = BTreeMap::new();
    let mut reported_by: BTreeMap<(String, String), usize> = BTreeMap::new();
    let mut repaired_by: BTreeMap<(String, String), usize> = BTreeMap::new();
    let mut missed = Vec::new();
    let mut bad = Vec::new();
    let mut samples: BTreeMap<String, String> = BTreeMap::new();
    let bar = indicatif::ProgressBar::new(cases as u64);
    let mut done = 0;
    while done < cases {
        let group = roles[rng.below(roles.len())];
        let name = group[rng.below(group.len())];
        let path = &ta[name];
        let Some((kind, original)) = plant(&mut rng, path, tb.get(name))? else { continue };
        let (code, ids, err) = run(&bin, &a.dir)?;
        let first = err.lines().find(|l| l.starts_with("error:")).unwrap_or_default().to_string();
        let outcome = match code {
            Some(0) if ids == reference => Outcome::Unaffected,
            Some(0) => Outcome::SilentWrong,
            Some(1) if !err.contains("panicked") && first.contains(work.to_str().unwrap_or_default()) => Outcome::Loud,
            Some(1) if !err.contains("panicked") => Outcome::Unclear,
            _ => Outcome::Panic,
        };
        let (reported, advice) = doctor(&bin, &a.dir)?;
        // The advice of the run's error (or, where the run was unaffected, doctor's), followed
        // literally, must leave a store that verifies and gives the reference ids.
        let advice = if outcome == Outcome::Loud { err.as_str() } else { advice.as_str() };
        let repaired = reported && follow_advice(&bin, advice)? && !doctor_reports(&bin, &a.dir)? && run(&bin, &a.dir)?.1 == reference;
        if reported && !repaired {
            bad.push(format!("{name} {kind}: following the advice did not repair the store: {}", advice.trim()));
        }
        *repaired_by.entry((role_of(name), kind.split('@').next().unwrap_or_default().to_string())).or_default() += usize::from(repaired);
        drop(original);
        restore(&pristine, &work.join("a"))?;
        let role = role_of(name);
        let mutation = kind.split('@').next().unwrap_or_default().to_string();
        *table.entry((role.clone(), mutation.clone())).or_default().entry(outcome).or_default() += 1;
        if outcome == Outcome::Loud {
            samples.entry(format!("{role} {mutation}")).or_insert_with(|| first.replace(work.to_str().unwrap_or_default(), "WORK"));
        }
        *reported_by.entry((role.clone(), mutation.clone())).or_default() += usize::from(reported);
        if !reported {
            missed.push(format!("{name} {kind}"));
        }
        if matches!(outcome, Outcome::SilentWrong | Outcome::Panic | Outcome::Unclear) {
            bad.push(format!("{name} {kind}: {outcome:?} (exit {code:?}, ids {ids}): {}", err.trim()));
        }
        done += 1;
        bar.inc(1);
    }
    bar.finish_and_clear();
    ensure!(!doctor_reports(&bin, &a.dir)?, "the store was not restored after the cases");
    let mut md = format!(
        "# Store fault fuzz\n\nMade by `cargo xtask fuzz-store --cases {cases} --seed {seed}`: one planted fault per case in a `tiny` \
         store over two homes (flip = one random byte changed, digit = one ASCII digit of a text file changed, swap = the file \
         replaced by the same file of a store of another checkpoint with the same config). `run` must print the reference ids \
         or fail with a clear error; `doctor --verify` must report every fault.\n\n\
         The advice ending the error (or doctor's, where the run was unaffected), followed literally, must repair the store: \
         it then verifies and gives the reference ids.\n\n\
         | file | fault | cases | reference ids | clear error | silent wrong | panic | unclear error | doctor reported | advice repaired |\n\
         |---|---|---|---|---|---|---|---|---|---|\n"
    );
    let mut totals = [0usize; 5];
    for ((role, mutation), counts) in &table {
        let n: usize = counts.values().sum();
        let get = |o| counts.get(&o).copied().unwrap_or(0);
        let reported = reported_by.get(&(role.clone(), mutation.clone())).copied().unwrap_or(0);
        let repaired = repaired_by.get(&(role.clone(), mutation.clone())).copied().unwrap_or(0);
        let row = [get(Outcome::Unaffected), get(Outcome::Loud), get(Outcome::SilentWrong), get(Outcome::Panic), get(Outcome::Unclear)];
        for (t, r) in totals.iter_mut().zip(row) {
            *t += r;
        }
        md.push_str(&format!(
            "| {role} | {mutation} | {n} | {} | {} | {} | {} | {} | {reported} | {repaired} |\n",
            row[0], row[1], row[2], row[3], row[4]
        ));
    }
    md.push_str(&format!(
        "| **all** | | **{cases}** | {} | {} | **{}** | **{}** | {} | **{} of {cases}** | **{} of {cases}** |\n\nSample errors (first line, one per file and fault):\n\n",
        totals[0],
        totals[1],
        totals[2],
        totals[3],
        totals[4],
        cases - missed.len(),
        repaired_by.values().sum::<usize>()
    ));
    for (k, v) in &samples {
        md.push_str(&format!("- {k}: `{v}`\n"));
    }
    print!("{md}");
    if let Some(p) = report {
        std::fs::write(p, &md)?;
    }
    for m in &bad {
        eprintln!("BAD: {m}");
    }
    for m in &missed {
        eprintln!("doctor missed: {m}");
    }
    if !bad.is_empty() || !missed.is_empty() {
        bail!("{} case(s) gave silent wrong output, a panic or an unclear error; doctor missed {}", bad.len(), missed.len());
    }
    Ok(())
}
