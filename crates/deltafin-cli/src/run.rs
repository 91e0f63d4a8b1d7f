//! `deltafin run` and `deltafin logits`.

use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use deltafin::{Compute, DraftWith, EngineBuilder, GenerateOptions, Generator, LoadedModel, LogitRows, OnToken, Step};
use deltafin::{Message, Role};

/// Where options that never change the output are listed in `--help`.
const PERF: &str = "Performance (never changes the output)";
const DRAFT: &str = "Drafting (K3 verifies every draft: never changes the output)";
const STREAM: &str = "Stream stores";

/// Options shared by every command that opens a model.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// A checkpoint folder (release layout), a store made by `deltafin setup`, or
    /// hf://OWNER/REPO[@REVISION] for a model in the local Hugging Face cache (read in place).
    #[arg(long)]
    pub model: PathBuf,
    /// Most tokens a sequence may hold (bounds the MLA cache).
    #[arg(long, default_value_t = deltafin::DEFAULT_CONTEXT)]
    pub context: usize,
    /// Most prompt tokens per forward pass (no effect on output).
    #[arg(long, help_heading = PERF)]
    pub prefill_chunk: Option<usize>,
    /// Do not prefetch (by default the next layer's experts are guessed from this layer's output so far while its last read is in flight, and in the last layer the next token's first MoE layer; no effect on output).
    #[arg(long, help_heading = PERF)]
    pub no_prefetch: bool,
    /// Bound on everything the engine holds (spine, expert cache, buffers, state), e.g. 2G.
    #[arg(long, value_parser = crate::store_cmds::parse_size, help_heading = PERF)]
    pub ram_budget: Option<u64>,
    /// Read experts through the page cache instead of bypassing it.
    #[arg(long, help_heading = PERF)]
    pub page_cache: bool,
    /// Concurrent expert reads per drive.
    #[arg(long, default_value_t = 4, help_heading = PERF)]
    pub queue_depth: usize,
    /// Read each expert whole from one drive, even where several drives hold copies.
    #[arg(long, help_heading = PERF)]
    pub no_split_reads: bool,
    /// Cap each drive's read rate, comma-separated in the store's drive order (e.g. 136M,71M):
    /// emulates slower drives on one disk for benchmarks (no effect on output).
    #[arg(long, value_delimiter = ',', value_parser = crate::store_cmds::parse_size, help_heading = PERF)]
    pub read_caps: Vec<u64>,
    /// Expert cache eviction: `next-use` (furthest next use first) or `lru`.
    #[arg(long, default_value = "next-use", value_parser = ["next-use", "lru"], help_heading = PERF)]
    pub cache_policy: String,
    /// Keep the hottest experts of past runs pinned in RAM, up to this size (within the budget).
    #[arg(long, value_parser = crate::store_cmds::parse_size, help_heading = PERF)]
    pub pin: Option<u64>,
    /// With a stream store: fetch the experts not cached yet in the background while running,
    /// with spare bandwidth (demand fetches go first), until the store is full or its disk
    /// budget is reached (no effect on output).
    #[arg(long, help_heading = STREAM)]
    pub fill: bool,
    /// With a stream store: compute only with bytes the hub's SHA-256 has covered. Shards not
    /// checked yet are checked first, fetching what is not cached (one pass over the whole model
    /// the first time), and bytes corrupted in transit are repaired; what cannot be checked is an
    /// error. Without it, runs on a partly fetched store say how many bytes were not covered yet.
    #[arg(long, help_heading = STREAM)]
    pub verified_only: bool,
    /// Draft tokens for K3 to verify (speculative decoding; the output is identical): `ngram`
    /// (prompt lookup over the text so far), the folder of a Qwen3 draft model (Hugging Face
    /// layout: config.json, safetensors, tokenizer.json), or `auto` (the model's `draft/`
    /// folder if it has one, else ngram).
    #[arg(long, value_name = "ngram|PATH|auto", help_heading = DRAFT)]
    pub draft: Option<DraftWith>,
    /// Most drafted tokens verified per step (the live cost gate picks each step's length, 0
    /// included, from measured verify costs and acceptance).
    #[arg(long, default_value_t = 4, help_heading = DRAFT)]
    pub draft_max: usize,
    /// Draft exactly --draft-max tokens at every step instead of letting the cost gate choose.
    #[arg(long, help_heading = DRAFT)]
    pub draft_fixed: bool,
    /// What computes: `cpu`, `cuda` (an NVIDIA GPU, checked against the CPU's bits when it opens;
    /// an error saying why if it cannot be used), or `auto` (the GPU when one is usable, else the
    /// CPU). The output is the same bit for bit. (`cpu` stays the default until the CUDA backend
    /// has passed its proof on real hardware: docs/gpu/.)
    #[arg(long, default_value = "cpu", value_name = "cpu|cuda|auto", help_heading = PERF)]
    pub backend: deltafin::BackendChoice,
    /// Most bytes of weights kept on the GPU, e.g. 20G (default: its free memory less room for
    /// activations); the rest are uploaded when used.
    #[arg(long, value_parser = crate::store_cmds::parse_size, help_heading = PERF)]
    pub gpu_memory: Option<u64>,
    /// Kimi K3.1 only: how its sparse-attention indexer rounds the scores that choose each
    /// query's 2048 keys. `f32` (default): the definition, in F32. `fp8`: vLLM's rounding (E4M3
    /// query and key with power-of-two scales), to select what NVIDIA's and vLLM's servers
    /// select. Identical below 2048 tokens of context; see the README.
    #[arg(long, value_name = "f32|fp8", value_parser = ["f32", "fp8"])]
    pub indexer: Option<String>,
}

