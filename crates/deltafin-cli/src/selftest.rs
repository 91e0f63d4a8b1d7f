//! `deltafin selftest`: checks on this machine that a backend (a GPU) gives the CPU's bits, on
//! the models given: prompts in one pass and in chunks, steps of 1 to 32 slots mixing prompt,
//! decode and verify rows, verify steps cut back to every prefix, drafted generation, and a
//! sequence that moves between the CPU and the GPU mid-generation. Every logit and every layer
//! state is compared bit for bit; one difference fails the command, naming the case.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use deltafin::{
    BackendChoice, Compute, DraftWith, EngineBuilder, GenerateOptions, Generator, LoadedModel, LogitRows, Mat, OnToken, Phase, Sequence,
    Slot,
};

#[derive(Args, Debug)]
pub struct SelftestArgs {
    /// A model to check (checkpoint folder or store); repeat for several.
    #[arg(long = "model", required = true)]
    pub models: Vec<PathBuf>,
    /// The backend held to the CPU's bits.
    #[arg(long, default_value = "cuda", value_name = "cpu|cuda|auto")]
    pub backend: BackendChoice,
    /// Most bytes of weights kept on the GPU (a small value exercises eviction).
    #[arg(long, value_parser = crate::store_cmds::parse_size)]
    pub gpu_memory: Option<u64>,
    /// Tokens of the longest prompt.
    #[arg(long, default_value_t = 48)]
    pub prompt: usize,
}

/// The CPU's model and the backend's, over one checkpoint, and a tally of what was compared.
struct Pair {
    cpu: LoadedModel,
    other: LoadedModel,
    vocab: usize,
    values: usize,
    cases: usize,
}

/// Deterministic token ids below `vocab`.
fn tokens(n: usize, seed: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + seed * 104_729 + 13) % vocab) as u32).collect()
}

impl Pair {
    fn same(&mut self, case: &str, want: &Mat, got: &Mat) -> Result<()> {
        if (want.rows, want.cols) != (got.rows, got.cols) {
            bail!("{case}: logits [{}, {}] on the CPU, [{}, {}] here", want.rows, want.cols, got.rows, got.cols);
        }
        if let Some(i) = want.data.iter().zip(&got.data).position(|(a, b)| a.to_bits() != b.to_bits()) {
            let n = want.data.iter().zip(&got.data).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            bail!(
                "{case}: {n} of {} logits differ from the CPU's; the first, row {} column {}: {:e} on the CPU, {:e} here",
                want.data.len(),
                i / want.cols,
                i % want.cols,
                want.data[i],
                got.data[i]
            );
        }
        self.values += want.data.len();
        Ok(())
    }

    fn same_state(&self, case: &str, want: &Sequence, got: &Sequence) -> Result<()> {
        if want.ids() != got.ids() || want.layer_states() != got.layer_states() {
            bail!("{case}: the sequence's state differs from the CPU's");
        }
        Ok(())
    }

    fn after(model: &LoadedModel, prompt: &[u32]) -> Result<Sequence> {
        let mut seq = model.new_sequence();
        model.engine().step(&mut [Slot::new(&mut seq, prompt, Phase::Prompt)], None)?;
        Ok(seq)
    }

    /// A prompt's logits at every position (the backend's model prefills in chunks of 7).
    fn prompt(&mut self, len: usize) -> Result<()> {
        let ids = tokens(len, 1, self.vocab);
        let (mut a, mut b) = (self.cpu.new_sequence(), self.other.new_sequence());
        let (la, _) = self.cpu.engine().forward(&mut a, &ids, LogitRows::All)?;
        let (lb, _) = self.other.engine().forward(&mut b, &ids, LogitRows::All)?;
        self.same(&format!("a {len}-token prompt"), &la, &lb)?;
        self.same_state("a prompt", &a, &b)?;
        self.cases += 1;
        Ok(())
    }

    /// One step of `n` slots: prompts, decodes and verifies side by side.
    fn step(&mut self, n: usize) -> Result<()> {
        let v = self.vocab;
        let work: Vec<(Vec<u32>, Vec<u32>, Phase)> = (0..n)
            .map(|i| match i % 3 {
                0 => (Vec::new(), tokens(3 + i % 7, i, v), Phase::Prompt),
                1 => (tokens(5, i, v), tokens(1, i + 50, v), Phase::Decode),
                _ => (tokens(4, i, v), tokens(4, i + 90, v), Phase::Verify),
            })
            .collect();
        let mut outs = Vec::new();
        let mut seqs = Vec::new();
        for m in [&self.cpu, &self.other] {
            let mut s: Vec<Sequence> =
                work.iter().map(|(p, _, _)| if p.is_empty() { Ok(m.new_sequence()) } else { Self::after(m, p) }).collect::<Result<_>>()?;
            let mut slots: Vec<Slot> = s.iter_mut().zip(&work).map(|(seq, (_, new, ph))| Slot::new(seq, new, *ph)).collect();
            outs.push(m.engine().step(&mut slots, None)?);
            drop(slots);
            seqs.push(s);
        }
        for i in 0..n {
            self.same(&format!("slot {i} of a {n}-slot step"), &outs[0].logits[i], &outs[1].logits[i])?;
            self.same_state(&format!("slot {i} of a {n}-slot step"), &seqs[0][i], &seqs[1][i])?;
        }
        self.cases += 1;
        Ok(())
    }

