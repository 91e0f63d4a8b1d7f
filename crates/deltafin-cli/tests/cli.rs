//! The `deltafin` binary end to end: run (text, ids, stdin, stats JSON), logits, setup with a
//! crash and resume, doctor.

mod common;

use common::*;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

#[test]
fn run_prints_reference_ids_from_ids_text_and_stdin() {
    let f = fixture();
    let out = ok(bin().args(["run", "--model"]).arg(&f).args(["--ids", PROMPT_IDS, "--max-new", "16", "--print-ids"]));
    assert_eq!(out.trim(), REFERENCE_GREEDY);
    let out = ok(bin().args(["run", "--model"]).arg(&f).args(["--prompt", PROMPT_TEXT, "--max-new", "16", "--print-ids"]));
    assert_eq!(out.trim(), REFERENCE_GREEDY);
    // Drafts change the number of steps, never the ids.
    let out = ok(bin().args(["run", "--model"]).arg(&f).args(["--ids", PROMPT_IDS, "--max-new", "16", "--print-ids", "--draft", "ngram"]));
    assert_eq!(out.trim(), REFERENCE_GREEDY);
    let mut child = bin()
        .args(["run", "--model"])
        .arg(&f)
        .args(["--max-new", "16", "--print-ids"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(PROMPT_TEXT.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), REFERENCE_GREEDY);
    // Text mode streams the decoded bytes of the same ids.
    let text = ok(bin().args(["run", "--model"]).arg(&f).args(["--prompt", PROMPT_TEXT, "--max-new", "4"]));
    assert!(text.starts_with(" exper"), "{text:?}");
}

#[test]
fn bad_input_gets_clear_errors() {
    let f = fixture();
    let out = bin().args(["run", "--model"]).arg(&f).args(["--prompt", "", "--max-new", "2"]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("empty"));
    let out = bin().args(["run", "--model", "/nonexistent", "--prompt", "x"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("/nonexistent: no such model folder or store"), "{err}");
    assert_eq!(err.matches("no such model folder").count(), 1, "the cause once: {err}");
    let out = bin().args(["run", "--model"]).arg(&f).args(["--ids", "5000", "--max-new", "2"]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("outside the vocabulary"));
    let out = bin().args(["run", "--model"]).arg(&f).args(["--prompt", "x", "--ram-budget", "lots"]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("not a size"));
    // K3.1's indexer rounding on a K3 model: refused, saying which models it applies to.
    let out = bin().args(["run", "--model"]).arg(&f).args(["--prompt", "x", "--indexer", "fp8"]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("kimi_k31"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = bin().args(["run", "--model"]).arg(&f).args(["--prompt", "x", "--indexer", "bf16"]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("f32"));
    ok(bin().args(["run", "--model"]).arg(&f).args(["--ids", PROMPT_IDS, "--max-new", "2", "--indexer", "f32"]));
}

#[test]
fn drafting_options_never_change_the_ids_and_say_what_drafted() {
    let f = fixture();
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("s.json");
    for extra in [&["--draft", "auto"][..], &["--draft", "ngram", "--draft-fixed", "--draft-max", "6"]] {
        let out = ok(bin()
            .args(["run", "--model"])
            .arg(&f)
            .args(["--ids", PROMPT_IDS, "--max-new", "16", "--print-ids"])
            .args(extra)
            .arg("--stats-json")
            .arg(&json));
        assert_eq!(out.trim(), REFERENCE_GREEDY, "{extra:?}");
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        // No draft/ folder beside the fixture: auto falls back to prompt lookup.
        assert_eq!(v["drafter"], "prompt lookup (ngram)", "{extra:?}");
        for key in ["acceptance_rate", "tokens_per_verify", "verify_union_bytes_mean", "expert_bytes_per_emitted_token", "draft_probes"] {
            assert!(v[key].is_number(), "{key} missing: {v}");
        }
    }
    // A draft folder that is not one: the error names it and says what to do instead.
    let out = bin().args(["run", "--model"]).arg(&f).args(["--prompt", "x", "--draft"]).arg(tmp.path().join("nothing")).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("nothing") && err.contains("--draft ngram"), "{err}");
}

#[test]
fn logits_file_has_one_row_per_position() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("l.safetensors");
    ok(bin().args(["logits", "--model"]).arg(fixture()).args(["--ids", "1,2,3,4", "--out"]).arg(&out));
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("logits").unwrap();
    assert_eq!(t.shape(), &[4, 1256]);
    assert_eq!(t.dtype(), safetensors::Dtype::F32);
}

fn tree(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((p.strip_prefix(dir).unwrap().display().to_string(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn setup_killed_midway_resumes_to_an_identical_store_and_runs_within_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let setup = |root: &Path| {
        let mut c = bin();
        c.args(["setup", "--full", "--copies", "2", "--from"]).arg(fixture()).arg("--out").arg(root.join("store"));
        for h in 0..3 {
            c.arg("--home").arg(root.join(format!("d{h}")));
            std::fs::create_dir_all(root.join(format!("d{h}"))).unwrap();
        }
        c
    };
    ok(&mut setup(&a));
    let crashed = setup(&b).env("DELTAFIN_SETUP_CRASH_AFTER_LAYERS", "4").output().unwrap();
    assert!(!crashed.status.success(), "the injected crash happened");
    assert!(!b.join("store/manifest.json").exists(), "no manifest before setup completes");
    let partial = tree(&b);
    assert!(partial.iter().any(|(n, _)| n.contains("L004.pack")) && !partial.iter().any(|(n, _)| n.contains("L006.pack.json")));
    let err = bin().args(["run", "--model"]).arg(b.join("store")).args(["--prompt", "x"]).output().unwrap();
    assert!(String::from_utf8_lossy(&err.stderr).contains("did not finish"), "{}", String::from_utf8_lossy(&err.stderr));
    ok(&mut setup(&b));
    // Sealed files name their root in the body, so their seals differ: compare bodies.
    let norm = |t: Vec<(String, Vec<u8>)>, root: &Path| -> Vec<(String, Vec<u8>)> {
        t.into_iter()
            .map(|(n, d)| {
                let text = String::from_utf8_lossy(&d).replace(&root.display().to_string(), "ROOT");
                let body = if text.starts_with("{\"xxh3\"") { text.split_once('\n').unwrap().1.to_string() } else { text };
                (n, body.into_bytes())
            })
            .collect()
    };
    assert_eq!(norm(tree(&a), &a), norm(tree(&b), &b), "resumed store differs from an uninterrupted one");
    ok(bin().args(["doctor", "--verify", "--model"]).arg(b.join("store")));
    // Run from the store under a budget; stats JSON carries the documented fields.
    let stats = tmp.path().join("stats.json");
    let out = ok(bin()
        .args(["run", "--model"])
        .arg(b.join("store"))
        .args(["--ids", PROMPT_IDS, "--max-new", "16", "--print-ids", "--ram-budget", "32M", "--stats-json"])
        .arg(&stats));
    assert_eq!(out.trim(), REFERENCE_GREEDY);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
    for f in [
        "prompt_tokens",
        "generated_tokens",
        "ttft_s",
        "decode_tok_s",
        "expert_bytes_read",
        "cache_hit_rate",
        "read_wait_s",
        "compute_s",
        "peak_rss_bytes",
        "expert_bytes_read_prefill",
        "expert_bytes_distinct_prefill",
        "open_s",
    ] {
        assert!(v.get(f).is_some(), "stats JSON lacks {f}");
    }
    assert_eq!(v["prompt_tokens"], 27);
    assert_eq!(v["generated_tokens"], 16);
    assert!(v["expert_bytes_read"].as_u64().unwrap() > 0);
    // Peak RSS stays within the budget plus the stated process overhead (64 MiB).
    let rss = v["peak_rss_bytes"].as_u64().unwrap();
    assert!(rss <= 32_000_000 + (64 << 20), "peak RSS {rss} exceeds the 32M budget + 64 MiB overhead");
    // Doctor notices damage and exits non-zero.
    let sealed: serde_json::Value = serde_json::from_slice(&std::fs::read(b.join("store/manifest.json")).unwrap()).unwrap();
    let m = &sealed["body"];
    let e = &m["experts"][0]["copies"][0];
    let p = PathBuf::from(m["homes"][e["home"].as_u64().unwrap() as usize].as_str().unwrap()).join(e["file"].as_str().unwrap());
    let mut bytes = std::fs::read(&p).unwrap();
    let off = e["offset"].as_u64().unwrap() as usize;
    bytes[off + 7] ^= 1;
    std::fs::write(&p, bytes).unwrap();
    let out = bin().args(["doctor", "--verify", "--model"]).arg(b.join("store")).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("corrupt"));
}

#[test]
fn chat_repl_streams_keeps_history_and_ctrl_c_stops_only_the_reply() {
    let mut child = bin()
        .args(["chat", "--max-new", "3000", "--context", "8192", "--model"])
        .arg(fixture())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    // A multi-line message (trailing backslash continues the line) starts a long reply.
    stdin.write_all(b"Numbers matter \\\nhere too\n").unwrap();
    stdin.flush().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let st = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(st.success());
    std::thread::sleep(std::time::Duration::from_millis(300));
    stdin.write_all(b"/stats\n/reset\nhello again\n/quit\n").unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "Ctrl-C must not quit the chat: {err}");
    assert!(err.contains("(stopped)"), "{err}");
    assert!(err.contains("(new conversation)"), "{err}");
    assert!(!String::from_utf8_lossy(&out.stdout).trim().is_empty());
}

fn batch_lines(n: usize) -> String {
    let mut s = String::new();
    for i in 0..n {
        let (url, body) = if i % 3 == 0 {
            ("/v1/completions", serde_json::json!({"prompt": format!("Numbers {i} and"), "max_tokens": 5 + i % 4}))
        } else {
            (
                "/v1/chat/completions",
                serde_json::json!({"messages": [{"role": "user", "content": format!("Boat number {i}")}], "max_tokens": 4 + i % 5}),
            )
        };
        s += &serde_json::json!({"custom_id": format!("req-{i}"), "method": "POST", "url": url, "body": body}).to_string();
        s.push('\n');
    }
    // A request the server refuses is that line's result; the batch goes on.
    s += r#"{"custom_id": "refused", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "logit_bias": {"5": 1}}}"#;
    s.push('\n');
    s
}

/// `deltafin batch` over the fixture from `input` to `out`, `max_batch` at a time.
fn batch_cmd(input: &Path, out: &Path, max_batch: &str) -> std::process::Command {
    let mut c = bin();
    c.args(["batch", "--model"]).arg(fixture()).arg("--input").arg(input).arg("--output").arg(out).args(["--max-batch", max_batch]);
    c
}

/// custom_id -> (status, choices, usage) of each output line; the usage without its cached
/// tokens (how many a request reused from a prefix another one ran depends on arrival order).
fn batch_results(path: &Path) -> std::collections::BTreeMap<String, (u64, serde_json::Value, serde_json::Value)> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut out = std::collections::BTreeMap::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let id = v["custom_id"].as_str().unwrap().to_string();
        let r = &v["response"];
        let mut usage = r["body"]["usage"].clone();
        if let Some(u) = usage.as_object_mut() {
            u.remove("prompt_tokens_details");
        }
        let prev = out.insert(id.clone(), (r["status_code"].as_u64().unwrap(), r["body"]["choices"].clone(), usage));
        assert!(prev.is_none(), "{id} written twice");
    }
    out
}

#[test]
fn a_killed_batch_resumes_to_the_uninterrupted_result() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in.jsonl");
    std::fs::write(&input, batch_lines(12)).unwrap();
    let run = |out: &Path, env: &[(&str, &str)]| batch_cmd(&input, out, "4").envs(env.iter().copied()).output().unwrap();
    let whole = tmp.path().join("whole.jsonl");
    let o = run(&whole, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    // The end stats say how much the lockstep shared.
    let per_step = |what: &str| -> f64 {
        let at = err.find(what).unwrap_or_else(|| panic!("no {what:?} in {err}"));
        err[..at].split_whitespace().last().unwrap().parse().unwrap()
    };
    assert!(per_step("sequences per step") > 1.0, "{err}");
    assert!(per_step("distinct experts per step") > 0.0, "{err}");
    let want = batch_results(&whole);
    assert_eq!(want.len(), 13);
    assert_eq!(want["refused"].0, 400);
    assert!(want.iter().filter(|(k, _)| *k != "refused").all(|(_, v)| v.0 == 200));
    // Killed after 5 lines, the 6th half written: the re-run cuts the torn line, skips the five.
    let resumed = tmp.path().join("resumed.jsonl");
    let o = run(&resumed, &[("DELTAFIN_FAULT_BATCH_CRASH_AFTER", "5")]);
    assert!(!o.status.success(), "the planted crash happened");
    let torn = std::fs::read_to_string(&resumed).unwrap();
    assert_eq!(torn.matches('\n').count(), 5);
    assert!(!torn.ends_with('\n'), "a torn line was left, as a crash mid-write leaves one");
    let o = run(&resumed, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("5 done earlier"), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(batch_results(&resumed), want, "resumed output differs from an uninterrupted run");
    // Line and request ids stay unique across the two runs.
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(&resumed).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    for key in ["/id", "/response/request_id"] {
        let ids: std::collections::BTreeSet<String> = lines.iter().map(|v| v.pointer(key).unwrap().as_str().unwrap().to_string()).collect();
        assert_eq!(ids.len(), lines.len(), "{key} repeated in a resumed batch");
    }
    // Nothing left to do: a third run writes nothing.
    let before = std::fs::read(&resumed).unwrap();
    assert!(run(&resumed, &[]).status.success());
    assert_eq!(std::fs::read(&resumed).unwrap(), before);
    // A malformed envelope stops the batch before anything runs, naming the line.
    std::fs::write(&input, "{\"custom_id\": \"a\", \"body\": {}}\n{\"custom_id\": \"a\", \"body\": {}}\n").unwrap();
    let o = run(&tmp.path().join("x.jsonl"), &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("line 2") && err.contains("twice"), "{err}");
}

/// Issue 49: requests sharing a system prompt run it once per batch (the first to start keeps its
/// state, the others start there), with the answers of a batch that shares nothing.
#[test]
fn a_batch_runs_a_shared_system_prompt_once_with_unchanged_answers() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in.jsonl");
    let system = "You are a careful assistant who answers in short sentences about boats, rivers and the weather on the coast.";
    let mut text = String::new();
    for i in 0..6 {
        let body = serde_json::json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": format!("Boat number {i}")}], "max_tokens": 6});
        text += &serde_json::json!({"custom_id": format!("req-{i}"), "method": "POST", "url": "/v1/chat/completions", "body": body})
            .to_string();
        text.push('\n');
    }
    std::fs::write(&input, text).unwrap();
    let run = |out: &Path, batch: &str| {
        let o = batch_cmd(&input, out, batch).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{err}");
        err
    };
    let (shared, alone) = (tmp.path().join("shared.jsonl"), tmp.path().join("alone.jsonl"));
    let err = run(&shared, "3");
    run(&alone, "1");
    assert_eq!(batch_results(&shared), batch_results(&alone), "sharing the prefix changed an answer");
    // Requests reach the engine as the batch feeds them: the first may start before any other has
    // arrived to share with; the rest find the prefix kept.
    let cached: Vec<u64> = std::fs::read_to_string(&shared)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert!(cached.iter().filter(|&&c| c >= 16).count() >= 3, "most requests started from the shared prefix: {cached:?}");
    let line = err.lines().find(|l| l.starts_with("shared prefixes:")).unwrap_or_else(|| panic!("no shared-prefix line: {err}"));
    let reused: u64 = line.split_whitespace().nth(2).unwrap().parse().unwrap();
    assert_eq!(reused, cached.iter().sum::<u64>(), "the summary counts what the results say: {line}");
}

#[test]
fn plan_projects_what_stays_resident_and_the_speed() {
    let f = fixture();
    let plan = |ram: &str, drives: &[&str], extra: &[&str]| {
        let mut c = bin();
        c.args(["plan", "--model"]).arg(&f).args(["--ram", ram, "--prompt-tokens", "64"]).args(extra);
        for d in drives {
            c.args(["--drive", d]);
        }
        c.output().unwrap()
    };
    let out = plan("1G", &["1G"], &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("minimum RAM") && text.contains("decode") && text.contains("TTFT"), "{text}");
    // A gigabyte holds every expert of the tiny model: nothing is read per token, and the plan
    // says compute is what would help.
    let cached = text.lines().find(|l| l.contains("expert cache")).unwrap();
    let per_token = text.lines().find(|l| l.contains("per decode token")).unwrap();
    assert!(cached.contains("100.0%") && per_token.contains(" 0 B"), "{text}");
    assert!(text.contains("what would help") && text.contains("nothing is read"), "{text}");
    // Readable units, one drive named as one, no claim of K3's shapes or of measuring 4 drives.
    assert!(text.contains("9.8 KB") && text.contains("one drive") && text.contains("1.00 GB/s"), "{text}");
    assert!(!text.contains("K3 shapes") && !text.contains("measured: bench ladder"), "{text}");
    // Another machine's cores: the compute projected at their multiple of this machine's.
    let out = plan("1G", &["1G"], &["--cores", "64", "--core-speed", "1.5", "-t", "2"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("64 cores at 1.5x") && text.contains("48.00x this machine's compute"), "{text}");
    // A budget below the minimum: said, and the exit status says it too.
    let out = plan("1M", &["1G"], &[]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("does not fit") && !out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs at least"));
    let out = plan("1G", &[], &[]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--drive"));
    let out = plan("1G", &["1G"], &["--cores", "0"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--cores"));
}

#[test]
fn errors_say_what_a_model_folder_is_and_suggest_a_budget_that_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let out = bin().args(["run", "--prompt", "hi", "--model"]).arg(tmp.path()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a model folder") && err.contains("config.json") && err.contains("deltafin setup"), "{err}");
    assert_eq!(err.matches("os error").count(), 0, "{err}");
    let out = bin().args(["run", "--prompt", "hi", "--ram-budget", "1M", "--model"]).arg(fixture()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let suggested = err.rsplit("try --ram-budget ").next().unwrap().trim().to_string();
    assert!(err.contains(" MB") && suggested.ends_with('M'), "{err}");
    // The suggestion, followed, runs.
    ok(bin().args(["run", "--prompt", "hi", "--max-new", "2", "--ram-budget", &suggested, "--model"]).arg(fixture()));
}

#[test]
fn batch_outputs_that_would_lose_results_are_refused_or_redone() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in.jsonl");
    std::fs::write(&input, batch_lines(2)).unwrap();
    let run =
        |out: &Path| bin().args(["batch", "--model"]).arg(fixture()).arg("--input").arg(&input).arg("--output").arg(out).output().unwrap();
    // The output is the input: refused, the input untouched.
    let before = std::fs::read(&input).unwrap();
    let o = run(&input);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("is the input file"), "{err}");
    assert_eq!(std::fs::read(&input).unwrap(), before);
    // A line with a known id but no result is not a result: that request runs again.
    let out = tmp.path().join("out.jsonl");
    std::fs::write(&out, "{\"custom_id\": \"req-0\", \"response\": null, \"error\": null}\n").unwrap();
    let o = run(&out);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("0 done earlier"), "{err}");
    let done: Vec<serde_json::Value> = std::fs::read_to_string(&out).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(done.iter().any(|v| v["custom_id"] == "req-0" && v["response"]["status_code"] == 200), "req-0 ran again");
    // Results of requests the input does not have: another batch's output, refused.
    let other = tmp.path().join("other.jsonl");
    std::fs::write(&other, "{\"custom_id\": \"elsewhere\", \"response\": {\"status_code\": 200, \"body\": {}}, \"error\": null}\n")
        .unwrap();
    let o = run(&other);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("another batch's output") && err.contains("elsewhere"), "{err}");
}

/// Issue 50: what a new user typing a wrong path or a missing mode gets is an error that names the
/// mistake and the fix, before anything runs (each printed an OS error, a Debug list, or failed
/// only after the whole generation before).
#[test]
fn first_hour_mistakes_get_errors_that_say_what_to_do() {
    let tmp = tempfile::tempdir().unwrap();
    let readme = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
    let err = fails(bin().args(["run", "--ids", "1", "--model"]).arg(tmp.path().join("nothing-here")));
    assert!(err.contains("no such model folder or store") && err.contains("--model takes"), "{err}");
    let err = fails(bin().args(["run", "--ids", "1", "--model"]).arg(&readme));
    assert!(err.contains("is a file, not a model folder"), "{err}");
    let err = fails(bin().args(["setup", "--full", "--from"]).arg(fixture()).arg("--out").arg(&readme));
    assert!(err.contains("that is a file; --out names the store's folder"), "{err}");
    let err = fails(bin().args(["doctor", "--model"]).arg(fixture()));
    assert!(err.contains("is a checkpoint folder, not a store") && err.contains("deltafin setup --full --from"), "{err}");
    let out = bin().args(["setup", "--from"]).arg(fixture()).arg("--out").arg(tmp.path().join("s")).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--full|--stream"), "setup without a mode names every mode: {err}");
    let err = fails(
        bin()
            .args(["setup", "--full", "--from"])
            .arg(fixture())
            .arg("--out")
            .arg(tmp.path().join("s"))
            .arg("--home")
            .arg(tmp.path().join("typo/ssd0")),
    );
    assert!(err.contains("does not exist") && err.contains("not mounted"), "{err}");
    assert!(!tmp.path().join("typo").exists(), "nothing was created on the wrong disk");
    let err = fails(
        bin()
            .args(["run", "--ids", PROMPT_IDS, "--max-new", "4", "--model"])
            .arg(fixture())
            .arg("--stats-json")
            .arg(tmp.path().join("no/such/stats.json")),
    );
    assert!(err.contains("--stats-json") && err.contains("does not exist") && !err.contains("stats.tmp"), "{err}");
}

#[test]
fn version_names_the_commit_and_threads_never_change_the_output() {
    let v = ok(bin().arg("--version"));
    let commit = v.split('(').nth(1).unwrap_or("").trim_end().trim_end_matches(')');
    let hex = commit.split(',').next().unwrap_or("");
    assert!(hex == "unknown commit" || (hex.len() == 12 && hex.chars().all(|c| c.is_ascii_hexdigit())), "{v}");
    let run = |threads: &str| {
        ok(bin().args(["-t", threads, "run", "--ids", PROMPT_IDS, "--max-new", "8", "--print-ids", "--model"]).arg(fixture()))
    };
    assert_eq!(run("1"), run("2"));
}

/// `--backend`: `cpu` and `auto` give the reference ids; `cuda` gives them too where a GPU can be
/// used, and elsewhere fails with the cause (never a silent CPU run); `selftest` holds a backend to
/// the CPU's bits and says what it compared.
#[test]
fn every_backend_choice_gives_the_reference_ids_or_says_why_not() {
    let f = fixture();
    let run = |backend: &str| {
        let mut c = bin();
        c.args(["run", "--model"]).arg(&f).args(["--ids", PROMPT_IDS, "--max-new", "16", "--print-ids", "--backend", backend]);
        c
    };
    for backend in ["cpu", "auto"] {
        assert_eq!(ok(&mut run(backend)).trim(), REFERENCE_GREEDY, "--backend {backend}");
    }
    let out = run("cuda").output().unwrap();
    if out.status.success() {
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), REFERENCE_GREEDY, "--backend cuda");
    } else {
        let err = fails(&mut run("cuda"));
        assert!(err.contains("--backend cuda:") && (err.contains("driver") || err.contains("device") || err.contains("NVRTC")), "{err}");
        assert!(out.stdout.is_empty(), "no token without the GPU asked for");
    }
    // (a usage error: clap's exit status 2)
    let out = bin().args(["run", "--model"]).arg(&f).args(["--ids", "1", "--backend", "gpu"]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("use cpu, cuda or auto"));
    let out = ok(bin().args(["selftest", "--backend", "cpu", "--prompt", "12", "--model"]).arg(&f));
    assert!(out.contains("9 cases") && out.contains("every one the CPU's bits"), "{out}");
}

/// Help puts what shapes the output first and what only changes the speed under its own
/// heading; options that cannot matter to a command are not offered.
#[test]
fn help_groups_options_and_drops_what_cannot_matter() {
    let help = ok(bin().args(["run", "--help"]));
    let (max_new, perf, budget) =
        (help.find("--max-new").unwrap(), help.find("Performance (never changes the output)").unwrap(), help.find("--ram-budget").unwrap());
    assert!(max_new < perf && perf < budget, "{help}");
    assert!(help.contains("Drafting (K3 verifies every draft") && help.contains("--backend"), "{help}");
    let help = ok(bin().args(["logits", "--help"]));
    assert!(!help.contains("--draft") && help.contains("--ids"), "{help}");
}

/// A port in use: the cause once, and what to do.
#[test]
fn serve_on_a_port_in_use_says_so_once_with_what_to_do() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let err = fails(bin().args(["serve", "--port", &port, "--model"]).arg(fixture()));
    assert!(err.contains("in use") && err.contains("--port"), "{err}");
    assert_eq!(err.matches("os error").count(), 0, "{err}");
}

