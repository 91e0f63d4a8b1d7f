//! Stream install against a loopback hub (`xtask::hub_emulator`) serving the tiny fixture in the
//! hub's URL layout: every run gives the ids of a full install or a clear error through dropped
//! bodies, wrong ranges, 200s, 5xx, 429s and stalls; no byte that fails the hub's hash is used;
//! a killed setup resumes; the disk budget holds. Issue 46: bytes corrupted once in transit in a
//! spine tensor or an expert of a large shard are never computed with silently: runs count the
//! bytes no published hash has covered yet, `--verified-only` checks every shard first and
//! repairs what was corrupted, completing a shard repairs it too, naming the part; a hub that
//! ignores `Range` still serves a store.

use std::path::{Path, PathBuf};
use std::time::Duration;

use deltafin_fetch::HubConfig;
use deltafin_sched::{EngineBuilder, GenerateOptions};
use deltafin_store::{setup_stream, NoProgress, StreamOptions, CACHE_DIR};
use xtask::hub_emulator::HubEmulator;

const REPO: &str = "moonshotai/Kimi-K3-tiny";

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-k3-dev/checkpoint")
}

/// A byte inside the first expert of `shard` (of the fixture).
fn inside_an_expert(shard: &str) -> u64 {
    let ckpt = deltafin_store::Checkpoint::open(&fixture()).unwrap();
    let moe = ckpt.config().moe_layers();
    moe.iter()
        .flat_map(|&l| ckpt.expert_spans(l).unwrap().1)
        .find(|s| s.file.file_name().unwrap().to_string_lossy() == shard)
        .map(|s| s.offset + 100)
        .expect("an expert in that shard")
}

fn prompt() -> Vec<u32> {
    (0..12).map(|i| (i * 71 + 5) % 1000).collect()
}

fn ids(model: &Path, budget: Option<u64>) -> Result<Vec<u32>, String> {
    generate(model, budget, false).map(|(ids, _)| ids)
}

/// The ids of an 8-token generation and the bytes it computed with that no published hash had
/// covered, opened with `--verified-only` or not.
fn generate(model: &Path, budget: Option<u64>, verified_only: bool) -> Result<(Vec<u32>, u64), String> {
    let m = EngineBuilder::new(model).ram_budget(budget).verified_only(verified_only).open().map_err(|e| e.to_string())?;
    let mut seq = m.new_sequence();
    let mut out = Vec::new();
    let stats = m
        .engine()
        .generate(&mut seq, &prompt(), &GenerateOptions::new(8), |t| {
            out.push(t);
            true
        })
        .map_err(|e| e.to_string())?;
    Ok((out, stats.unverified_bytes))
}

/// Options for `hub` with quick retries and a short stall limit.
fn options(hub: &HubEmulator, out: &Path, whole_shard_max: u64) -> StreamOptions {
    let mut o = StreamOptions::new(format!("hf://{REPO}"), out);
    let mut cfg = HubConfig::from_env();
    cfg.endpoint = hub.endpoint.clone();
    cfg.offline = false;
    cfg.stall = Duration::from_millis(500);
    cfg.retry.base = Duration::from_millis(10);
    o.hub = cfg;
    o.whole_shard_max = whole_shard_max;
    o
}

fn cached_files(store: &Path) -> usize {
    walk(&store.join(CACHE_DIR)).iter().filter(|p| !p.to_string_lossy().ends_with(".partial")).count()
}

fn walk(d: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
        if e.file_type().unwrap().is_dir() {
            v.extend(walk(&e.path()));
        } else {
            v.push(e.path());
        }
    }
    v
}

#[test]
fn streamed_experts_give_the_ids_of_a_full_install_through_faults() {
    let want = ids(&fixture(), None).unwrap();
    let hub = HubEmulator::start(&fixture(), REPO).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    // Large-shard mode everywhere: experts are fetched one by one at run time.
    for (name, whole) in [("per-expert", 0u64), ("whole-shards", u64::MAX)] {
        let store = tmp.path().join(name);
        hub.faults(|f| {
            f.drop_mid_body = 2;
            f.wrong_content_range = 1;
            f.full_200 = 1;
            f.server_error = 2;
            f.too_many_requests = 1;
            f.stall = 1;
            f.stall_for = Duration::from_secs(2);
        });
        setup_stream(&options(&hub, &store, whole), &NoProgress).unwrap();
        assert_eq!(cached_files(&store), 0, "{name}: no expert is fetched at setup");
        hub.faults(|f| {
            f.drop_mid_body = 3;
            f.server_error = 1;
            f.wrong_content_range = 1;
            f.full_200 = 1;
        });
        assert_eq!(ids(&store, Some(64 << 20)).unwrap(), want, "{name}: first (cold) run");
        let fetched = cached_files(&store);
        assert!(whole > 0 || fetched > 0, "{name}: experts were cached");
        // Warm: nothing more is fetched.
        let before = hub.stats().range_requests.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(ids(&store, Some(64 << 20)).unwrap(), want, "{name}: warm run");
        assert_eq!(hub.stats().range_requests.load(std::sync::atomic::Ordering::Relaxed), before, "{name}: a warm run fetched");
    }
}