    /// A verify step cut back to each prefix equals never having run the rest.
    fn rollback(&mut self) -> Result<()> {
        let (prompt, drafts) = (tokens(9, 5, self.vocab), tokens(5, 6, self.vocab));
        for keep in 0..=drafts.len() {
            let mut b = Self::after(&self.other, &prompt)?;
            self.other.engine().step(&mut [Slot::new(&mut b, &drafts, Phase::Verify)], None)?;
            self.other.engine().rewind(&mut b, prompt.len() + keep)?;
            let mut whole = prompt.clone();
            whole.extend_from_slice(&drafts[..keep]);
            let mut a = Self::after(&self.cpu, &whole)?;
            let case = format!("a verify cut back to {keep} of {}", drafts.len());
            self.same_state(&case, &a, &b)?;
            let la = self.cpu.engine().step(&mut [Slot::new(&mut a, &[3], Phase::Decode)], None)?;
            let lb = self.other.engine().step(&mut [Slot::new(&mut b, &[3], Phase::Decode)], None)?;
            self.same(&case, &la.logits[0], &lb.logits[0])?;
        }
        self.cases += 1;
        Ok(())
    }

    /// Greedy generation: drafted on the backend's model, plain on the CPU's: the same ids.
    fn drafted(&mut self) -> Result<()> {
        // A repeating prompt gives n-gram drafts something to propose.
        let prompt: Vec<u32> = tokens(6, 8, self.vocab).into_iter().cycle().take(24).collect();
        let mut ids = [Vec::new(), Vec::new()];
        for (m, (ids, draft)) in [&self.cpu, &self.other].into_iter().zip(ids.iter_mut().zip([0, 4])) {
            let opts = GenerateOptions::new(16).draft_max(draft).draft_gate(false);
            Generator::new(m).generate(
                &prompt,
                &opts,
                &mut OnToken(|s: deltafin::Step<'_>| {
                    ids.push(s.id);
                    true
                }),
            )?;
        }
        if ids[0] != ids[1] {
            bail!("drafted generation: {:?} on the CPU, {:?} here", ids[0], ids[1]);
        }
        self.cases += 1;
        Ok(())
    }

    /// A sequence decoded on the CPU, moved to the backend, then back: the ids and logits of a
    /// sequence that never moved.
    fn moves(&mut self) -> Result<()> {
        let prompt = tokens(10, 11, self.vocab);
        let mut stay = Self::after(&self.cpu, &prompt)?;
        let mut moved = Self::after(&self.cpu, &prompt)?;
        let mut next = [3u32, 3u32];
        for i in 0..12 {
            // Tokens 4 to 7 on the backend, the rest on the CPU.
            let here = if (4..8).contains(&i) { &self.other } else { &self.cpu };
            let la = self.cpu.engine().step(&mut [Slot::new(&mut stay, &[next[0]], Phase::Decode)], None)?;
            let lb = here.engine().step(&mut [Slot::new(&mut moved, &[next[1]], Phase::Decode)], None)?;
            self.same(&format!("token {i} of a sequence moved between the CPU and the backend"), &la.logits[0], &lb.logits[0])?;
            next = [deltafin::argmax(la.logits[0].row(0)) as u32, deltafin::argmax(lb.logits[0].row(0)) as u32];
        }
        self.same_state("a moved sequence", &stay, &moved)?;
        self.cases += 1;
        Ok(())
    }
}

pub fn run_selftest(a: SelftestArgs) -> Result<()> {
    let compute = Compute::open(a.backend, a.gpu_memory)?;
    eprintln!("checking {} against the CPU's bits", compute.name());
    let mut failed = 0;
    for path in &a.models {
        crate::run::check_model_path(path)?;
        let started = Instant::now();
        let open = |b: &EngineBuilder| -> Result<LoadedModel> { b.clone().open().with_context(|| format!("opening {}", path.display())) };
        let base = EngineBuilder::new(path).max_sequences(32);
        let cpu = open(&base.clone().backend(std::sync::Arc::new(deltafin::Cpu::best())))?;
        let other = open(&base.backend(compute.backend()).prefill_chunk(Some(7)).draft(Some(DraftWith::Ngram)))?;
        let vocab = cpu.engine().model().config().vocab_size;
        let mut p = Pair { cpu, other, vocab, values: 0, cases: 0 };
        let result = (|| -> Result<()> {
            p.prompt(a.prompt)?;
            for n in [1, 2, 5, 13, 32] {
                p.step(n)?;
            }
            p.rollback()?;
            p.drafted()?;
            p.moves()
        })();
        match result {
            Ok(()) => println!(
                "{}: {} cases, {} logits compared, every one the CPU's bits ({:.1} s)",
                path.display(),
                p.cases,
                p.values,
                started.elapsed().as_secs_f64()
            ),
            Err(e) => {
                failed += 1;
                println!("{}: FAILED after {} cases: {e:#}", path.display(), p.cases);
            }
        }
    }
    if let Some(g) = compute.gpu_stats() {
        println!("{}", g.summary());
    }
    if failed > 0 {
        bail!("{failed} of {} models differ from the CPU", a.models.len());
    }
    Ok(())
}
