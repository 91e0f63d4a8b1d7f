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
    /// Cores of the machine to plan for (default: this machine's compute threads). The rates
    /// measured here are scaled as if products scaled with cores.
    #[arg(long)]
    pub cores: Option<usize>,
    /// How fast one of its cores is against one of this machine's (e.g. 1.3), for its compute.
    #[arg(long, default_value_t = 1.0)]
    pub core_speed: f64,
}

pub fn run_plan(a: PlanArgs) -> Result<()> {
    if a.drives.is_empty() {
        bail!("give each drive's read rate with --drive (e.g. --drive 7.1G --drive 5.7G for two drives of 7.1 and 5.7 GB/s)");
    }
    if let Some(e) = a.read_efficiency.filter(|e| !(0.0 < *e && *e <= 1.0)) {
        bail!("--read-efficiency {e} must be in (0, 1]");
    }
    if a.cores == Some(0) || !(a.core_speed > 0.0 && a.core_speed.is_finite()) {
        bail!("--cores must be at least 1 and --core-speed a positive number");
    }
    // The compute pool's size, as rayon sizes it (`-t` sets RAYON_NUM_THREADS).
    let here = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let compute_scale = a.cores.unwrap_or(here) as f64 / here as f64 * a.core_speed;
    let sizes = deltafin::model_sizes(&a.model).with_context(|| format!("reading {}", a.model.display()))?;
    eprintln!("measuring this machine's kernels at the model's shapes (a few seconds)...");
    let rates = ComputeRates::measure(&sizes.config, &Cpu::best());
    let input = PlanInput {
        ram: a.ram,
        drives: a.drives.iter().map(|&d| d as f64).collect(),
        read_efficiency: a.read_efficiency,
        prompt_tokens: a.prompt_tokens,
        context: a.context,
        compute_scale,
    };
    let plan = Plan::new(&sizes, &input, &rates);
    let c = &sizes.config;
    println!(
        "{}: {} layers, {} experts of {} per MoE layer, top-{}; RAM {}; {} {}; compute {}",
        a.model.display(),
        c.num_layers,
        c.num_experts,
        deltafin::size(c.expert_shape().total_bytes() as f64),
        c.experts_per_token,
        deltafin::size(a.ram as f64),
        if a.drives.len() == 1 { "drive" } else { "drives" },
        a.drives.iter().map(|d| format!("{}/s", deltafin::size(*d as f64))).collect::<Vec<_>>().join(", "),
        match a.cores {
            Some(n) => format!("{n} cores at {}x this machine's per core (this machine: {here} threads)", a.core_speed),
            None => format!(
                "this machine's {here} threads{}",
                if a.core_speed != 1.0 { format!(" at {}x", a.core_speed) } else { String::new() }
            ),
        }
    );
    print!("{}", plan.render(&rates));
    if !plan.fits {
        bail!(
            "the model does not fit in --ram {}: it needs at least {} (spine layers streamed, one expert cached)",
            deltafin::size(a.ram as f64),
            deltafin::size(plan.minimum_ram as f64)
        );
    }
    Ok(())
}
