//! `deltafin warm`: runs a workload's prompts through a stream store so that every expert they
//! route is fetched and cached before the workload itself runs (or goes offline).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use deltafin::{Generator, Message, NoProgress, OnToken, Role, Step};
use indicatif::{ProgressBar, ProgressStyle};

use crate::run::ModelArgs;

#[derive(Args, Debug)]
pub struct WarmArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The workload's prompts, one per line (blank lines are skipped).
    #[arg(long)]
    pub prompts: PathBuf,
    /// Render each prompt as a user message in K3's chat format (as `chat` and the server's
    /// chat completions do), so the experts of the chat template are fetched too.
    #[arg(long)]
    pub chat: bool,
    /// Tokens to generate after each prompt: the experts their decoding routes are fetched too.
    #[arg(long, default_value_t = 1)]
    pub max_new: usize,
}

/// `(cached experts, streamed experts, cached bytes)` of a stream store.
fn cache_of(model: &std::path::Path) -> Result<(usize, usize, u64)> {
    match deltafin::doctor(model, false, &NoProgress)?.stream_cache {
        Some(c) => Ok(c),
        None => bail!(
            "{} is not a stream store: every expert of it is local already (warm fetches the experts a workload routes into a store made by `deltafin setup --stream`)",
            model.display()
        ),
    }
}

pub fn run_warm(a: WarmArgs) -> Result<()> {
    let before = cache_of(&a.model.model)?;
    let text = std::fs::read_to_string(&a.prompts).with_context(|| format!("reading prompts from {}", a.prompts.display()))?;
    let prompts: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    if prompts.is_empty() {
        bail!("{} holds no prompts: write one prompt per line", a.prompts.display());
    }
    let model = a.model.open()?;
    let bar = ProgressBar::new(prompts.len() as u64).with_style(
        ProgressStyle::with_template("warming [{bar:32}] {pos}/{len} prompts, {msg} ETA {eta}").expect("template").progress_chars("=> "),
    );
    let mut generator = Generator::new(&model);
    let mut tokens = 0usize;
    for p in &prompts {
        let ids = if a.chat {
            model.chat()?.render(&[Message::new(Role::User, p.to_string())], None)?
        } else {
            model.tokenizer().encode_ordinary(p)
        };
        if ids.is_empty() {
            continue;
        }
        // Each prompt alone: what one prompt's routing needs does not depend on the others.
        generator.reset();
        let stats = generator.generate(&ids, &a.model.generate_options(a.max_new), &mut OnToken(|_: Step<'_>| true))?;
        tokens += ids.len() + stats.generated_tokens;
        bar.set_message(format!("{tokens} tokens"));
        bar.inc(1);
    }
    bar.finish();
    drop(generator);
    drop(model);
    let after = cache_of(&a.model.model)?;
    eprintln!(
        "warm: {} prompts ({tokens} tokens) route {} more experts, now cached: {} of {} ({:.1} MB){}",
        prompts.len(),
        after.0.saturating_sub(before.0),
        after.0,
        after.1,
        after.2 as f64 / 1e6,
        if after.0 < before.0 { "; some were evicted to stay within --disk-budget" } else { "" }
    );
    Ok(())
}
