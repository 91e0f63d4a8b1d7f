//! `deltafin plan`: what a model will do on a machine before it runs there. From the config and
//! the checkpoint's sizes, a RAM budget and the drives' read rates: what stays resident, the
//! expert bytes read per token, and projected decode speed and time to first token.
//!
//! The projection is a model, and says which of its numbers are measured and which assumed:
//! compute rates are measured on this machine with the engine's own kernels at K3's real shapes
//! (a projection for another machine inherits this machine's compute); the drives' efficiency
//! is the drive ladder's measured one (docs/BENCHMARKS.md) unless given; routing is assumed
//! uniform (the least favourable case for a cache: a trained router's skew only helps).

use std::fmt::Write as _;
use std::time::Instant;

use deltafin_core::{Backend, Bf16Matrix, Bytes, ExpertLayout, K3Config, Mat};

use crate::budget::{Charges, SpineSizes};
use crate::open::MemoryPlan;

/// Share of the drives' summed rates the engine reached at 4 unequal drives with the strict
/// reader-enforced caps, one striped copy (`cargo xtask bench ladder --limiter reader`,
/// docs/BENCHMARKS.md: 89%, the full mirror likewise).
pub const LADDER_EFFICIENCY: f64 = 0.89;

/// Rates of the engine's kernels on this machine.
#[derive(Clone, Copy, Debug)]
pub struct ComputeRates {
    /// Seconds for one expert applied to one token (decode).
    pub expert_token_s: f64,
    /// Seconds per token for one expert applied to a 64-token prompt chunk.
    pub expert_prompt_token_s: f64,
    /// BF16 weight bytes per second of a one-token matmul (decode: the spine streams from RAM).
    pub spine_decode_bytes_s: f64,
    /// BF16 weight bytes per second per token of a 64-token matmul (prefill).
    pub spine_prompt_bytes_s: f64,
}

impl ComputeRates {
    /// Times the backend's kernels on K3-shaped weights (an expert of `cfg`'s shape, a
    /// 7168-square BF16 matrix, larger than any cache): about two seconds.
    pub fn measure(cfg: &K3Config, backend: &dyn Backend) -> ComputeRates {
        let shape = cfg.expert_shape();
        let sb = shape.scale_bytes();
        let layout = ExpertLayout::packed(shape);
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        // Random E2M1 codes; scales near 2^-7 (never 255, which would be NaN).
        let mut expert: Vec<u8> = (0..layout.span_len()).map(|_| next() as u8).collect();
        for r in 0..3 {
            let at = layout.offsets[2 * r + 1];
            expert[at..at + sb].iter_mut().for_each(|b| *b = 118 + (*b % 4));
        }
        let z = |rows: usize| {
            Mat::from_vec(rows, shape.latent, (0..rows * shape.latent).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect())
        };
        let (z1, z64) = (z(1), z(64));
        let time = |reps: usize, f: &mut dyn FnMut()| {
            f();
            let t = Instant::now();
            for _ in 0..reps {
                f();
            }
            t.elapsed().as_secs_f64() / reps as f64
        };
        let expert_token_s =
            time(20, &mut || drop(backend.expert_forward(cfg, deltafin_core::ExpertId { layer: 0, expert: 0 }, &layout, &expert, &z1)));
        let expert_prompt_token_s =
            time(2, &mut || drop(backend.expert_forward(cfg, deltafin_core::ExpertId { layer: 0, expert: 0 }, &layout, &expert, &z64)))
                / 64.0;
        let n = 7168;
        // BF16 values: the high halves of small f32s.
        let w: Vec<u8> =
            (0..n * n).flat_map(|i| (((((i * 7919 % 2003) as f32 - 1001.0) / 65536.0).to_bits() >> 16) as u16).to_le_bytes()).collect();
        let w = Bf16Matrix::from_bytes(Bytes::from_vec(w), n, n);
        let x = |rows: usize| Mat::from_vec(rows, n, (0..rows * n).map(|i| ((i % 13) as f32 - 6.0) / 6.0).collect());
        let (x1, x64) = (x(1), x(64));
        let bytes = (2 * n * n) as f64;
        let spine_decode_bytes_s = bytes / time(8, &mut || drop(backend.matmul_bf16(&x1, &w)));
        let spine_prompt_bytes_s = 64.0 * bytes / time(2, &mut || drop(backend.matmul_bf16(&x64, &w)));
        ComputeRates { expert_token_s, expert_prompt_token_s, spine_decode_bytes_s, spine_prompt_bytes_s }
    }
}

