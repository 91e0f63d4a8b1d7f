//! Prometheus metrics: tokens, time to first token, tok/s, expert bytes read, cache hit rate,
//! queue depth, requests by status.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use deltafin::{BatchStats, Stats};

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
    ttft_sum_ms: AtomicU64,
    generations: AtomicU64,
    by_status: Mutex<BTreeMap<u16, u64>>,
}

impl Metrics {
    pub fn record(&self, s: &Stats, cached: usize) {
        self.prompt_tokens.fetch_add(s.prompt_tokens as u64, Ordering::Relaxed);
        self.cached_tokens.fetch_add(cached as u64, Ordering::Relaxed);
        self.generated_tokens.fetch_add(s.generated_tokens as u64, Ordering::Relaxed);
        self.expert_bytes_read.fetch_add(s.expert_bytes_read, Ordering::Relaxed);
        self.ttft_sum_ms.fetch_add((s.ttft_s * 1000.0) as u64, Ordering::Relaxed);
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
        metric(
            "deltafin_ttft_seconds_sum",
            "counter",
            "Sum of time to first token",
            format!("{:.3}", g(&self.ttft_sum_ms) as f64 / 1000.0),
        );
        metric("deltafin_last_ttft_seconds", "gauge", "Time to first token of the last generation", format!("{ttft:.3}"));
        metric("deltafin_last_decode_tokens_per_second", "gauge", "Decode speed of the last generation", format!("{tok_s:.3}"));
        metric("deltafin_last_cache_hit_rate", "gauge", "Expert cache hit rate of the last generation", format!("{hit:.4}"));
        s += "# HELP deltafin_requests_total Requests by HTTP status\n# TYPE deltafin_requests_total counter\n";
        for (code, n) in self.by_status.lock().expect("poisoned").iter() {
            s += &format!("deltafin_requests_total{{status=\"{code}\"}} {n}\n");
        }
        s
    }
}
