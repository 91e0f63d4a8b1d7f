//! `cargo xtask bench gpu --model DIR`: the engine on this CPU (every core) and on the GPU over
//! one checkpoint, interleaved in one run: a prompt's prefill and the decode after it, the GPU's
//! weights already uploaded (a warm-up pass each goes first and is not counted), ids compared.
//! Runs from a prebuilt `xtask` on a GPU machine (`.ci/gpu-proof`).

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use deltafin_core::{argmax, Cpu};
use deltafin_cuda::CudaBackend;
use deltafin_sched::{EngineBuilder, LoadedModel, LogitRows};

use super::engine_runs::spread;

/// Decoded tokens timed after each prompt.
const DECODE: usize = 16;

#[derive(Default)]
struct Timings {
    prefill_s: Vec<f64>,
    decode_tok_s: Vec<f64>,
    /// Per prefill: seconds inside the GPU's operations (copies included).
    gpu_s: Vec<f64>,
    ids: Vec<Vec<u32>>,
}

/// One prefill of `prompt` and [`DECODE`] greedy tokens after it.
fn once(m: &LoadedModel, prompt: &[u32], t: &mut Timings, gpu: Option<&CudaBackend>) -> Result<()> {
    let mut seq = m.new_sequence();
    let g0 = gpu.map_or(0.0, |g| g.stats().gpu_s);
    let start = Instant::now();
    let (l, _) = m.engine().forward(&mut seq, prompt, LogitRows::Last)?;
    t.prefill_s.push(start.elapsed().as_secs_f64());
    t.gpu_s.push(gpu.map_or(0.0, |g| g.stats().gpu_s) - g0);
    let mut next = argmax(l.row(0)) as u32;
    let mut ids = vec![next];
    let start = Instant::now();
    for _ in 1..DECODE {
        let (l, _) = m.engine().forward(&mut seq, &[next], LogitRows::Last)?;
        next = argmax(l.row(0)) as u32;
        ids.push(next);
    }
    t.decode_tok_s.push((DECODE - 1) as f64 / start.elapsed().as_secs_f64());
    t.ids.push(ids);
    Ok(())
}

/// The table, as Markdown.
pub fn run(model: &Path, prompt_len: usize, reps: usize) -> Result<String> {
    let cpu = EngineBuilder::new(model).backend(Arc::new(Cpu::best())).open().with_context(|| format!("opening {}", model.display()))?;
    let backend = Arc::new(CudaBackend::open(0, None)?);
    let gpu = EngineBuilder::new(model).backend(backend.clone()).open()?;
    let vocab = cpu.engine().model().config().vocab_size;
    let prompt: Vec<u32> = (0..prompt_len).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    let (mut c, mut g) = (Timings::default(), Timings::default());
    // Warm-up: the GPU's weights uploaded, the CPU's pages read in.
    once(&cpu, &prompt, &mut Timings::default(), None)?;
    once(&gpu, &prompt, &mut Timings::default(), Some(&backend))?;
    for _ in 0..reps {
        once(&cpu, &prompt, &mut c, None)?;
        once(&gpu, &prompt, &mut g, Some(&backend))?;
    }
    let equal = c.ids.iter().chain(&g.ids).all(|ids| *ids == c.ids[0]);
    let threads = rayon::current_num_threads();
    let mut md = format!(
        "## The engine on the GPU\n\n`xtask bench gpu --model {} --prompt {prompt_len} --reps {reps}`: a {prompt_len}-token prompt's \
         prefill, then {DECODE} greedy tokens, on {threads} CPU threads and on {}, interleaved, after one warm-up pass each (the \
         GPU's weights uploaded). GPU s: time inside the GPU's operations, copies of activations included; the rest of its \
         prefill is the CPU's share (attention, KDA, norms).\n\n| backend | prefill s min / median / max | prompt tok/s (median) | \
         GPU s (median) | decode tok/s min / median / max |\n|---|---|---|---|---|\n",
        model.display(),
        backend.device()
    );
    for (name, t) in [(format!("cpu ({threads} threads)"), &c), ("cuda".to_string(), &g)] {
        let (a, b, z) = spread(&t.prefill_s);
        let (da, db, dz) = spread(&t.decode_tok_s);
        writeln!(
            md,
            "| {name} | {a:.3} / {b:.3} / {z:.3} | {:.0} | {:.3} | {da:.1} / {db:.1} / {dz:.1} |",
            prompt_len as f64 / b,
            spread(&t.gpu_s).1
        )?;
    }
    writeln!(
        md,
        "\nPrefill: the GPU {:.1}x the CPU (median over median); decode {:.2}x. Ids equal on every pass: {equal}. {}.",
        spread(&c.prefill_s).1 / spread(&g.prefill_s).1,
        spread(&g.decode_tok_s).1 / spread(&c.decode_tok_s).1,
        backend.stats().summary()
    )?;
    anyhow::ensure!(equal, "the GPU's ids differ from the CPU's:\n{md}");
    Ok(md)
}
