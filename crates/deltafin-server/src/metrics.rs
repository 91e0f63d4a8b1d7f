//! Prometheus metrics: tokens, time to first token, tok/s, expert bytes read, cache hit rate,
//! queue depth, requests by status.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use deltafin::{BatchStats, Stats};

/// A Prometheus histogram of seconds: cumulative buckets, sum and count.
pub struct Histogram {
    counts: Vec<AtomicU64>,
    sum_us: AtomicU64,
}

/// Bucket bounds (seconds): a tiny model's milliseconds to K3's minutes.
const BOUNDS: [f64; 12] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0, 600.0];

impl Default for Histogram {
    fn default() -> Self {
        Histogram { counts: (0..=BOUNDS.len()).map(|_| AtomicU64::new(0)).collect(), sum_us: AtomicU64::new(0) }
    }
}

impl Histogram {
    pub fn observe(&self, secs: f64) {
        let i = BOUNDS.iter().position(|&b| secs <= b).unwrap_or(BOUNDS.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add((secs.max(0.0) * 1e6) as u64, Ordering::Relaxed);
    }

    fn render(&self, name: &str, help: &str) -> String {
        let mut s = format!("# HELP {name} {help}\n# TYPE {name} histogram\n");
        let mut total = 0;
        for (i, c) in self.counts.iter().enumerate() {
            total += c.load(Ordering::Relaxed);
            let le = BOUNDS.get(i).map_or("+Inf".to_string(), |b| b.to_string());
            s += &format!("{name}_bucket{{le=\"{le}\"}} {total}\n");
        }
        s += &format!("{name}_sum {:.6}\n{name}_count {total}\n", self.sum_us.load(Ordering::Relaxed) as f64 / 1e6);
        s
    }
}

#[derive(Default)]
pub struct Metrics {
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub expert_bytes_read: AtomicU64,
    pub cancelled: AtomicU64,
    pub panics: AtomicU64,
    /// Lockstep steps (`--max-batch` > 1), the sequences they ran, the distinct experts they
    /// routed and the expert bytes they read.
    pub steps: AtomicU64,
    pub sequence_steps: AtomicU64,
    pub distinct_experts: AtomicU64,
    pub step_expert_bytes_read: AtomicU64,
    last: Mutex<(f64, f64, f64)>,
    ttft: Histogram,
    generations: AtomicU64,
    by_status: Mutex<BTreeMap<u16, u64>>,
}

impl Metrics {
    pub fn record(&self, s: &Stats, cached: usize) {
        self.prompt_tokens.fetch_add(s.prompt_tokens as u64, Ordering::Relaxed);
        self.cached_tokens.fetch_add(cached as u64, Ordering::Relaxed);
        self.generated_tokens.fetch_add(s.generated_tokens as u64, Ordering::Relaxed);
        self.expert_bytes_read.fetch_add(s.expert_bytes_read, Ordering::Relaxed);
        self.ttft.observe(s.ttft_s);
        self.generations.fetch_add(1, Ordering::Relaxed);
        *self.last.lock().expect("poisoned") = (s.ttft_s, s.decode_tok_s, s.cache_hit_rate);
    }

    /// Adds one lockstep step: the batcher's totals `before` it and `after`.
    pub fn record_step(&self, before: &BatchStats, after: &BatchStats) {
        let add = |a: &AtomicU64, x: u64, y: u64| a.fetch_add(y.saturating_sub(x), Ordering::Relaxed);
        add(&self.steps, before.steps, after.steps);
        add(&self.sequence_steps, before.sequence_steps, after.sequence_steps);
        add(&self.distinct_experts, before.distinct_experts, after.distinct_experts);
        add(&self.step_expert_bytes_read, before.expert_bytes_read, after.expert_bytes_read);
    }

    pub fn status(&self, code: u16) {
        *self.by_status.lock().expect("poisoned").entry(code).or_default() += 1;
    }

    pub fn render(&self, queue_depth: usize, ready: bool) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (ttft, tok_s, hit) = *self.last.lock().expect("poisoned");
        let mut s = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            s += &format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n");
        };
        metric("deltafin_ready", "gauge", "1 once the model is loaded", (ready as u8).to_string());
        metric("deltafin_queue_depth", "gauge", "Requests waiting for the engine", queue_depth.to_string());
        metric(
            "deltafin_prompt_tokens_total",
            "counter",
            "Prompt tokens processed (excluding reused ones)",
            g(&self.prompt_tokens).to_string(),
        );
        metric(
            "deltafin_cached_prompt_tokens_total",
            "counter",
            "Prompt tokens reused from kept state",
            g(&self.cached_tokens).to_string(),
        );
        metric("deltafin_generated_tokens_total", "counter", "Tokens generated", g(&self.generated_tokens).to_string());
        metric("deltafin_expert_bytes_read_total", "counter", "Expert bytes read from drives", g(&self.expert_bytes_read).to_string());
        metric("deltafin_lockstep_steps_total", "counter", "Engine steps run in lockstep (--max-batch > 1)", g(&self.steps).to_string());
        metric(
            "deltafin_lockstep_sequence_steps_total",
            "counter",
            "Sequences summed over lockstep steps (divide by steps: sequences per step)",
            g(&self.sequence_steps).to_string(),
        );
        metric(
            "deltafin_lockstep_distinct_experts_total",
            "counter",
            "Distinct experts routed, summed over lockstep steps (divide by steps: experts per step)",
            g(&self.distinct_experts).to_string(),
        );
        metric(
            "deltafin_lockstep_expert_bytes_read_total",
            "counter",
            "Expert bytes read by lockstep steps",
            g(&self.step_expert_bytes_read).to_string(),
        );
        metric("deltafin_generations_total", "counter", "Finished generations", g(&self.generations).to_string());
        metric("deltafin_cancelled_total", "counter", "Generations stopped because the client went away", g(&self.cancelled).to_string());
        metric("deltafin_panics_total", "counter", "Generations that panicked (the server survived)", g(&self.panics).to_string());
        metric("deltafin_last_ttft_seconds", "gauge", "Time to first token of the last generation", format!("{ttft:.3}"));
        metric("deltafin_last_decode_tokens_per_second", "gauge", "Decode speed of the last generation", format!("{tok_s:.3}"));
        metric("deltafin_last_cache_hit_rate", "gauge", "Expert cache hit rate of the last generation", format!("{hit:.4}"));
        s += &self.ttft.render("deltafin_ttft_seconds", "Time to first token of finished generations");
        s += "# HELP deltafin_requests_total Requests by HTTP status\n# TYPE deltafin_requests_total counter\n";
        let by_status = self.by_status.lock().expect("poisoned");
        for (code, n) in by_status.iter() {
            s += &format!("deltafin_requests_total{{status=\"{code}\"}} {n}\n");
        }
        if by_status.is_empty() {
            s += "deltafin_requests_total{status=\"200\"} 0\n";
        }
        s
    }
}