#[test]
fn a_corrupt_small_shard_is_refused_at_setup_and_refetched_on_the_next_run() {
    let hub = HubEmulator::start(&fixture(), REPO).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("s");
    hub.faults(|f| {
        f.corrupt.insert("model-00001-of-000004.safetensors".into(), inside_an_expert("model-00001-of-000004.safetensors"));
    });
    let err = setup_stream(&options(&hub, &store, u64::MAX), &NoProgress).unwrap_err().to_string();
    assert!(err.contains("model-00001-of-000004.safetensors") && err.contains("SHA-256"), "{err}");
    assert!(EngineBuilder::new(&store).open().is_err(), "an unfinished store does not open");
    hub.faults(|f| f.corrupt.clear());
    setup_stream(&options(&hub, &store, u64::MAX), &NoProgress).unwrap();
    assert_eq!(ids(&store, None).unwrap(), ids(&fixture(), None).unwrap());
}

#[test]
fn a_corrupt_large_shard_is_caught_when_it_completes_and_nothing_of_it_stays() {
    let hub = HubEmulator::start(&fixture(), REPO).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("s");
    setup_stream(&options(&hub, &store, 0), &NoProgress).unwrap();
    hub.faults(|f| {
        f.corrupt.insert("model-00002-of-000004.safetensors".into(), inside_an_expert("model-00002-of-000004.safetensors"));
    });
    let err = deltafin_store::Store::open(&store).unwrap().hub_cache().unwrap().fill(&NoProgress).unwrap_err().to_string();
    assert!(err.contains("model-00002-of-000004.safetensors") && err.contains("SHA-256"), "{err}");
    let left = walk(&store.join(CACHE_DIR).join("model-00002-of-000004.safetensors"));
    assert!(left.is_empty(), "experts of the failed shard stayed: {left:?}");
    // Served right, the fill completes and the store gives the full install's ids offline.
    hub.faults(|f| f.corrupt.clear());
    let cache = deltafin_store::Store::open(&store).unwrap().hub_cache().unwrap();
    cache.fill(&NoProgress).unwrap();
    assert!(cache.stats.shards_verified.load(std::sync::atomic::Ordering::Relaxed) >= 1);
    drop(hub);
    assert_eq!(ids(&store, None).unwrap(), ids(&fixture(), None).unwrap(), "a filled store runs with the hub gone");
}

#[test]
fn the_disk_budget_holds_and_evicted_experts_come_back() {
    let hub = HubEmulator::start(&fixture(), REPO).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("s");
    let mut o = options(&hub, &store, 0);
    let expert = deltafin_store::Store::open(&{
        setup_stream(&o, &NoProgress).unwrap();
        store.clone()
    })
    .unwrap()
    .config()
    .expert_shape()
    .total_bytes() as u64;
    // Room for five experts on disk.
    o.disk_budget = Some(5 * expert);
    o.reinstall = false;
    std::fs::remove_dir_all(&store).unwrap();
    setup_stream(&o, &NoProgress).unwrap();
    let want = ids(&fixture(), None).unwrap();
    for _ in 0..2 {
        assert_eq!(ids(&store, Some(64 << 20)).unwrap(), want);
        let bytes: u64 = walk(&store.join(CACHE_DIR)).iter().map(|p| std::fs::metadata(p).unwrap().len()).sum();
        assert!(bytes <= 5 * expert, "the cache holds {bytes} bytes, budget {}", 5 * expert);
    }
}

