//! `deltafin`: the command-line front end over the `deltafin-sched` API.

mod batch;
mod chat;
mod plan;
mod run;
mod sampling_args;
mod say;
mod selftest;
mod serve;
mod stats_json;
mod store_cmds;
mod warm;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "deltafin",
    version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("DELTAFIN_COMMIT"), ")"),
    about = "Exact Kimi K3 inference with experts streamed from SSDs"
)]
struct Cli {
    /// Compute threads (default: every core). Never changes the output.
    #[arg(short = 't', long, global = true)]
    threads: Option<usize>,
    /// Say less: no progress bars or notes, only the output, warnings and errors.
    #[arg(short = 'q', long, global = true, conflicts_with = "verbose")]
    quiet: bool,
    /// Say more: a run's stats as with --stats, the server's debug log.
    #[arg(short = 'v', long, global = true)]
    verbose: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate greedily from a prompt (text, ids, or stdin), streaming the output.
    Run(run::RunArgs),
    /// Write the logits after every prompt position to a safetensors file.
    Logits(run::LogitsArgs),
    /// Install a checkpoint into a store (spine + expert packs over one or more drives).
    Setup(store_cmds::SetupArgs),
    /// Check a store against its manifest (--verify reads every expert).
    Doctor(store_cmds::DoctorArgs),
    /// Serve an OpenAI-compatible API (loopback by default).
    Serve(serve::ServeArgs),
    /// Chat in the terminal (streaming, history, Ctrl-C stops a reply).
    Chat(chat::ChatArgs),
    /// Run an OpenAI Batch API file (JSONL) to completion, requests in lockstep; resumable.
    Batch(batch::BatchArgs),
    /// Fetch into a stream store every expert a workload's prompts route, ahead of the workload.
    Warm(warm::WarmArgs),
    /// Show what a model keeps in RAM and reads per token under a budget, and project its speed.
    Plan(plan::PlanArgs),
    /// Check that a backend (a GPU) gives the CPU's bits on these models, case by case.
    Selftest(selftest::SelftestArgs),
}

/// Makes glibc hand large freed blocks back to the system at once. Its default raises the
/// threshold for `mmap` to the largest block freed so far (up to 32 MB), after which a step's
/// logits and activations are carved from arenas that keep their pages: 16 concurrent scoring
/// requests then held 118 MB of RSS under an 80 MB `--ram-budget` (92 MB with the threshold fixed,
/// measured with the trained model). Two arenas instead of one per core: the engine's threads
/// allocate little besides those blocks.
fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; called before any other thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 10);
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

fn main() {
    return_freed_memory();
    let cli = Cli::parse();
    say::set(if cli.quiet {
        say::Level::Quiet
    } else if cli.verbose {
        say::Level::Verbose
    } else {
        say::Level::Normal
    });
    if let Some(n) = cli.threads {
        // The compute pool is rayon's global one; set before anything starts it.
        if let Err(e) = rayon_threads(n) {
            eprintln!("error: --threads {n}: {e}");
            std::process::exit(1);
        }
    }
    let result: Result<()> = match cli.cmd {
        Cmd::Run(a) => run::run(a),
        Cmd::Logits(a) => run::logits(a),
        Cmd::Setup(a) => store_cmds::run_setup(a),
        Cmd::Doctor(a) => store_cmds::run_doctor(a),
        Cmd::Serve(a) => serve::run_serve(a),
        Cmd::Chat(a) => chat::run_chat(a),
        Cmd::Batch(a) => batch::run_batch(a),
        Cmd::Warm(a) => warm::run_warm(a),
        Cmd::Plan(a) => plan::run_plan(a),
        Cmd::Selftest(a) => selftest::run_selftest(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Sizes the compute pool (the engine's kernels run on rayon's global pool).
fn rayon_threads(n: usize) -> Result<()> {
    anyhow::ensure!(n >= 1, "give at least one thread");
    // SAFETY: called first thing in main, before any other thread exists to read the environment.
    unsafe { std::env::set_var("RAYON_NUM_THREADS", n.to_string()) };
    Ok(())
}
