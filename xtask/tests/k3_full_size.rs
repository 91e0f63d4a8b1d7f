//! The real K3 layout at full size (`gen-k3 --preset k3 --sparse`): 96 shards, 497,220 tensors,
//! 1.56 TB of (zero, unwritten) weights. Written in seconds at almost no disk cost, and opened the
//! way a downloaded K3 is: every header parsed, all 82,432 expert spans found contiguous, the
//! spine lent from memory maps without being read; then set up in place (nothing copied) and run
//! for one pass under a 16 GB budget, most of the spine streamed, and with no budget: the same
//! ids, the budgeted run's peak RSS within its budget; then Kimi K3.1's full layout the same way
//! under the budget. (A few minutes: every pass reads 100+ GB of holes as zeros.)

use std::os::unix::fs::MetadataExt;
use std::time::Instant;

use deltafin_sched::{EngineBuilder, GenerateOptions};
use deltafin_store::Checkpoint;
use xtask::gen_k3::{generate_with, K3_BYTES, K3_SHARDS, K3_TENSORS};

#[test]
fn the_full_k3_layout_is_written_sparse_and_opens_like_the_release() {
    std::env::set_var("DELTAFIN_QUIET", "1");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("k3");
    let t = Instant::now();
    generate_with("k3", 0, &dir, true).unwrap();
    eprintln!("gen-k3 --preset k3 --sparse: {:.1} s", t.elapsed().as_secs_f64());

    let mut shards: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    shards.sort();
    assert_eq!(shards.len(), K3_SHARDS);
    assert_eq!(shards[0], "model-00001-of-000096.safetensors");
    assert_eq!(shards[95], "model-00096-of-000096.safetensors");
    let (mut apparent, mut on_disk) = (0u64, 0u64);
    for e in std::fs::read_dir(&dir).unwrap() {
        let m = e.unwrap().metadata().unwrap();
        apparent += m.len();
        on_disk += m.blocks() * 512;
    }
    assert!(apparent > K3_BYTES, "{apparent}");
    assert!(on_disk < 1 << 30, "the sparse K3 takes {on_disk} bytes of disk");

    let t = Instant::now();
    let ckpt = Checkpoint::open(&dir).unwrap();
    eprintln!("opened (96 shard headers) in {:.1} s", t.elapsed().as_secs_f64());
    let t = Instant::now();
    let cfg = ckpt.config();
    assert_eq!((cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.vocab_size), (93, 7168, 896, 163_840));
    assert_eq!(ckpt.tensors().len(), K3_TENSORS);
    let bytes: u64 = ckpt.tensors().values().map(|t| t.len).sum();
    assert_eq!(bytes, K3_BYTES);
    let mut experts = 0;
    for l in cfg.moe_layers() {
        let (_, spans) = ckpt.expert_spans(l).unwrap();
        assert!(spans.iter().all(|s| s.len == 17_547_264));
        experts += spans.len();
    }
    assert_eq!(experts, 82_432);
    eprintln!("82,432 expert spans in {:.1} s", t.elapsed().as_secs_f64());
    let t = Instant::now();
    ckpt.validate().unwrap();
    eprintln!("validated in {:.1} s", t.elapsed().as_secs_f64());
}

/// One token from `prompt` on `model` (a budget streams most of the spine).
fn one_token(model: &std::path::Path, budget: Option<u64>) -> (Vec<u32>, u64, usize) {
    let m = EngineBuilder::new(model).ram_budget(budget).context(64).open().unwrap();
    let streamed = m.memory_plan().map_or(0, |p| p.streamed_layers);
    let mut seq = m.new_sequence();
    let mut ids = Vec::new();
    let stats = m
        .engine()
        .generate(&mut seq, &[1, 2], &GenerateOptions::new(1), |t| {
            ids.push(t);
            true
        })
        .unwrap();
    (ids, stats.peak_rss_bytes, streamed)
}

#[test]
fn full_size_k3_runs_in_place_under_16_gb_with_the_ids_of_an_unbudgeted_run() {
    std::env::set_var("DELTAFIN_QUIET", "1");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("k3");
    generate_with("k3", 0, &dir, true).unwrap();
    let store = tmp.path().join("store");
    let t = Instant::now();
    deltafin_store::setup(
        &deltafin_store::SetupOptions::new(&dir, &store).layout(deltafin_store::ExpertLayoutKind::InPlace),
        &deltafin_store::NoProgress,
    )
    .unwrap();
    eprintln!("setup --in-place: {:.1} s", t.elapsed().as_secs_f64());
    let store_bytes: u64 = std::fs::read_dir(&store).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
    assert!(store_bytes < 100 << 20, "the in-place store copied the model: {store_bytes} bytes");
    let budget = 16_000_000_000;
    let t = Instant::now();
    let (budgeted, peak, streamed) = one_token(&store, Some(budget));
    eprintln!("16 GB budget: {streamed} layers streamed, {:.0} s, peak RSS {:.1} GB", t.elapsed().as_secs_f64(), peak as f64 / 1e9);
    assert!(streamed > 40, "most of the 113 GB spine streams under 16 GB: {streamed} layers");
    assert!(peak <= budget, "peak RSS {peak} over the budget");
    std::fs::remove_dir_all(&store).unwrap();

    // Kimi K3.1 at full size (issue 52): K3 plus an indexer on each of the 24 MLA layers. Run
    // after K3's budgeted run, not beside it (two 16 GB runs at once would not fit the machine),
    // and before the unbudgeted one, whose mapped spine would set the process's peak.
    let k31 = tmp.path().join("k31");
    generate_with("k31", 0, &k31, true).unwrap();
    let ckpt = Checkpoint::open(&k31).unwrap();
    let ix = ckpt.config().indexer.clone().expect("kimi_k31 has an indexer");
    assert_eq!((ix.topk, ix.heads, ix.head_dim), (2048, 32, 128));
    let indexer_bytes = 2 * (4096 * 1536 + 128 * 7168 + 32 * 7168 + 2 * 128);
    assert_eq!(ckpt.tensors().len(), K3_TENSORS + 24 * 5);
    assert_eq!(ckpt.tensors().values().map(|t| t.len).sum::<u64>(), K3_BYTES + 24 * indexer_bytes);
    drop(ckpt);
    let store = tmp.path().join("store31");
    deltafin_store::setup(
        &deltafin_store::SetupOptions::new(&k31, &store).layout(deltafin_store::ExpertLayoutKind::InPlace),
        &deltafin_store::NoProgress,
    )
    .unwrap();
    // This run's own peak, where the kernel allows resetting the high-water mark.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let t = Instant::now();
    let (k31_ids, peak, streamed) = one_token(&store, Some(budget));
    eprintln!("K3.1, 16 GB budget: {streamed} layers streamed, {:.0} s, peak RSS {:.1} GB", t.elapsed().as_secs_f64(), peak as f64 / 1e9);
    assert!(streamed > 40 && peak <= budget, "{streamed} layers streamed, peak RSS {peak}");
    // Two tokens of context: K3.1's attention is K3's dense one, so are the ids.
    assert_eq!(k31_ids, budgeted);
    std::fs::remove_dir_all(&k31).unwrap();

    let t = Instant::now();
    let (mapped, peak, _) = one_token(&dir, None);
    // The process's peak so far: the mapped spine's pages count as resident.
    eprintln!("no budget (mapped): {:.0} s, peak RSS {:.1} GB", t.elapsed().as_secs_f64(), peak as f64 / 1e9);
    assert_eq!(budgeted, mapped);
}
