//! `deltafin serve`: the OpenAI-compatible server.

use anyhow::Result;
use clap::Args;

use crate::run::ModelArgs;

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on (loopback by default: nothing is exposed unless you ask).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (a port in use is an error that says so).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1 requests.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Requests that may wait while one generates; more get 429.
    #[arg(long, default_value_t = 8)]
    pub max_queue: usize,
    /// Largest accepted request body.
    #[arg(long, default_value = "4M", value_parser = crate::store_cmds::parse_size)]
    pub max_body: u64,
    /// Seconds a client may take to send its request body; a stalled upload gets 408 and its
    /// connection back.
    #[arg(long, default_value_t = 30)]
    pub body_timeout: u64,
    /// Seconds a client may take to send a request's line and headers; a connection whose head
    /// does not arrive in time (or that sits idle between requests as long) is closed.
    #[arg(long, default_value_t = 10)]
    pub header_timeout: u64,
    /// Open connections at most; more get 503 at once. Lowered to fit the process's file limit,
    /// which is raised to its hard maximum at start, with 256 handles kept for the model's files.
    #[arg(long, default_value_t = 1024)]
    pub max_connections: usize,
    /// max_tokens when a request gives none (clamped to what the context has left).
    #[arg(long, default_value_t = 512)]
    pub default_max_tokens: usize,
    /// Seconds between SSE keep-alive comments while a streamed request waits or its prompt is
    /// processed (so clients with idle timeouts do not give up).
    #[arg(long, default_value_t = 10)]
    pub keep_alive: u64,
    /// Requests generated together, in lockstep: one expert read serves all of them, each gets
    /// its solo output. The RAM budget must hold this many sequences' state. 1: one at a time.
    /// With --draft, each request in the batch drafts by prompt lookup (a draft model only at 1).
    #[arg(long, default_value_t = 1)]
    pub max_batch: usize,
    /// RAM for this many sequences' state at the context limit, kept between requests so that a
    /// conversation's next turn runs only its new tokens (several short conversations fit in one).
    /// 0: nothing kept.
    #[arg(long, default_value_t = 1)]
    pub keep_states: usize,
    /// Put K3's reasoning in `content` inside <think>...</think> instead of in
    /// `reasoning_content` (for clients that show only `content`).
    #[arg(long)]
    pub reasoning_in_content: bool,
}

pub fn run_serve(a: ServeArgs) -> Result<()> {
    // One line per request and a startup summary on stderr (RUST_LOG=debug for more).
    let level = if crate::say::quiet() {
        "warn"
    } else if crate::say::verbose() {
        "debug"
    } else {
        "info"
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
    if !a.model.model.exists() && !a.model.model.to_string_lossy().starts_with("hf://") {
        anyhow::bail!(
            "{}: no such model folder or store (a checkpoint folder with config.json, or a store made by `deltafin setup`)",
            a.model.model.display()
        );
    }
    let exposed = !matches!(a.host.as_str(), "127.0.0.1" | "localhost" | "::1");
    if exposed && a.api_key.is_none() {
        tracing::warn!(host = %a.host, "listening beyond loopback without --api-key: anyone who can reach this port can use the model");
    }
    let name = a.model.model.file_name().map_or("deltafin".to_string(), |n| n.to_string_lossy().into_owned());
    let cfg = deltafin_server::ServerConfig {
        host: a.host.clone(),
        port: a.port,
        api_key: a.api_key.clone(),
        max_queue: a.max_queue,
        max_body_bytes: a.max_body as usize,
        body_timeout_s: a.body_timeout,
        header_timeout_s: a.header_timeout,
        max_connections: connection_cap(a.max_connections),
        default_max_tokens: a.default_max_tokens,
        model_name: name,
        keep_alive_s: a.keep_alive,
        draft_max: a.model.draft_max(),
        draft_gate: !a.model.draft_fixed,
        max_batch: a.max_batch.max(1),
        reasoning_in_content: a.reasoning_in_content,
    };
    let margs = a.model.clone();
    let (slots, kept) = (a.max_batch.max(1), a.keep_states);
    let (budget, context) = (a.model.ram_budget, a.max_batch);
    deltafin_server::serve_blocking(cfg, move || {
        let model = margs.open_with(slots, kept).map_err(|e| format!("{e:#}"))?;
        let stats = model.engine().experts().stats();
        tracing::info!(
            model = %margs.model.display(),
            ram_budget = ?budget,
            context = model.new_sequence().context_limit(),
            max_batch = context,
            drives = stats.per_home.len(),
            "model loaded"
        );
        Ok(model)
    })?;
    Ok(())
}

/// Handles kept for the model's own files (store packs, spine, cache, logs) whatever the clients do.
const FILES_FOR_THE_MODEL: u64 = 256;

/// Raises the soft limit on open files to the hard one and fits `wanted` connections under it,
/// leaving [`FILES_FOR_THE_MODEL`]: clients can then never take the handles the store needs.
// `rlim_t` is u64 on Linux and macOS but not on every unix.
#[allow(clippy::unnecessary_cast)]
fn connection_cap(wanted: usize) -> usize {
    #[cfg(unix)]
    {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit/setrlimit with a valid pointer to a local rlimit.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
                if lim.rlim_cur < lim.rlim_max {
                    let raised = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                        lim.rlim_cur = lim.rlim_max;
                    }
                }
                let room = (lim.rlim_cur as u64).saturating_sub(FILES_FOR_THE_MODEL).max(16);
                if (wanted as u64) > room {
                    tracing::warn!(
                        wanted,
                        allowed = room,
                        open_file_limit = lim.rlim_cur as u64,
                        "--max-connections lowered to fit the open-file limit (raise it with `ulimit -n`)"
                    );
                    return room as usize;
                }
            }
        }
    }
    wanted.max(1)
}
