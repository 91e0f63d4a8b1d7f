//! `deltafin plan`: what a model will do on a machine, before running it there.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use deltafin::{ComputeRates, Cpu, Plan, PlanInput};

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// A checkpoint folder, hf://OWNER/REPO (local Hugging Face cache) or a store.
    #[arg(long)]
    pub model: PathBuf,
    /// RAM the engine may use (the --ram-budget it would run with), e.g. 96G.
    #[arg(long, value_parser = crate::store_cmds::parse_size)]
    pub ram: u64,
    /// A drive's sequential read rate (e.g. 7.1G for 7.1 GB/s); repeat for each drive.
    #[arg(long = "drive", value_parser = crate::store_cmds::parse_size)]
    pub drives: Vec<u64>,
    /// Share of the drives' summed rates reads reach (default: the drive ladder's measured one).
    #[arg(long)]
    pub read_efficiency: Option<f64>,
    /// Prompt length for the projected time to first token.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Most tokens a sequence may hold (sizes its state).
    #[arg(long, default_value_t = deltafin::DEFAULT_CONTEXT)]
    pub context: usize,
}

pub fn run_plan(a: PlanArgs) -> Result<()> {
    if a.drives.is_empty() {
        bail!("give each drive's read rate with --drive (e.g. --drive 7.1G --drive 5.7G for two drives of 7.1 and 5.7 GB/s)");
    }
    if let Some(e) = a.read_efficiency.filter(|e| !(0.0 < *e && *e <= 1.0)) {
        bail!("--read-efficiency {e} must be in (0, 1]");
    }
    let sizes = deltafin::model_sizes(&a.model).with_context(|| format!("reading {}", a.model.display()))?;
    eprintln!("measuring this machine's kernels at the model's shapes (a few seconds)...");
    let rates = ComputeRates::measure(&sizes.config, &Cpu::best());
    let input = PlanInput {
        ram: a.ram,
        drives: a.drives.iter().map(|&d| d as f64).collect(),
        read_efficiency: a.read_efficiency,
        prompt_tokens: a.prompt_tokens,
        context: a.context,
    };
    let plan = Plan::new(&sizes, &input, &rates);
    let c = &sizes.config;
    println!(
        "{}: {} layers, {} experts of {:.1} MB per MoE layer, top-{}; RAM {:.1} GB; drives {}",
        a.model.display(),
        c.num_layers,
        c.num_experts,
        c.expert_shape().total_bytes() as f64 / 1e6,
        c.experts_per_token,
        a.ram as f64 / 1e9,
        a.drives.iter().map(|d| format!("{:.1} GB/s", *d as f64 / 1e9)).collect::<Vec<_>>().join(", ")
    );
    print!("{}", plan.render(&rates));
    Ok(())
}
