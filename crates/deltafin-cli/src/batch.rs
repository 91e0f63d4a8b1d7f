//! `deltafin batch`: an OpenAI Batch API file run to completion, requests in lockstep, with a
//! progress bar; re-running the same command resumes a killed batch.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use deltafin_server::{BatchConfig, BatchProgress};
use indicatif::{ProgressBar, ProgressStyle};

use crate::run::ModelArgs;

#[derive(Args, Debug)]
pub struct BatchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Requests, one JSON object per line: `custom_id`, `method` (POST), `url`
    /// (/v1/chat/completions or /v1/completions), `body` (the OpenAI Batch API format).
    #[arg(long)]
    pub input: PathBuf,
    /// Results, one line per request (`id`, `custom_id`, `response`, `error`), appended as each
    /// finishes; lines already there are not run again.
    #[arg(long)]
    pub output: PathBuf,
    /// Requests generated together in lockstep (the RAM budget must hold their state).
    #[arg(long, default_value_t = 8)]
    pub max_batch: usize,
    /// max_tokens when a request gives none.
    #[arg(long, default_value_t = 512)]
    pub default_max_tokens: usize,
}

/// The progress bar: requests done, ETA, aggregate generated tok/s.
struct Bar {
    bar: ProgressBar,
    started: Instant,
    tokens: u64,
}

impl BatchProgress for Bar {
    fn start(&mut self, total: usize, done: usize) {
        self.bar.set_length(total as u64);
        self.bar.set_position(done as u64);
        if done > 0 {
            self.bar.println(format!("resuming: {done} of {total} requests are already in the output"));
        }
    }
    fn line(&mut self, tokens: u64) {
        self.tokens += tokens;
        self.bar.inc(1);
        let s = self.started.elapsed().as_secs_f64().max(1e-9);
        self.bar.set_message(format!("{:.2} tok/s", self.tokens as f64 / s));
    }
}

pub fn run_batch(a: BatchArgs) -> Result<()> {
    let max_batch = a.max_batch.max(1);
    // One kept state: a prompt prefix the requests share (a system prompt), run once.
    let model = a.model.open_with(max_batch, 1)?;
    let name = a.model.model.file_name().map_or("deltafin".to_string(), |n| n.to_string_lossy().into_owned());
    let cfg = BatchConfig {
        input: a.input.clone(),
        output: a.output.clone(),
        max_batch,
        model_name: name,
        default_max_tokens: a.default_max_tokens,
        draft_max: a.model.draft_max(),
    };
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} requests, ETA {eta}, {msg}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    let mut progress = Bar { bar, started: Instant::now(), tokens: 0 };
    let s = deltafin_server::run_batch(&cfg, model, &mut progress).with_context(|| format!("running the batch {}", a.input.display()))?;
    progress.bar.finish_and_clear();
    eprintln!(
        "batch: {} requests ({} done earlier), {} answered 200, {} with errors | {} prompt + {} generated tokens in {:.1} s, {:.2} generated tok/s",
        s.total,
        s.skipped,
        s.succeeded,
        s.failed,
        s.prompt_tokens,
        s.completion_tokens,
        s.seconds,
        s.completion_tokens as f64 / s.seconds.max(1e-9)
    );
    if s.cached_tokens > 0 {
        eprintln!(
            "shared prefixes: {} of {} prompt tokens started from a prefix another request ran ({} computed)",
            s.cached_tokens,
            s.prompt_tokens,
            s.prompt_tokens - s.cached_tokens.min(s.prompt_tokens)
        );
    }
    if s.steps > 0 {
        eprintln!(
            "lockstep: {} steps, {:.1} sequences per step, {:.1} distinct experts per step, {:.1} MB of experts read per generated token",
            s.steps,
            s.sequences_per_step(),
            s.distinct_experts_per_step(),
            s.bytes_per_token() / 1e6
        );
    }
    Ok(())
}
