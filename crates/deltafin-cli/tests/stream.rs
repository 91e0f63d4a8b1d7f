//! `deltafin setup --stream` end to end against a loopback hub: the store runs with the reference
//! ids, shows its cache in `doctor`, refuses clearly offline for what it lacks, and after `--fill`
//! runs offline with the hub gone.

mod common;

use common::*;
use xtask::hub_emulator::HubEmulator;

#[test]
fn a_stream_store_runs_fetches_on_use_and_fills() {
    let hub = HubEmulator::start(&fixture(), "moonshotai/Kimi-K3-tiny").unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let setup = |extra: &[&str], offline: bool| {
        let mut c = bin();
        c.args(["setup", "--stream", "--from", "hf://moonshotai/Kimi-K3-tiny@main", "--out"])
            .arg(&store)
            .args(extra)
            .env("HF_ENDPOINT", &hub.endpoint)
            .env_remove("HF_TOKEN");
        if offline {
            c.env("HF_HUB_OFFLINE", "1");
        }
        c.output().unwrap()
    };
    let run = |offline: bool| {
        let mut c = bin();
        c.args(["run", "--model"]).arg(&store).args(["--ids", PROMPT_IDS, "--max-new", "16", "--print-ids", "--ram-budget", "64M"]);
        if offline {
            c.env("HF_HUB_OFFLINE", "1");
        }
        c.output().unwrap()
    };
    // Shards this small are downloaded whole at setup: stream every expert instead.
    let o = setup(&["--whole-shard-max", "0"], false);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("layout stream"), "{err}");
    let o = run(false);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), REFERENCE_GREEDY);
    let o = bin().args(["doctor", "--model"]).arg(&store).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("streamed experts cached"), "{err}");
    // What the run fetched is cached: the same run works offline.
    let o = run(true);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), REFERENCE_GREEDY);
    // Refusals say what to do.
    let o = bin().args(["setup", "--stream", "--from", "moonshotai/Kimi-K3", "--out"]).arg(tmp.path().join("x")).output().unwrap();
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("hf://OWNER/REPO"));
    let o = bin().args(["setup", "--full", "--from", "hf://a/b", "--out"]).arg(tmp.path().join("y")).output().unwrap();
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--stream"));
    // A second store, offline from the start: nothing to fetch, a clear error.
    let o = bin()
        .args(["setup", "--stream", "--from", "hf://moonshotai/Kimi-K3-tiny", "--out"])
        .arg(tmp.path().join("offline"))
        .env("HF_ENDPOINT", &hub.endpoint)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("HF_HUB_OFFLINE"), "{err}");
    // Filled, the store runs with the hub gone.
    let o = setup(&["--whole-shard-max", "0", "--fill"], false);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    drop(hub);
    let o = run(true);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), REFERENCE_GREEDY);
}

/// Kills `cmd` once it has run for `after`, and waits for it.
fn kill_after(cmd: &mut std::process::Command, after: std::time::Duration) -> bool {
    let mut child = cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().unwrap();
    std::thread::sleep(after);
    let running = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    running
}

