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