impl ModelArgs {
    /// Most drafts per step: 0 without `--draft`.
    pub fn draft_max(&self) -> usize {
        if self.draft.is_some() {
            self.draft_max
        } else {
            0
        }
    }
    /// Generation options for `max_new` tokens with the drafting the flags ask for.
    pub fn generate_options(&self, max_new: usize) -> GenerateOptions {
        GenerateOptions::new(max_new).draft_max(self.draft_max()).draft_gate(!self.draft_fixed)
    }
}

impl ModelArgs {
    /// Opens for one generation (nothing kept after it).
    pub fn open(&self) -> Result<LoadedModel> {
        self.open_with(1, 0)
    }
    /// Opens with room for `sequences` sequences at once (serve --max-batch, batch) and `kept`
    /// more kept between requests for reuse (serve --keep-states).
    pub fn open_with(&self, sequences: usize, kept: usize) -> Result<LoadedModel> {
        Ok(self.open_computing(sequences, kept)?.0)
    }
    /// [`ModelArgs::open_with`], with what computes (for its stats).
    pub fn open_computing(&self, sequences: usize, kept: usize) -> Result<(LoadedModel, Compute)> {
        // (shared by run, logits, serve, chat and batch)
        check_model_path(&self.model)?;
        let compute = Compute::open(self.backend, self.gpu_memory)?;
        if let (Some(note), false) = (compute.note(), crate::say::quiet()) {
            eprintln!("{note}");
        }
        let mut builder = EngineBuilder::new(&self.model);
        if let Some(r) = self.indexer.as_deref().and_then(deltafin::IndexerRounding::parse) {
            builder = builder.indexer(r);
        }
        let model = builder
            .backend(compute.backend())
            .max_sequences(sequences)
            .kept_states(kept)
            .context(self.context)
            .prefill_chunk(self.prefill_chunk)
            .prefetch(!self.no_prefetch)
            .ram_budget(self.ram_budget)
            .cache_mode(if self.page_cache { deltafin::CacheMode::Buffered } else { deltafin::CacheMode::Direct })
            .queue_depth(self.queue_depth)
            .read_caps(self.read_caps.clone())
            .pin_bytes(self.pin.unwrap_or(0))
            .split_reads_min(if self.no_split_reads { u64::MAX } else { deltafin::DEFAULT_SPLIT_MIN })
            .cache_policy(if self.cache_policy == "lru" { deltafin::CachePolicy::Lru } else { deltafin::CachePolicy::NextUse })
            .draft(self.draft.clone())
            .background_fill(self.fill)
            .verified_only(self.verified_only)
            .progress(std::sync::Arc::new(crate::store_cmds::Bars::new()))
            .open()
            .with_context(|| format!("opening model {}", self.model.display()))?;
        if let (Some(note), false) = (model.indexer_note(), crate::say::quiet()) {
            eprintln!("{note}");
        }
        Ok((model, compute))
    }
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt text; read from stdin when neither --prompt nor --ids is given.
    #[arg(long, conflicts_with = "ids")]
    pub prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    pub ids: Option<Vec<u32>>,
    /// Render the prompt as a user message in K3's chat format and stop at the end of the turn.
    #[arg(long)]
    pub chat: bool,
    /// Most new tokens.
    #[arg(long, default_value_t = 64)]
    pub max_new: usize,
    /// Print the generated ids (one line, comma-separated) instead of text.
    #[arg(long)]
    pub print_ids: bool,
    /// Print the prompt before the continuation (as the model sees it: decoded from its ids).
    #[arg(long, conflicts_with = "print_ids")]
    pub echo: bool,
    /// Print time to first token, tok/s and where the time went (stderr).
    #[arg(long)]
    pub stats: bool,
    /// Write the stats as JSON to this file.
    #[arg(long)]
    pub stats_json: Option<PathBuf>,
    #[command(flatten)]
    pub sampling: crate::sampling_args::SamplingArgs,
}

