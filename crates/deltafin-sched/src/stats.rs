//! Generation statistics. Their wire formats live at the edges: `deltafin run --stats-json`
//! (the CLI) and the server's `timings`.

use deltafin_store::HomeStats;

/// What one generation cost and where the time went.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct Stats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Seconds from the start to the first generated token.
    pub ttft_s: f64,
    /// Generated tokens per second after the first.
    pub decode_tok_s: f64,
    pub total_s: f64,
    /// Expert bytes read from disk during the whole generation.
    pub expert_bytes_read: u64,
    /// Of which during prefill.
    pub expert_bytes_read_prefill: u64,
    /// Spine bytes read from the store (layers a short budget streams each pass).
    pub spine_bytes_read: u64,
    /// Bytes of the distinct experts the prompt routed, summed per layer.
    pub expert_bytes_distinct_prefill: u64,
    /// Expert bytes read per decoded token.
    pub bytes_per_token: f64,
    /// Expert requests served from RAM / all expert requests.
    pub cache_hit_rate: f64,
    /// Seconds waiting for expert reads.
    pub read_wait_s: f64,
    /// Seconds not waiting for reads.
    pub compute_s: f64,
    /// Seconds the busiest drive had reads in flight during decode: the read time of the decode
    /// steps, against which their wall time shows how well compute hid behind reads.
    pub decode_read_busy_s: f64,
    pub prefetch_issued: u64,
    pub prefetch_used: u64,
    /// Decode expert demands that a prefetch had already fetched or started / all decode demands.
    pub prefetch_recall: f64,
    pub prefetch_wasted_bytes: u64,
    /// Decode steps whose last layer worked out a provisional next token, and how many of those
    /// matched the real one: the next token's first MoE layer is prefetched from it only while
    /// they mostly do.
    pub provisional_tokens: u64,
    pub provisional_tokens_right: u64,
    /// Steps that prefetched the next token's first MoE layer.
    pub boundary_guesses: u64,
    /// Reads and bytes per drive.
    pub per_drive: Vec<HomeStats>,
    /// Peak resident set of the process so far.
    pub peak_rss_bytes: u64,
    /// Generation ended because the sequence reached its context limit (not `max_new`).
    pub context_limit_reached: bool,
    /// Leading prompt tokens reused from state a [`crate::Generator`] kept (not run again).
    pub cached_tokens: usize,
    /// Speculation: draft tokens verified, how many K3 agreed with, and verify steps run.
    pub drafted: u64,
    pub accepted: u64,
    pub verifies: u64,
    /// Bytes of the distinct experts the verify steps routed (their union per layer), summed.
    pub verify_union_bytes: u64,
    /// Seconds spent in the drafter.
    pub draft_s: f64,
    /// Verify steps the cost gate ran as probes (drafting was off or not worth it).
    pub draft_probes: u64,
    /// Bytes this model's engine has computed with (spine and experts, since it opened) that no
    /// published hash has covered yet: a stream store's large shards before they are checked.
    pub unverified_bytes: u64,
}

impl Stats {
    /// The line a run prints when it computed with bytes no published hash has covered yet.
    pub fn unverified_warning(&self) -> Option<String> {
        (self.unverified_bytes > 0).then(|| {
            format!(
                "warning: computed with {:.1} MB of a stream store's bytes that the hub's SHA-256 has not covered yet (their shards \
                 are not complete): run with --verified-only to check them first, or --fill to complete them",
                self.unverified_bytes as f64 / 1e6
            )
        })
    }
    /// Accepted / drafted tokens (0 without drafts).
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
    /// Tokens emitted per verify step: the accepted drafts plus K3's own token.
    pub fn tokens_per_verify(&self) -> f64 {
        if self.verifies == 0 {
            0.0
        } else {
            (self.accepted + self.verifies) as f64 / self.verifies as f64
        }
    }
    /// Mean union of expert bytes a verify step routed.
    pub fn verify_union_bytes_mean(&self) -> f64 {
        if self.verifies == 0 {
            0.0
        } else {
            self.verify_union_bytes as f64 / self.verifies as f64
        }
    }
}

impl Stats {
    /// A human summary for `--stats`.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "prompt {} tok, generated {} tok | TTFT {:.3} s | decode {:.2} tok/s | total {:.2} s",
            self.prompt_tokens, self.generated_tokens, self.ttft_s, self.decode_tok_s, self.total_s,
        );
        // Only what happened: a run with every expert in RAM reads nothing and prefetches nothing.
        if self.expert_bytes_read > 0 {
            s.push_str(&format!(
                "\nexperts read {:.1} MB (prefill {:.1} MB, distinct {:.1} MB) | {:.1} MB/token | hit rate {:.1}%",
                mb(self.expert_bytes_read),
                mb(self.expert_bytes_read_prefill),
                mb(self.expert_bytes_distinct_prefill),
                self.bytes_per_token / 1e6,
                100.0 * self.cache_hit_rate,
            ));
        } else {
            s.push_str("\nexperts: every one used was in RAM (nothing read)");
        }
        s.push_str(&format!("\nread wait {:.3} s, compute {:.3} s", self.read_wait_s, self.compute_s));
        if self.prefetch_issued > 0 {
            s.push_str(&format!(
                " | prefetch {} issued, {} used, {:.1} MB wasted",
                self.prefetch_issued,
                self.prefetch_used,
                mb(self.prefetch_wasted_bytes)
            ));
        }
        s.push_str(&format!(" | peak RSS {:.1} MB", mb(self.peak_rss_bytes)));
        if let Some(w) = self.unverified_warning() {
            s.push_str(&format!("\n{w}"));
        }
        if self.spine_bytes_read > 0 {
            s.push_str(&format!("\nspine read {:.1} MB (layers the budget streams)", mb(self.spine_bytes_read)));
        }
        if self.verifies == 0 && self.draft_s > 0.0 {
            s.push_str(&format!(
                "\ndrafts: none verified: the drafter proposed none, or the cost gate judged that verifying would not pay \
                 ({} gate probes); decoded plainly, the same output (--draft-fixed verifies every step)",
                self.draft_probes
            ));
        } else if self.verifies > 0 {
            s.push_str(&format!(
                "\ndrafts: {} verify steps ({} probes), {} drafted, {} accepted ({:.0}%), {:.2} tokens per verify, \
                 verify union {:.1} MB, drafting {:.3} s",
                self.verifies,
                self.draft_probes,
                self.drafted,
                self.accepted,
                100.0 * self.acceptance_rate(),
                self.tokens_per_verify(),
                self.verify_union_bytes_mean() / 1e6,
                self.draft_s,
            ));
        }
        for h in &self.per_drive {
            s.push_str(&format!(
                "\n  drive {}: {} reads, {:.1} MB, {} errors, {:.0} MB/s",
                h.path,
                h.reads,
                mb(h.bytes),
                h.errors,
                h.rate / 1e6
            ));
        }
        s
    }
}

fn mb(b: u64) -> f64 {
    b as f64 / 1e6
}