/// What to plan for.
#[derive(Clone, Debug)]
pub struct PlanInput {
    /// RAM the engine may use (`--ram-budget`).
    pub ram: u64,
    /// Each drive's read rate, bytes/s.
    pub drives: Vec<f64>,
    /// Share of the summed rates reads reach (`None`: [`LADDER_EFFICIENCY`], measured).
    pub read_efficiency: Option<f64>,
    /// Prompt length for the time to first token.
    pub prompt_tokens: usize,
    /// Most tokens a sequence may hold (sizes its state).
    pub context: usize,
    /// How many times this machine's compute the target's is (its cores over this machine's
    /// threads, times a core's speed over one of these): the measured rates are divided by it.
    /// 1 plans for this machine.
    pub compute_scale: f64,
}

/// Sizes of a model that planning needs (from a checkpoint's headers or a store's manifest).
#[derive(Clone, Debug)]
pub struct ModelSizes {
    pub config: K3Config,
    /// Every language-model tensor but the routed experts.
    pub spine_bytes: u64,
    /// The embedding table (read by row, not multiplied).
    pub embed_bytes: u64,
    /// Each layer's spine tensors (what a streamed layer reads per pass).
    pub layer_bytes: Vec<u64>,
    /// The tokenizer's vocabulary in memory ([`deltafin_core::Tokenizer::heap_bytes`]).
    pub tokenizer_bytes: u64,
}

/// A plan, ready to print.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Where the RAM goes (the spine held, with the buffers of two streamed layers when some
    /// stream; state, working memory, tokenizer, expert cache): what
    /// [`crate::LoadedModel::memory_plan`] says when this model opens under the same budget and
    /// context (one sequence, 512-token prompt chunks).
    pub memory: MemoryPlan,
    pub minimum_ram: u64,
    pub fits: bool,
    /// Spine bytes read each pass (streamed layers).
    pub spine_read_per_pass: f64,
    pub cached_experts: u64,
    pub total_experts: u64,
    pub expert_bytes_per_token: f64,
    pub prefill_expert_bytes: f64,
    pub read_bytes_s: f64,
    pub decode_read_s: f64,
    pub decode_compute_s: f64,
    pub prefill_read_s: f64,
    pub prefill_compute_s: f64,
    pub read_efficiency: f64,
    pub efficiency_measured: bool,
    pub expert_len: f64,
    pub prompt_tokens: usize,
    pub compute_scale: f64,
    pub drives: usize,
    pub total_expert_bytes: f64,
}

impl Plan {
    /// Plans `m` under `input` with compute `rates`.
    pub fn new(m: &ModelSizes, input: &PlanInput, rates: &ComputeRates) -> Plan {
        let cfg = &m.config;
        let moe = cfg.moe_layers().len() as f64;
        let (e, k) = (cfg.num_experts as f64, cfg.experts_per_token as f64);
        let expert_len = cfg.expert_shape().total_bytes() as f64;
        let charge = deltafin_store::StreamingExperts::min_budget(cfg.expert_shape());
        let chunk = crate::DEFAULT_BUDGET_CHUNK.min(input.prompt_tokens.max(1));
        // The budget as the engine places it at open, from the same charges (one sequence).
        let charges = Charges::for_run(cfg, input.context, 1, 0, crate::DEFAULT_BUDGET_CHUNK, 0, m.tokenizer_bytes);
        let sizes = SpineSizes {
            spine: m.spine_bytes,
            layer_bytes: &m.layer_bytes,
            embed_bytes: m.embed_bytes,
            vocab: cfg.vocab_size,
            tied: cfg.tie_word_embeddings,
        };
        let (memory, fit, minimum_ram) = MemoryPlan::fit(input.ram, &sizes, &charges);
        let spine_read_per_pass = fit.read_per_pass(&m.layer_bytes);
        let total_experts = (moe * e) as u64;
        let cached_experts = memory.cached_experts(charge, total_experts);
        let miss = 1.0 - cached_experts as f64 / total_experts.max(1) as f64;
        let expert_bytes_per_token = moe * k * miss * expert_len;
        // Distinct experts a prompt routes per layer (uniform routing), each read once.
        let p = input.prompt_tokens as f64;
        let distinct = e * (1.0 - (1.0 - k / e).powf(p));
        let prefill_expert_bytes = moe * distinct * miss * expert_len;
        let eff = input.read_efficiency.unwrap_or(LADDER_EFFICIENCY);
        let read_bytes_s = input.drives.iter().sum::<f64>() * eff;
        let matmul_spine = (m.spine_bytes - m.embed_bytes) as f64;
        let scale = if input.compute_scale > 0.0 { input.compute_scale } else { 1.0 };
        let decode_compute_s = (moe * k * rates.expert_token_s + matmul_spine / rates.spine_decode_bytes_s) / scale;
        let prefill_compute_s = p * (moe * k * rates.expert_prompt_token_s + matmul_spine / rates.spine_prompt_bytes_s) / scale;
        // A prompt runs in chunks; each chunk's pass reads the streamed layers once.
        let chunks = input.prompt_tokens.div_ceil(chunk).max(1) as f64;
        Plan {
            memory,
            minimum_ram,
            fits: input.ram >= minimum_ram,
            spine_read_per_pass: spine_read_per_pass as f64,
            cached_experts,
            total_experts,
            expert_bytes_per_token,
            prefill_expert_bytes,
            read_bytes_s,
            decode_read_s: (expert_bytes_per_token + spine_read_per_pass as f64) / read_bytes_s,
            decode_compute_s,
            prefill_read_s: (prefill_expert_bytes + chunks * spine_read_per_pass as f64) / read_bytes_s,
            prefill_compute_s,
            read_efficiency: eff,
            efficiency_measured: input.read_efficiency.is_none(),
            expert_len,
            prompt_tokens: input.prompt_tokens,
            compute_scale: scale,
            drives: input.drives.len(),
            total_expert_bytes: total_experts as f64 * expert_len,
        }
    }