/// `--echo` prints the prompt before the continuation; a chat reply cut by `--max-new` says so.
#[test]
fn echo_prints_the_prompt_and_a_cut_reply_says_so() {
    let f = fixture();
    let plain = ok(bin().args(["run", "--model"]).arg(&f).args(["--prompt", PROMPT_TEXT, "--max-new", "4"]));
    let echoed = ok(bin().args(["run", "--model"]).arg(&f).args(["--prompt", PROMPT_TEXT, "--max-new", "4", "--echo"]));
    assert_eq!(echoed, format!("{PROMPT_TEXT}{plain}"));
    let out = bin().args(["run", "--model"]).arg(&f).args(["--prompt", "hi", "--chat", "--max-new", "2"]).output().unwrap();
    assert!(out.status.success() && String::from_utf8_lossy(&out.stderr).contains("cut at --max-new 2"));
}

/// `-v` prints a run's stats without `--stats`; `-q` keeps notes off stderr.
#[test]
fn verbose_and_quiet_change_only_what_is_said() {
    let f = fixture();
    let run = |flag: &str| {
        bin()
            .arg(flag)
            .args(["run", "--model"])
            .arg(&f)
            .args(["--ids", PROMPT_IDS, "--max-new", "16", "--print-ids", "--chat"])
            .output()
            .unwrap()
    };
    let (v, q) = (run("-v"), run("-q"));
    assert!(v.status.success() && q.status.success());
    assert_eq!(v.stdout, q.stdout, "the output is the same");
    let (v, q) = (String::from_utf8_lossy(&v.stderr), String::from_utf8_lossy(&q.stderr));
    assert!(v.contains("TTFT") && v.contains("cut at --max-new"), "{v}");
    assert!(q.trim().is_empty(), "{q}");
}
