//! `--temperature`, `--top-p`, `--top-k`, `--min-p`, `--seed`: seeded sampling for `run` and
//! `chat` (greedy unless a temperature above 0 is given).

use anyhow::{bail, Result};
use clap::Args;
use deltafin::Sampling;

#[derive(Args, Clone, Debug)]
#[command(next_help_heading = "Sampling (greedy unless --temperature is above 0)")]
pub struct SamplingArgs {
    /// Sample at this temperature (0, the default: greedy, K3's own choice every token).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep the most likely tokens whose probabilities sum to at least this (1: all).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep only this many of the most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Keep tokens at least this fraction as likely as the most likely one (0: all).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// The seed: the same seed and prompt give the same text on any machine, CPU or GPU, alone or
    /// batched, drafted or not (default: one is drawn and printed).
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// The sampling asked for (`None`: greedy), with the seed drawn if none was given.
    pub fn sampling(&self) -> Result<Option<Sampling>> {
        if self.temperature == 0.0 {
            return Ok(None);
        }
        let s = Sampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed.unwrap_or_else(deltafin::fresh_seed),
        };
        if let Err(e) = s.validate() {
            bail!("{e}");
        }
        if self.seed.is_none() && !crate::say::quiet() {
            eprintln!("sampling with --seed {} (pass it to get this text again)", s.seed);
        }
        Ok(Some(s))
    }
}