    /// Decode tokens per second: reads overlap compute (the engine prefetches), so the slower
    /// of the two sets the pace.
    pub fn decode_tok_s(&self) -> f64 {
        1.0 / self.decode_read_s.max(self.decode_compute_s)
    }
    /// Seconds to the first token of a prompt.
    pub fn ttft_s(&self) -> f64 {
        self.prefill_read_s.max(self.prefill_compute_s)
    }

    /// The plan as the CLI prints it.
    pub fn render(&self, rates: &ComputeRates) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "resident (RAM):");
        let m = &self.memory;
        let how = match m.streamed_layers {
            0 => "all of it".to_string(),
            n => format!("{n} layers read each pass, two at a time"),
        };
        let _ = writeln!(s, "  spine            {:>10}  ({how})", size(m.spine as f64));
        let _ = writeln!(s, "  sequence state   {:>10}", size(m.sequence_state as f64));
        let _ = writeln!(s, "  working memory   {:>10}", size(m.working as f64));
        let _ = writeln!(s, "  tokenizer        {:>10}", size(m.tokenizer as f64));
        let _ = writeln!(
            s,
            "  expert cache     {:>10}  ({} of {} experts, {:.1}%, of {} in all)",
            size(self.cached_experts as f64 * self.expert_len),
            self.cached_experts,
            self.total_experts,
            100.0 * self.cached_experts as f64 / self.total_experts.max(1) as f64,
            size(self.total_expert_bytes)
        );
        let _ = writeln!(
            s,
            "  minimum RAM      {:>10}  (output head, norms + two spine layers + state + working memory + tokenizer + one expert; the embedding read by row)",
            size(self.minimum_ram as f64)
        );
        if !self.fits {
            let _ = writeln!(s, "does not fit: the budget is below the minimum");
            return s;
        }
        let _ = writeln!(s, "reads:");
        let _ = writeln!(s, "  expert bytes per decode token  {:>10}  (routing assumed uniform)", size(self.expert_bytes_per_token));
        let _ = writeln!(
            s,
            "  spine bytes read per token     {:>10}  (each pass; a prompt reads them once per chunk)",
            size(self.spine_read_per_pass)
        );
        let _ = writeln!(
            s,
            "  expert bytes for a {}-token prompt  {} (each expert read once per layer)",
            self.prompt_tokens,
            size(self.prefill_expert_bytes)
        );
        let eff = if self.efficiency_measured {
            "assumed: what `bench ladder` measured over 4 unequal drives; --read-efficiency sets it"
        } else {
            "given"
        };
        let drives = if self.drives == 1 { "one drive".to_string() } else { format!("{} drives together", self.drives) };
        let _ = writeln!(s, "  {drives}  {}/s at {:.0}% efficiency ({eff})", size(self.read_bytes_s), 100.0 * self.read_efficiency);
        let scaled = if (self.compute_scale - 1.0).abs() > 1e-9 {
            format!(
                "; projected at {:.2}x this machine's compute (--cores, --core-speed), as if products scaled with cores",
                self.compute_scale
            )
        } else {
            String::new()
        };
        let _ = writeln!(s, "compute (measured on this machine: experts at this model's shape, BF16 products at 7168 x 7168{scaled}):");
        let _ = writeln!(
            s,
            "  expert {:.2} ms/token decode, {:.3} ms/token in a 64-token chunk; BF16 matmul {}/s decode, {}/s per token in a chunk",
            rates.expert_token_s * 1e3,
            rates.expert_prompt_token_s * 1e3,
            size(rates.spine_decode_bytes_s),
            size(rates.spine_prompt_bytes_s)
        );
        let _ = writeln!(s, "projected:");
        let decode_reads = self.decode_read_s >= self.decode_compute_s;
        let _ = writeln!(
            s,
            "  decode   {:.2} tok/s  (reads {:.2} s/token, compute {:.2} s/token; {} bound)",
            self.decode_tok_s(),
            self.decode_read_s,
            self.decode_compute_s,
            if decode_reads { "read" } else { "compute" }
        );
        let prefill_reads = self.prefill_read_s >= self.prefill_compute_s;
        let _ = writeln!(
            s,
            "  TTFT     {:.1} s for {} tokens  (reads {:.1} s, compute {:.1} s; {} bound)",
            self.ttft_s(),
            self.prompt_tokens,
            self.prefill_read_s,
            self.prefill_compute_s,
            if prefill_reads { "read" } else { "compute" }
        );
        let _ = writeln!(s, "what would help:");
        for (what, reads, read_s, compute_s) in [
            ("decode", decode_reads, self.decode_read_s, self.decode_compute_s),
            ("the prompt", prefill_reads, self.prefill_read_s, self.prefill_compute_s),
        ] {
            let _ = if read_s == 0.0 {
                writeln!(s, "  {what}: more or faster cores, or a GPU (--backend cuda): nothing is read (every expert fits the cache)")
            } else if reads {
                writeln!(
                    s,
                    "  {what}: faster reads: more or faster drives (reads take {:.1}x the compute), or more RAM for the expert cache; more cores would not",
                    read_s / compute_s.max(1e-12)
                )
            } else {
                writeln!(
                    s,
                    "  {what}: more compute: more or faster cores (compute takes {:.1}x the reads), or a GPU (--backend cuda); faster drives would not",
                    compute_s / read_s
                )
            };
        }
        s
    }
}

