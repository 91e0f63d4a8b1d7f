//! `cargo xtask bench stream`: a stream store against a loopback hub over a rate-limited link.
//!
//! The hub emulator serves `slice-mini` (real expert size) in the hub's URL layout, each
//! connection throttled (hubs throttle per connection) and all of them together held to the
//! link's rate. Measured: fetch throughput against the link's limit at 1, 2, 4 and the default
//! 8 connections; time to first token on a cold stream store, the same store warm, and a full
//! store; and decode speed with a given fraction of the experts cached. Configurations are
//! interleaved round by round.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use anyhow::{ensure, Context, Result};
use deltafin_sched::{CachePolicy, Stats};
use deltafin_store::{NoProgress, Store, StreamOptions, CACHE_DIR};

use super::engine_runs::{self, spread, RunConfig};
use crate::hub_emulator::HubEmulator;

/// The user's link to the hub (bytes/s), and each connection's throttle.
const LINK: u64 = 200_000_000;
const PER_CONNECTION: u64 = 50_000_000;
const BUDGET: u64 = 700_000_000;
const REPO: &str = "bench/slice-mini";

/// Empties the expert cache of the stream store at `store`.
fn cold(store: &Path) -> Result<()> {
    let d = store.join(CACHE_DIR);
    if d.exists() {
        std::fs::remove_dir_all(&d).with_context(|| format!("emptying {}", d.display()))?;
    }
    Ok(())
}

/// Fetches the first `count` experts into an empty cache over `connections` connections:
/// `(bytes, bytes/s)`.
fn fetch_rate(store: &Path, count: usize, connections: usize) -> Result<(u64, f64)> {
    cold(store)?;
    std::env::set_var("DELTAFIN_HUB_CONNECTIONS", connections.to_string());
    let cache = Store::open(store)?.hub_cache()?;
    std::env::remove_var("DELTAFIN_HUB_CONNECTIONS");
    let want: Vec<_> = cache.streamed().into_iter().take(count).collect();
    let bytes: u64 = want.iter().map(|w| w.2).sum();
    let t = Instant::now();
    cache.fetch_many(want, deltafin_fetch::Priority::Background, "fetch", &NoProgress)?;
    Ok((bytes, bytes as f64 / t.elapsed().as_secs_f64()))
}

/// Caches `fraction` of the experts (a fixed pseudo-random choice, fetched untimed).
fn warm_to(store: &Path, fraction: f64) -> Result<()> {
    cold(store)?;
    let cache = Store::open(store)?.hub_cache()?;
    let mut all = cache.streamed();
    // Deterministic shuffle: sort by a hash of the position.
    all.sort_by_key(|(s, o, _)| crate::oracle::prompt_ids(o ^ s.len() as u64, 1, u64::MAX)[0]);
    let n = (all.len() as f64 * fraction).round() as usize;
    cache.fetch_many(all.into_iter().take(n).collect(), deltafin_fetch::Priority::Background, "warm", &NoProgress)?;
    Ok(())
}

/// One generation under the bench's budget with the engine's defaults.
fn generate(store: &Path, prompt: &[u32], new: usize) -> Result<(Vec<u32>, Stats)> {
    let cfg = RunConfig { label: String::new(), budget: BUDGET, prefetch: true, policy: CachePolicy::NextUse, chunk: None, read_cap: None };
    engine_runs::generate(store, &cfg, prompt, new)
}

