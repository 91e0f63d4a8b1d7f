//! The reader under churn: guesses issued, cancelled as stale and demanded again while parts of
//! the cancelled reads are still queued or running, on several slow drives, with a budget tight
//! enough that guesses are dropped for room. Every demand must be answered with the right bytes
//! (a lost part would leave the engine waiting forever: here, a timeout).

use std::path::{Path, PathBuf};
use std::time::Duration;

use deltafin_store::{
    checksum, setup, CacheMode, CachePolicy, ExpertLayoutKind, ExpertSource, NoProgress, Priority, ReaderOptions, SetupOptions, Store,
};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-k3-dev/checkpoint")
}

fn make_store(dir: &Path, homes: usize) -> PathBuf {
    let out = dir.join("store");
    let homes: Vec<PathBuf> = (0..homes).map(|h| dir.join(format!("drive{h}"))).collect();
    for h in &homes {
        std::fs::create_dir_all(h).unwrap();
    }
    let copies = homes.len();
    setup(&SetupOptions::new(fixture(), &out).homes(homes).layout(ExpertLayoutKind::Packs).copies(copies), &NoProgress).unwrap();
    out
}

/// A small deterministic generator (the test must replay the same churn every run).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
    fn pick(&mut self, k: usize, n: u32) -> Vec<u32> {
        let mut v: Vec<u32> = Vec::new();
        while v.len() < k {
            let e = self.next(n as u64) as u32;
            if !v.contains(&e) {
                v.push(e);
            }
        }
        v
    }
}

#[test]
fn cancelled_and_redemanded_guesses_never_strand_a_demand() {
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open(&make_store(tmp.path(), 3)).unwrap();
    let cfg = store.config();
    let (layers, experts) = (cfg.num_layers, cfg.num_experts as u32);
    let moe: Vec<usize> = (0..layers).filter(|&l| store.manifest().experts.iter().any(|e| e.layer == l)).collect();
    let entry = |l: usize, e: u32| store.manifest().experts.iter().find(|x| x.layer == l && x.expert == e as usize).unwrap().clone();
    let one = entry(moe[0], 0).len;
    for (budget_experts, policy) in [(10, CachePolicy::NextUse), (40, CachePolicy::Lru)] {
        let src = store
            .experts(ReaderOptions {
                queue_depth: 4,
                cache_mode: CacheMode::Buffered,
                expert_budget: budget_experts * (one + 2 * 4096),
                pinned: vec![],
                policy,
                // Split every expert into parts, and keep each part slow (about 2 ms), so parts of
                // cancelled guesses are still running when their experts are demanded again.
                split_min: 4096,
                read_caps: vec![8_000_000; 3],
                background_fill: false,
            })
            .unwrap();
        let mut rng = Lcg(budget_experts);
        for step in 0..240 {
            let i = step % moe.len();
            let (l, next) = (moe[i], moe[(i + 1) % moe.len()]);
            // Guess the next layer, then demand this one (which cancels this layer's unused
            // guesses), then, now and then, demand part of the guess right away.
            src.prefetch(next, &rng.pick(4, experts));
            let want = rng.pick(4, experts);
            let rx = src.request(l, &want, Priority::Demand);
            if rng.next(3) == 0 {
                src.prefetch(l, &rng.pick(4, experts));
            }
            let mut got = Vec::new();
            for _ in 0..want.len() {
                let (e, bytes) = rx
                    .recv_timeout(Duration::from_secs(20))
                    .unwrap_or_else(|_| panic!("step {step}: a demand for layer {l} was never answered ({got:?} of {want:?})"));
                let bytes = bytes.unwrap();
                assert_eq!(checksum(bytes.as_slice()), entry(l, e).xxh3, "step {step}: wrong bytes for {l}/{e}");
                got.push(e);
            }
            got.sort();
            let mut w = want.clone();
            w.sort();
            assert_eq!(got, w);
        }
    }
}