/// Bytes for people: KB, MB, GB or TB (decimal units, as drives are sold).
pub fn size(b: f64) -> String {
    match b {
        b if b >= 1e12 => format!("{:.2} TB", b / 1e12),
        b if b >= 1e9 => format!("{:.2} GB", b / 1e9),
        b if b >= 1e6 => format!("{:.1} MB", b / 1e6),
        b if b >= 1e3 => format!("{:.1} KB", b / 1e3),
        b => format!("{b:.0} B"),
    }
}

/// Sizes of the model at `path` (a checkpoint folder, `hf://` model or store).
pub fn model_sizes(path: &std::path::Path) -> crate::Result<ModelSizes> {
    let path = deltafin_store::resolve_model_dir(path)?;
    let embed = format!("{}model.embed_tokens.weight", deltafin_core::LM_PREFIX);
    if deltafin_store::Store::is_store(&path) {
        let s = deltafin_store::Store::open(&path)?;
        let m = s.manifest();
        let embed_bytes = m.spine.get(&embed).map_or(0, |t| t.len);
        let layer_bytes = (0..s.config().num_layers).map(|l| s.layer_spine_bytes(l)).collect();
        let tokenizer_bytes = tokenizer_bytes(s.tokenizer_texts()?)?;
        return Ok(ModelSizes { config: s.config().clone(), spine_bytes: m.spine_bytes, embed_bytes, layer_bytes, tokenizer_bytes });
    }
    let c = deltafin_store::Checkpoint::open(&path)?;
    let lm = |n: &str| n.starts_with(deltafin_core::LM_PREFIX) && !n.contains(".experts.");
    let spine_bytes = c.tensors().iter().filter(|(n, _)| lm(n)).map(|(_, t)| t.len).sum();
    let embed_bytes = c.tensors().get(&embed).map_or(0, |t| t.len);
    let mut layer_bytes = vec![0u64; c.config().num_layers];
    for (n, t) in c.tensors().iter().filter(|(n, _)| lm(n)) {
        let layer = n
            .strip_prefix(&format!("{}model.layers.", deltafin_core::LM_PREFIX))
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse::<usize>().ok());
        if let Some(l) = layer.filter(|&l| l < layer_bytes.len()) {
            layer_bytes[l] += t.len;
        }
    }
    let tokenizer_bytes = tokenizer_bytes(c.tokenizer_texts()?)?;
    Ok(ModelSizes { config: c.config().clone(), spine_bytes, embed_bytes, layer_bytes, tokenizer_bytes })
}

/// What the tokenizer built from these texts holds, as `open` charges it.
fn tokenizer_bytes((ranks, config): (String, Option<String>)) -> crate::Result<u64> {
    let t = deltafin_core::Tokenizer::from_tiktoken(&ranks, config.as_deref(), deltafin_core::K3_PATTERN)?;
    Ok(t.heap_bytes() as u64)
}
