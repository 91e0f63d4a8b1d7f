//! `--stats-json`: the documented wire format of a generation's stats (the engine's `Stats`
//! carry no format of their own).

use deltafin::Stats;
use serde_json::{json, Value};

/// The stats as the JSON object the README documents.
pub fn stats_json(s: &Stats) -> Value {
    json!({
        "prompt_tokens": s.prompt_tokens,
        "generated_tokens": s.generated_tokens,
        "ttft_s": s.ttft_s,
        "decode_tok_s": s.decode_tok_s,
        "total_s": s.total_s,
        "expert_bytes_read": s.expert_bytes_read,
        "spine_bytes_read": s.spine_bytes_read,
        "unverified_bytes": s.unverified_bytes,
        "expert_bytes_read_prefill": s.expert_bytes_read_prefill,
        "expert_bytes_distinct_prefill": s.expert_bytes_distinct_prefill,
        "bytes_per_token": s.bytes_per_token,
        "cache_hit_rate": s.cache_hit_rate,
        "read_wait_s": s.read_wait_s,
        "compute_s": s.compute_s,
        "decode_read_busy_s": s.decode_read_busy_s,
        "prefetch_issued": s.prefetch_issued,
        "prefetch_used": s.prefetch_used,
        "prefetch_recall": s.prefetch_recall,
        "prefetch_wasted_bytes": s.prefetch_wasted_bytes,
        "provisional_tokens": s.provisional_tokens,
        "provisional_tokens_right": s.provisional_tokens_right,
        "boundary_guesses": s.boundary_guesses,
        "per_drive": s.per_drive.iter().map(|h| json!({"path": h.path, "reads": h.reads, "bytes": h.bytes, "errors": h.errors, "rate_bytes_s": h.rate, "busy_s": h.busy_s})).collect::<Vec<_>>(),
        "peak_rss_bytes": s.peak_rss_bytes,
        "context_limit_reached": s.context_limit_reached,
        "cached_tokens": s.cached_tokens,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "verifies": s.verifies,
        "acceptance_rate": s.acceptance_rate(),
        "tokens_per_verify": s.tokens_per_verify(),
        "verify_union_bytes_mean": s.verify_union_bytes_mean(),
        "expert_bytes_per_emitted_token": s.bytes_per_token,
        "draft_s": s.draft_s,
        "draft_probes": s.draft_probes,
    })
}

/// Adds what drafted (`drafter`: its description, or null).
pub fn with_drafter(mut v: Value, model: &deltafin::LoadedModel) -> Value {
    v["drafter"] = json!(model.drafter_description());
    v
}