#[test]
fn a_killed_setup_resumes_and_a_signed_url_that_expires_is_renewed() {
    let hub = HubEmulator::start(&fixture(), REPO).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("s");
    // Every body is cut: setup gives up with a clear error, leaving partial files behind.
    hub.faults(|f| f.server_error = 1000);
    let mut o = options(&hub, &store, 0);
    o.hub.retry.attempts = 3;
    let err = setup_stream(&o, &NoProgress).unwrap_err().to_string();
    assert!(err.contains("gave up after 3 attempts") && err.contains("503"), "{err}");
    hub.faults(|f| {
        f.server_error = 0;
        f.signed_uses = Some(2);
    });
    setup_stream(&options(&hub, &store, 0), &NoProgress).unwrap();
    assert_eq!(ids(&store, Some(64 << 20)).unwrap(), ids(&fixture(), None).unwrap());
    assert!(hub.stats().resolves.load(std::sync::atomic::Ordering::Relaxed) > 2, "expired signed URLs were renewed");
}

#[test]
fn every_shard_of_a_generated_checkpoint_verifies_once_filled() {
    // Generated weights everywhere, the vision tower included: the skeletons must hold every
    // byte that is not an expert's, or no shard could match its SHA-256.
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    xtask::gen_k3::generate("tiny", 3, &ckpt).unwrap();
    let hub = HubEmulator::start(&ckpt, REPO).unwrap();
    let store = tmp.path().join("s");
    setup_stream(&options(&hub, &store, 0), &NoProgress).unwrap();
    let cache = deltafin_store::Store::open(&store).unwrap().hub_cache().unwrap();
    let shards: std::collections::BTreeSet<String> = cache.streamed().into_iter().map(|e| e.0).collect();
    cache.fill(&NoProgress).unwrap();
    use std::sync::atomic::Ordering::Relaxed;
    assert_eq!(cache.stats.shards_verified.load(Relaxed), shards.len() as u64);
    assert_eq!(cache.stats.shard_mismatches.load(Relaxed), 0);
    drop(cache);
    assert_eq!(ids(&store, None).unwrap(), ids(&ckpt, None).unwrap());
}

#[test]
fn a_split_range_is_fetched_as_parts_side_by_side_and_reassembled_exactly() {
    let hub = HubEmulator::start(&fixture(), REPO).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = options(&hub, tmp.path(), 0).hub;
    let remote = deltafin_fetch::Hub::open(cfg, &deltafin_fetch::RepoRef::parse(&format!("hf://{REPO}")).unwrap()).unwrap();
    let shard = "model-00001-of-000004.safetensors";
    let want = std::fs::read(fixture().join(shard)).unwrap();
    let (offset, len) = (1000u64, want.len() - 2000);
    assert!(len >= 3 * deltafin_fetch::SPLIT_MIN, "the fixture shard is large enough to split");
    let requests = || hub.stats().range_requests.load(std::sync::atomic::Ordering::Relaxed);
    let before = requests();
    let mut got = vec![0u8; len];
    remote.fetch_range_split(shard, offset, &mut got, deltafin_fetch::Priority::Demand).unwrap();
    assert!(got == want[1000..1000 + len], "split parts reassemble the range exactly");
    assert_eq!(requests() - before, (len / deltafin_fetch::SPLIT_MIN) as u64, "one request per part");
    // A part that fails mid-body is resumed; the rest are unaffected.
    hub.faults(|f| {
        f.drop_mid_body = 2;
        f.wrong_content_range = 1;
    });
    let mut again = vec![0u8; len];
    remote.fetch_range_split(shard, offset, &mut again, deltafin_fetch::Priority::Demand).unwrap();
    assert!(again == got, "through faults");
}

#[test]
fn a_background_fill_completes_the_store_while_it_runs_and_stops_at_the_disk_budget() {
    use std::sync::atomic::Ordering::Relaxed;
    let want = ids(&fixture(), None).unwrap();
    let expert = deltafin_store::Checkpoint::open(&fixture()).unwrap().config().expert_shape().total_bytes() as u64;
    let hub = HubEmulator::start(&fixture(), REPO).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    for budget in [None, Some(5usize)] {
        let store = tmp.path().join(format!("{budget:?}"));
        let mut o = options(&hub, &store, 0);
        o.disk_budget = budget.map(|n| n as u64 * expert);
        setup_stream(&o, &NoProgress).unwrap();
        let streamed = deltafin_store::Store::open(&store).unwrap().hub_cache().unwrap().streamed().len();
        let target = budget.unwrap_or(streamed);
        let m = EngineBuilder::new(&store).ram_budget(Some(64 << 20)).background_fill(true).open().unwrap();
        let mut seq = m.new_sequence();
        let mut got = Vec::new();
        m.engine()
            .generate(&mut seq, &prompt(), &GenerateOptions::new(8), |t| {
                got.push(t);
                true
            })
            .unwrap();
        assert_eq!(got, want, "{budget:?}: a run beside the fill");
        // The fill goes on while the engine is open, and ends at the store's size or its budget.
        let start = std::time::Instant::now();
        while cached_files(&store) < target && start.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(cached_files(&store), target, "{budget:?}: cached after the fill");
        drop(m);
        if budget.is_none() {
            // A filled store fetches nothing more.
            let before = hub.stats().range_requests.load(Relaxed);
            assert_eq!(ids(&store, Some(64 << 20)).unwrap(), want);
            assert_eq!(hub.stats().range_requests.load(Relaxed), before, "a filled store fetched");
        }
    }
}