fn prompt_ids(model: &LoadedModel, a: &RunArgs) -> Result<Vec<u32>> {
    if let Some(ids) = &a.ids {
        return Ok(ids.clone());
    }
    let text = match &a.prompt {
        Some(t) => t.clone(),
        None => {
            if std::io::stdin().is_terminal() {
                eprintln!("reading the prompt from stdin (end with Ctrl-D)...");
            }
            let mut s = String::new();
            std::io::stdin().read_to_string(&mut s).context("reading the prompt from stdin")?;
            s
        }
    };
    if a.chat {
        Ok(model.chat()?.render(&[Message::new(Role::User, text)], None)?)
    } else {
        Ok(model.tokenizer().encode_ordinary(&text))
    }
}

pub fn run(a: RunArgs) -> Result<()> {
    if let Some(path) = &a.stats_json {
        // Before the generation, not after it: a path that cannot be written loses nothing yet.
        let folder = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
        if !folder.is_dir() {
            bail!("--stats-json {}: the folder {} does not exist", path.display(), folder.display());
        }
    }
    let opening = std::time::Instant::now();
    let (model, compute) = a.model.open_computing(1, 0)?;
    // Before the first token too: the spine read and checked, the tokenizer, the readers.
    let open_s = opening.elapsed().as_secs_f64();
    let prompt = prompt_ids(&model, &a)?;
    if prompt.is_empty() {
        bail!("the prompt is empty: give --prompt TEXT, --ids 1,2,3, or text on stdin");
    }
    let stop_ids = if a.chat { model.chat()?.stop_ids() } else { Vec::new() };
    let opts_stop = stop_ids.clone();
    let opts = a.model.generate_options(a.max_new).stop_ids(stop_ids).sampling(a.sampling.sampling()?);
    let mut out = std::io::stdout().lock();
    let mut dec = model.tokenizer().stream();
    let mut ids = Vec::new();
    if a.echo {
        write!(out, "{}", model.tokenizer().decode(&prompt))?;
        out.flush()?;
    }
    let mut write_err = None;
    // The generator drafts with what `--draft` loaded.
    let mut generator = Generator::new(&model);
    let stats = generator.generate(
        &prompt,
        &opts,
        &mut OnToken(|s: Step<'_>| {
            let id = s.id;
            ids.push(id);
            if !a.print_ids {
                let piece = dec.push(id);
                if let Err(e) = out.write_all(piece.as_bytes()).and_then(|_| out.flush()) {
                    write_err = Some(e);
                    return false;
                }
            }
            true
        }),
    )?;
    if let Some(e) = write_err {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            return Err(e.into());
        }
    }
    if a.print_ids {
        writeln!(out, "{}", ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(","))?;
    } else {
        write!(out, "{}", dec.finish())?;
        writeln!(out)?;
    }
    let stopped = a.chat && ids.last().is_some_and(|id| opts_stop.contains(id));
    if a.chat && !stopped && !stats.context_limit_reached && ids.len() >= a.max_new && !crate::say::quiet() {
        eprintln!("note: the reply was cut at --max-new {} tokens (raise it for a longer reply)", a.max_new);
    }
    if stats.context_limit_reached {
        eprintln!(
            "note: stopped after {} tokens: the sequence reached its context limit of {} tokens (raise --context for longer output)",
            stats.generated_tokens, a.model.context
        );
    }
    if let Err(e) = model.save_heat() {
        eprintln!("warning: expert heat not saved ({e}); --pin will not learn from this run");
    }
    if let (false, Some(w)) = (a.stats, stats.unverified_warning()) {
        eprintln!("{w}");
    }
    if a.stats || crate::say::verbose() {
        if let Some(p) = model.memory_plan() {
            eprintln!(
                "RAM budget {:.1} MB: spine {:.1} MB{}, sequence state {:.1} MB, working {:.1} MB,{} tokenizer {:.1} MB, experts {:.1} MB",
                p.budget as f64 / 1e6,
                p.spine as f64 / 1e6,
                if p.streamed_layers > 0 { format!(" ({} layers read each pass)", p.streamed_layers) } else { String::new() },
                p.sequence_state as f64 / 1e6,
                p.working as f64 / 1e6,
                if p.draft > 0 { format!(" draft model {:.1} MB,", p.draft as f64 / 1e6) } else { String::new() },
                p.tokenizer as f64 / 1e6,
                p.experts as f64 / 1e6
            );
        }
        if let Some(d) = model.drafter_description() {
            eprintln!("drafting with {d}");
        }
        eprintln!("opened the model in {open_s:.3} s (before the prompt's TTFT)");
        eprintln!("computed on {}", compute.name());
        if let Some(g) = compute.gpu_stats() {
            eprintln!("{}", g.summary());
        }
        eprintln!("{}", stats.summary());
    }
    if let Some(path) = &a.stats_json {
        let tmp = path.with_extension("tmp");
        let mut json = crate::stats_json::with_drafter(crate::stats_json::stats_json(&stats), &model);
        json["open_s"] = serde_json::json!(open_s);
        json["backend"] = serde_json::json!(compute.name());
        json["gpu"] = match compute.gpu_stats() {
            Some(g) => serde_json::json!({
                "gpu_s": g.gpu_s,
                "uploaded_bytes": g.uploaded_bytes,
                "resident_bytes": g.resident_bytes,
                "evicted_bytes": g.evicted_bytes,
                "gpu_products": g.gpu_products,
                "cpu_fallbacks": g.cpu_fallbacks,
            }),
            None => serde_json::Value::Null,
        };
        std::fs::write(&tmp, serde_json::to_vec_pretty(&json)?).with_context(|| format!("writing {}", path.display()))?;
        std::fs::rename(&tmp, path)?;
    }
    Ok(())
}