#[test]
fn killed_setup_and_run_resume_and_warm_fetches_what_a_workload_routes() {
    let hub = HubEmulator::start(&fixture(), "moonshotai/Kimi-K3-tiny").unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let setup = || {
        let mut c = bin();
        c.args(["setup", "--stream", "--from", "hf://moonshotai/Kimi-K3-tiny@main", "--whole-shard-max", "0", "--out"])
            .arg(&store)
            .env("HF_ENDPOINT", &hub.endpoint)
            .env_remove("HF_HUB_OFFLINE");
        c
    };
    let run = |offline: bool| {
        let mut c = bin();
        c.args(["run", "--model"]).arg(&store).args(["--prompt", PROMPT_TEXT, "--max-new", "16", "--print-ids", "--ram-budget", "64M"]);
        c.env("HF_ENDPOINT", &hub.endpoint);
        if offline {
            c.env("HF_HUB_OFFLINE", "1");
        } else {
            c.env_remove("HF_HUB_OFFLINE");
        }
        c
    };
    // Slow enough that the kill lands mid-transfer.
    hub.faults(|f| f.rate = 200_000);
    assert!(kill_after(&mut setup(), std::time::Duration::from_millis(1500)), "setup finished before it could be killed");
    hub.faults(|f| f.rate = 0);
    ok(&mut setup());
    hub.faults(|f| f.rate = 100_000);
    assert!(kill_after(&mut run(false), std::time::Duration::from_millis(1500)), "the run finished before it could be killed");
    hub.faults(|f| f.rate = 0);
    let first = ok(&mut run(false));
    // A plain full install of the same checkpoint gives the same ids.
    let full = tmp.path().join("full");
    ok(bin().args(["setup", "--full", "--from"]).arg(fixture()).arg("--out").arg(&full));
    let want = ok(bin().args(["run", "--model"]).arg(&full).args(["--prompt", PROMPT_TEXT, "--max-new", "16", "--print-ids"]));
    assert_eq!(first, want);

    // A second, fresh store warmed with a workload's prompt then runs that workload offline.
    std::fs::remove_dir_all(&store).unwrap();
    ok(&mut setup());
    let prompts = tmp.path().join("prompts.txt");
    std::fs::write(&prompts, format!("\n{PROMPT_TEXT}\n\n")).unwrap();
    let o = bin()
        .args(["warm", "--model"])
        .arg(&store)
        .args(["--max-new", "16", "--prompts"])
        .arg(&prompts)
        .env("HF_ENDPOINT", &hub.endpoint)
        .env_remove("HF_HUB_OFFLINE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("1 prompts") && err.contains("now cached"), "{err}");
    assert_eq!(ok(&mut run(true)), want);
    // Warm refuses a full store, saying why.
    let o = bin().args(["warm", "--model"]).arg(&full).arg("--prompts").arg(&prompts).output().unwrap();
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("not a stream store"));
}

/// Issue 46: a spine tensor corrupted once in transit. Runs say they computed with unchecked
/// bytes; `doctor --verify` on the healthy-looking store lists the unchecked shards without false
/// problems (no `inplace-L00x.json: sidecar missing`); `doctor --repair` checks every shard against
/// the hub's SHA-256 and repairs the tensor; afterwards runs print the reference ids, verified.
#[test]
fn a_spine_tensor_corrupted_in_transit_is_reported_and_repaired_by_doctor() {
    let shard = "model-00001-of-000004.safetensors";
    let ckpt = deltafin_store::Checkpoint::open(&fixture()).unwrap();
    let t = ckpt
        .tensors()
        .iter()
        .filter(|(n, t)| t.shard == 0 && n.contains("layers.0.self_attn") && n.ends_with("proj.weight") && t.len >= 4096)
        .min_by_key(|(n, _)| n.to_string())
        .map(|(_, t)| t.clone())
        .unwrap();
    let hub = HubEmulator::start(&fixture(), "moonshotai/Kimi-K3-tiny").unwrap();
    hub.faults(|f| {
        f.corrupt_once.insert(shard.into(), (t.offset + t.len / 2, 1));
    });
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let with_hub = |c: &mut std::process::Command| {
        c.env("HF_ENDPOINT", &hub.endpoint).env_remove("HF_TOKEN").env_remove("HF_HUB_OFFLINE");
    };
    let mut c = bin();
    c.args(["setup", "--stream", "--from", "hf://moonshotai/Kimi-K3-tiny", "--whole-shard-max", "0", "--out"]).arg(&store);
    with_hub(&mut c);
    ok(&mut c);
    let run = |extra: &[&str]| {
        let mut c = bin();
        c.args(["run", "--model"]).arg(&store).args(["--ids", PROMPT_IDS, "--max-new", "16", "--print-ids"]).args(extra);
        with_hub(&mut c);
        c.output().unwrap()
    };
    let o = run(&[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() || err.contains("hub's SHA-256 has not covered yet"), "an unchecked run says so: {err}");
    let mut c = bin();
    c.args(["doctor", "--verify", "--model"]).arg(&store);
    with_hub(&mut c);
    let o = c.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && !err.contains("sidecar missing"), "{err}");
    assert!(err.contains("not yet checked against the hub's SHA-256") && err.contains(shard), "{err}");
    let mut c = bin();
    c.args(["doctor", "--repair", "--model"]).arg(&store);
    with_hub(&mut c);
    let o = c.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("repaired before use") && err.contains("spine tensor"), "{err}");
    assert!(!err.contains("not yet checked"), "every shard checked: {err}");
    let o = run(&[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && !err.contains("not covered yet"), "{err}");
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), REFERENCE_GREEDY);
}