#[test]
fn a_stream_cache_spreads_over_its_homes() {
    use std::sync::atomic::Ordering::Relaxed;
    let want = ids(&fixture(), None).unwrap();
    let hub = HubEmulator::start(&fixture(), REPO).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("s");
    let homes = [tmp.path().join("ssd0"), tmp.path().join("ssd1")];
    let mut o = options(&hub, &store, 0);
    o.homes = homes.to_vec();
    o.fill = true;
    setup_stream(&o, &NoProgress).unwrap();
    let streamed = deltafin_store::Store::open(&store).unwrap().hub_cache().unwrap().streamed().len();
    let per_home: Vec<usize> = homes.iter().map(|h| walk(h).len()).collect();
    assert_eq!(per_home.iter().sum::<usize>(), streamed, "{per_home:?}");
    assert!(per_home.iter().all(|&n| n >= streamed / 4), "uneven spread {per_home:?}");
    assert_eq!(cached_files(&store), 0, "nothing cached in the store's own folder");
    let before = hub.stats().range_requests.load(Relaxed);
    assert_eq!(ids(&store, Some(64 << 20)).unwrap(), want);
    assert_eq!(hub.stats().range_requests.load(Relaxed), before, "a filled store fetched");
}

/// The shard the integrity tests corrupt (it holds spine tensors and experts).
const STREAMED_SHARD: &str = "model-00001-of-000004.safetensors";

/// The offset of a spine tensor of [`STREAMED_SHARD`] that every token uses (layer 0's attention).
fn spine_offset() -> (String, u64) {
    let ckpt = deltafin_store::Checkpoint::open(&fixture()).unwrap();
    let name = ckpt
        .tensors()
        .iter()
        .filter(|(n, t)| t.shard == 0 && n.contains("layers.0.self_attn") && n.ends_with("proj.weight") && t.len >= 4096)
        .map(|(n, _)| n.clone())
        .min()
        .expect("a projection of layer 0 in the first shard");
    let t = &ckpt.tensors()[&name];
    (name, t.offset + t.len / 2)
}

#[test]
fn spine_bytes_corrupted_in_transit_are_counted_then_verified_and_repaired() {
    let want = ids(&fixture(), None).unwrap();
    let hub = HubEmulator::start(&fixture(), REPO).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("s");
    let (tensor, at) = spine_offset();
    hub.faults(|f| {
        f.corrupt_once.insert(STREAMED_SHARD.into(), (at, 1));
    });
    setup_stream(&options(&hub, &store, 0), &NoProgress).unwrap();
    let skeleton = store.join(deltafin_store::HUB_DIR).join(STREAMED_SHARD);
    let byte_at = |p: &Path| std::fs::read(p).unwrap()[at as usize..at as usize + 16].to_vec();
    assert_ne!(byte_at(&skeleton), byte_at(&fixture().join(STREAMED_SHARD)), "the corruption landed in the skeleton");
    // A plain run computes with the unchecked skeleton: whatever its ids, it says so.
    if let Ok((_, unverified)) = generate(&store, None, false) {
        assert!(unverified > 0, "a run on a store with unchecked shards reports the bytes it used");
    }
    // --verified-only checks every shard first: the mismatch is found, the shard fetched again,
    // the tensor repaired in the skeleton, and only then does the engine compute.
    let (ids, unverified) = generate(&store, None, true).unwrap();
    assert_eq!(ids, want, "{tensor} repaired before use");
    assert_eq!(unverified, 0);
    assert_eq!(byte_at(&skeleton), byte_at(&fixture().join(STREAMED_SHARD)), "{tensor} repaired in the skeleton");
    // From now on a plain run is verified too, and stays so with the hub gone.
    drop(hub);
    let (ids, unverified) = generate(&store, None, false).unwrap();
    assert_eq!((ids, unverified), (want, 0));
}