pub fn run(ckpt: &Path, full_store: &Path, work: &Path, vocab: u32, quick: bool) -> Result<String> {
    let hub = HubEmulator::start(ckpt, REPO)?;
    // The store records this endpoint; the environment's, if any, would override it.
    std::env::set_var("HF_ENDPOINT", &hub.endpoint);
    std::env::remove_var("HF_HUB_OFFLINE");
    let store = work.join("stream-store");
    let mut opts = StreamOptions::new(format!("hf://{REPO}"), &store);
    opts.reinstall = true;
    let t = Instant::now();
    deltafin_store::setup_stream(&opts, &NoProgress)?;
    let setup_s = t.elapsed().as_secs_f64();
    let spine = Store::open(&store)?.manifest().spine_bytes;
    hub.faults(|f| {
        f.rate = PER_CONNECTION;
        f.link_rate = LINK;
    });
    let rounds = if quick { 1 } else { 3 };

    // Fetch throughput.
    let count = if quick { 16 } else { 32 };
    let conns = [1usize, 2, 4, 8];
    let mut rates = vec![Vec::new(); conns.len()];
    let mut fetch_bytes = 0;
    for round in 0..rounds {
        for (i, &c) in conns.iter().enumerate() {
            let (bytes, r) = fetch_rate(&store, count, c)?;
            fetch_bytes = bytes;
            eprintln!("stream round {round}: {c} connection(s): {:.0} MB/s", r / 1e6);
            rates[i].push(r);
        }
    }

    // Time to first token: cold stream, warm stream, full store.
    let prompt = crate::oracle::prompt_ids(11, 32, vocab as u64);
    let new = if quick { 4 } else { 8 };
    let (mut cold_t, mut warm_t, mut full_t, mut cold_mb) = (Vec::new(), Vec::new(), Vec::new(), 0.0);
    let (want, _) = generate(full_store, &prompt, new)?;
    for round in 0..rounds {
        cold(&store)?;
        let (ids, s) = generate(&store, &prompt, new)?;
        ensure!(ids == want, "the cold stream store's ids differ from the full store's");
        cold_t.push(s.ttft_s);
        cold_mb = Store::open(&store)?.hub_cache()?.cached().0 as f64 / 1e6;
        let (ids, s) = generate(&store, &prompt, new)?;
        ensure!(ids == want, "the warm stream store's ids differ from the full store's");
        warm_t.push(s.ttft_s);
        let (_, s) = generate(full_store, &prompt, new)?;
        full_t.push(s.ttft_s);
        eprintln!("stream round {round}: TTFT cold {:.2} s, warm {:.2} s, full {:.2} s", cold_t[round], warm_t[round], full_t[round]);
    }

    // Decode speed as the cache warms.
    let fractions = [0.0, 0.25, 0.5, 0.75, 1.0];
    let dprompt = crate::oracle::prompt_ids(12, 4, vocab as u64);
    let dnew = if quick { 6 } else { 12 };
    let mut dec = vec![Vec::new(); fractions.len()];
    let mut fetched = vec![0.0; fractions.len()];
    let mut dwant: Option<Vec<u32>> = None;
    for round in 0..rounds {
        for (i, &f) in fractions.iter().enumerate() {
            warm_to(&store, f)?;
            let before = Store::open(&store)?.hub_cache()?.cached().0;
            let (ids, s) = generate(&store, &dprompt, dnew)?;
            ensure!(dwant.get_or_insert_with(|| ids.clone()) == &ids, "decode ids differ with the cache's warmth");
            fetched[i] = (Store::open(&store)?.hub_cache()?.cached().0 - before) as f64 / 1e6;
            dec[i].push(s.decode_tok_s);
            eprintln!("stream round {round}: {:.0}% cached: {:.2} tok/s", 100.0 * f, s.decode_tok_s);
        }
    }

    let q = if quick { " --quick" } else { "" };
    let mut md = format!(
        "## Stream install\n\n`cargo xtask bench stream{q}` — `slice-mini` (real expert size) served by the loopback hub emulator in the hub's URL layout (`resolve` redirecting to a CDN path, exact `206` ranges), every connection throttled to {} MB/s (hubs throttle per connection) and all of them together held to a {} MB/s link (a byte clock: time with nothing sent is lost). Setup (config, tokenizer, {:.0} MB of spine, unthrottled) took {setup_s:.1} s. {rounds} round(s), configurations interleaved; min / median / max.\n\n",
        PER_CONNECTION / 1_000_000,
        LINK / 1_000_000,
        spine as f64 / 1e6,
    );
    writeln!(md, "Fetch throughput: {count} experts ({:.0} MB) into an empty cache (adjacent experts coalesced into equal runs per connection, each expert published with direct I/O, fsync and rename by a publisher pool while the rest of its run still streams in, on this machine's one disk and 2 cores, which also run the emulator). Ideal: the lesser of the connections' throttles and the link (at 4 connections the two are equal, so any pause of one connection is lost).\n\n| connections | MB/s min / median / max | ideal MB/s | of ideal |\n|---|---|---|---|", fetch_bytes as f64 / 1e6)?;
    for (i, c) in conns.iter().enumerate() {
        let (a, b, m) = spread(&rates[i]);
        let default = if *c == 8 { " (default)" } else { "" };
        let ideal = (*c as u64 * PER_CONNECTION).min(LINK) as f64;
        writeln!(
            md,
            "| {c}{default} | {:.0} / {:.0} / {:.0} | {:.0} | **{:.0}%** |",
            a / 1e6,
            b / 1e6,
            m / 1e6,
            ideal / 1e6,
            100.0 * b / ideal
        )?;
    }
    let (c, w, f) = (spread(&cold_t), spread(&warm_t), spread(&full_t));
    writeln!(md, "\nTime to first token, 32-token prompt, RAM budget {} MB (ids equal to the full store's, checked). The cold run fetched {cold_mb:.0} MB of experts.\n\n| store | TTFT s min / median / max |\n|---|---|\n| stream, cold cache | {:.2} / {:.2} / {:.2} |\n| stream, warm cache (the same prompt again) | {:.2} / {:.2} / {:.2} |\n| full (local disk) | {:.2} / {:.2} / {:.2} |", BUDGET / 1_000_000, c.0, c.1, c.2, w.0, w.1, w.2, f.0, f.1, f.2)?;
    writeln!(md, "\nDecode as the cache warms: a 4-token prompt, {dnew} new tokens, with a fixed pseudo-random share of the experts cached beforehand (ids equal at every warmth, checked). Whatever is missing is fetched on first use and cached, so a cold run warms itself as it goes.\n\n| cached before | decode tok/s min / median / max | MB fetched during the run |\n|---|---|---|")?;
    for (i, fr) in fractions.iter().enumerate() {
        let (a, b, m) = spread(&dec[i]);
        writeln!(md, "| {:.0}% | {a:.2} / {b:.2} / {m:.2} | {:.0} |", 100.0 * fr, fetched[i])?;
    }
    Ok(md)
}