#[derive(Args, Debug)]
// Logits are one forward pass: drafting cannot matter there.
#[command(mut_arg("draft", |a| a.hide(true)), mut_arg("draft_max", |a| a.hide(true)), mut_arg("draft_fixed", |a| a.hide(true)))]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Token ids, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub ids: Vec<u32>,
    /// Output file: one F32 tensor `logits` of shape [tokens, vocab].
    #[arg(long)]
    pub out: PathBuf,
}

pub fn logits(a: LogitsArgs) -> Result<()> {
    let model = a.model.open()?;
    let mut seq = model.new_sequence();
    let (l, _) = model.engine().forward(&mut seq, &a.ids, LogitRows::All)?;
    let bytes: Vec<u8> = l.data.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![l.rows, l.cols], &bytes)?;
    let data = safetensors::serialize([("logits", view)], &None)?;
    let tmp = a.out.with_extension("tmp");
    std::fs::write(&tmp, data).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &a.out).with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!("wrote logits [{}, {}] to {}", l.rows, l.cols, a.out.display());
    Ok(())
}

/// A `--model` that cannot be a model says so before anything opens it: missing, or a file.
pub fn check_model_path(model: &std::path::Path) -> Result<()> {
    let what = "a checkpoint folder (with config.json), a store made by `deltafin setup`, or hf://OWNER/REPO";
    if model.to_string_lossy().starts_with("hf://") {
        return Ok(());
    }
    match std::fs::metadata(model) {
        Err(_) => anyhow::bail!("{}: no such model folder or store (--model takes {what})", model.display()),
        Ok(m) if !m.is_dir() => anyhow::bail!("{} is a file, not a model folder (--model takes {what})", model.display()),
        // (a Hugging Face cache folder, `models--OWNER--REPO`, holds its snapshots)
        Ok(_) if !model.join("config.json").exists() && !deltafin::is_store(model) && !model.join("snapshots").is_dir() => {
            anyhow::bail!("{} is not a model folder: it has no config.json and is not a store (--model takes {what})", model.display())
        }
        Ok(_) => Ok(()),
    }
}