#[test]
fn an_expert_corrupted_in_transit_is_named_and_repaired_when_its_shard_completes() {
    let want = ids(&fixture(), None).unwrap();
    let hub = HubEmulator::start(&fixture(), REPO).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("s");
    setup_stream(&options(&hub, &store, 0), &NoProgress).unwrap();
    hub.faults(|f| {
        f.corrupt_once.insert(STREAMED_SHARD.into(), (inside_an_expert(STREAMED_SHARD), 1));
    });
    // The first fill fetches the bad bytes, completes the shard, finds the mismatch, fetches the
    // shard again and repairs the expert; it fails naming it.
    let cache = deltafin_store::Store::open(&store).unwrap().hub_cache().unwrap();
    let err = cache.fill(&NoProgress).unwrap_err().to_string();
    assert!(err.contains("the expert at offset") && err.contains(STREAMED_SHARD) && err.contains("corrupted in transit"), "{err}");
    drop(cache);
    let (ids, unverified) = generate(&store, None, false).unwrap();
    assert_eq!((ids, unverified), (want.clone(), 0), "repaired and verified");
    // A cached expert damaged on disk after the check is caught against the recorded xxh3 and
    // fetched again.
    let cache_dir = store.join(deltafin_store::CACHE_DIR).join(STREAMED_SHARD);
    let victim = std::fs::read_dir(&cache_dir).unwrap().next().unwrap().unwrap().path();
    let mut bytes = std::fs::read(&victim).unwrap();
    bytes[10] ^= 1;
    std::fs::write(&victim, bytes).unwrap();
    assert_eq!(generate(&store, None, false).unwrap(), (want, 0));
}

#[test]
fn a_store_under_a_disk_budget_is_verified_by_streaming_its_shards() {
    let want = ids(&fixture(), None).unwrap();
    let hub = HubEmulator::start(&fixture(), REPO).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("s");
    let mut o = options(&hub, &store, 0);
    // Far below a shard: no shard ever completes on disk.
    o.disk_budget = Some(1 << 20);
    setup_stream(&o, &NoProgress).unwrap();
    let (ids, unverified) = generate(&store, None, false).unwrap();
    assert_eq!(ids, want);
    assert!(unverified > 0);
    let (ids, unverified) = generate(&store, None, true).unwrap();
    assert_eq!((ids, unverified), (want, 0), "checked by streaming, within the disk budget");
    let on_disk: u64 = walk(&store.join(deltafin_store::CACHE_DIR)).iter().map(|p| std::fs::metadata(p).unwrap().len()).sum();
    assert!(on_disk <= 1 << 20, "the check kept {on_disk} bytes, over the 1 MiB disk budget");
}

#[test]
fn a_hub_that_ignores_range_still_serves_a_store() {
    let want = ids(&fixture(), None).unwrap();
    let hub = HubEmulator::start(&fixture(), REPO).unwrap();
    hub.faults(|f| f.ignore_range = true);
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("s");
    setup_stream(&options(&hub, &store, 0), &NoProgress).unwrap();
    assert_eq!(generate(&store, None, true).unwrap(), (want, 0));
}

#[test]
fn a_server_that_ignores_range_is_read_through_near_the_start_and_refused_far_in() {
    // A 70 MiB file (sparse: holes read as zeros) with marks near its start and far in.
    let root = tempfile::tempdir().unwrap();
    let big = root.path().join("big.bin");
    let f = std::fs::File::create(&big).unwrap();
    f.set_len(70 << 20).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, b"near the start", 1000).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, b"far in", 66 << 20).unwrap();
    drop(f);
    let hub = HubEmulator::start(root.path(), REPO).unwrap();
    hub.faults(|f| f.ignore_range = true);
    let cfg = options(&hub, root.path(), 0).hub;
    let remote = deltafin_fetch::Hub::open(cfg, &deltafin_fetch::RepoRef::parse(&format!("hf://{REPO}")).unwrap()).unwrap();
    let mut near = vec![0u8; 14];
    remote.fetch_range("big.bin", 1000, &mut near, deltafin_fetch::Priority::Demand).unwrap();
    assert_eq!(&near, b"near the start", "a 200 with the whole file is read through to the range");
    let mut far = vec![0u8; 6];
    let err = remote.fetch_range("big.bin", 66 << 20, &mut far, deltafin_fetch::Priority::Demand).unwrap_err().to_string();
    assert!(err.contains("ignores Range") && err.contains("setup --full"), "{err}");
    // The same server honouring ranges again serves the far range.
    hub.faults(|f| f.ignore_range = false);
    remote.fetch_range("big.bin", 66 << 20, &mut far, deltafin_fetch::Priority::Demand).unwrap();
    assert_eq!(&far, b"far in");
}
