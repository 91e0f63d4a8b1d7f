//! `cargo xtask`: project automation in Rust (test models, the demo, benchmarks, tidy checks).

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Deltafin project automation")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Write a K3-format checkpoint in the exact release layout.
    GenK3 {
        /// tiny, small, slice (real expert size, several GB), slice-hot, slice-mini, rand, or
        /// k3 (the real model's full layout, 1.56 TB: only with --sparse).
        #[arg(long, default_value = "tiny")]
        preset: String,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long)]
        out: PathBuf,
        /// Every weight zero, left unwritten (sparse files): the layout at almost no disk cost.
        #[arg(long)]
        sparse: bool,
    },
    /// Train the tiny trained K3's byte-level BPE on the corpus (training/corpus.sh) and write it
    /// as K3 ships its tokenizer (tiktoken ranks + tokenizer_config.json with K3's specials).
    TrainTokenizer {
        /// The corpus folder training/corpus.sh wrote.
        #[arg(long, default_value = "models/corpus")]
        corpus: PathBuf,
        /// BPE ranks, the 256 bytes included.
        #[arg(long, default_value_t = 8192)]
        ranks: usize,
        /// How many times the fiction is counted (it is a third of the docs' size; prose should
        /// shape the merges as much as reST and code).
        #[arg(long, default_value_t = 2)]
        fiction_weight: usize,
        #[arg(long, default_value = "training/tokenizer")]
        out: PathBuf,
    },
    /// Tokenize the corpus (training/corpus.sh) with training/tokenizer into the uint16 token
    /// files training/train.py reads.
    TokenizeCorpus {
        #[arg(long, default_value = "models/corpus")]
        corpus: PathBuf,
        #[arg(long, default_value = "models/tokens")]
        out: PathBuf,
    },
    /// Write what training/train.py produced (for --model k3 and --model draft) as the release
    /// layouts: the K3 exactly as moonshotai/Kimi-K3, the draft as a Hugging Face Qwen3.
    ExportTrained {
        /// The folder train.py wrote (--out).
        #[arg(long)]
        from: PathBuf,
        #[arg(long, default_value = "training/models")]
        out: PathBuf,
    },
    /// Write a small Qwen3-architecture draft checkpoint (Hugging Face layout, real tokenizer).
    GenQwen3 {
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Share this K3 checkpoint's vocabulary (drafts then pass K3's ids directly) instead of
        /// Qwen3's own tokenizer.
        #[arg(long)]
        vocab_from: Option<PathBuf>,
        #[arg(long)]
        out: PathBuf,
    },
    /// The built-in demo: install the committed tiny trained K3 over two drives and generate
    /// with its draft, streaming experts.
    Demo {
        #[arg(long, default_value = "It was a bright cold morning, and")]
        prompt: String,
        #[arg(long, default_value_t = 96)]
        max_new: usize,
        /// RAM budget: the spine, working memory, and an expert cache of about a quarter of the
        /// model's 8.4 MB of experts.
        #[arg(long, default_value = "61M")]
        ram_budget: String,
    },
    /// Benchmarks on generated slice models; updates docs/BENCHMARKS.md.
    Bench {
        #[arg(value_enum, default_value = "all")]
        which: xtask::bench::Which,
        /// A short version of each benchmark (under 3 minutes).
        #[arg(long)]
        quick: bool,
        /// Also write machine-readable results here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// What caps emulated drives. The ladder: the kernel's throttle where it can, else the
        /// engine's reader (`auto`), or one of them. The capped decode run: the reader unless
        /// `cgroup` (the kernel's throttle banks short idle, which the reader's clock does not).
        #[arg(long, value_enum, default_value = "auto")]
        limiter: xtask::bench::Limiter,
        /// `ab` only: the revision to compare this tree against.
        #[arg(long)]
        base: Option<String>,
        /// `ab`: the `gen-k3` preset both revisions run (`slice` has K3's own widths); `gpu`: a
        /// preset or a checkpoint folder.
        #[arg(long, default_value = "small")]
        model: String,
        /// `gpu` only: prompt tokens.
        #[arg(long, default_value_t = 512)]
        prompt: usize,
    },
    /// Run the kernel and fixture tests for aarch64 under qemu (NEON), needs Debian's
    /// qemu-user, gcc-aarch64-linux-gnu and `rustup target add aarch64-unknown-linux-gnu`.
    TestAarch64,
    /// Plant random faults in a store (flipped bytes, changed digits, files of another
    /// checkpoint) and check each run gives the reference ids or a clear error, and doctor
    /// reports each; fails on any silent wrong output or panic.
    FuzzStore {
        #[arg(long, default_value_t = 500)]
        cases: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Also write the summary (markdown) here.
        #[arg(long)]
        report: Option<PathBuf>,
    },
    /// Make mlx-lm reference logits for random tiny configs (needs mlx[cpu] + mlx-lm).
    Oracle {
        #[arg(long, value_delimiter = ',', default_value = "1,2,3,4,5,6")]
        seeds: Vec<u64>,
        #[arg(long, default_value_t = 24)]
        tokens: usize,
        /// Instead: reference logits for the `gen-qwen3` drafts from mlx-lm's `qwen3`.
        #[arg(long)]
        qwen3: bool,
        /// Instead: mlx-lm's logits on the committed trained K3 and draft (training/models).
        #[arg(long)]
        trained: bool,
    },
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::GenK3 { preset, seed, out, sparse } => xtask::gen_k3::generate_with(&preset, seed, &out, sparse),
        #[cfg(feature = "train")]
        Cmd::TrainTokenizer { corpus, ranks, fiction_weight, out } => {
            let mut files = vec![corpus.join("lit.txt"); fiction_weight.max(1)];
            files.push(corpus.join("tech.txt"));
            xtask::train_tokenizer::train(&files, ranks, &out)
        }
        #[cfg(not(feature = "train"))]
        Cmd::TrainTokenizer { .. } => {
            anyhow::bail!("this xtask was built without the `train` feature (the GPU bundle's); use `cargo xtask`")
        }
        Cmd::TokenizeCorpus { corpus, out } => xtask::trained::tokenize_corpus(&corpus, &out),
        Cmd::ExportTrained { from, out } => xtask::trained::export(&from, &out),
        Cmd::GenQwen3 { seed, vocab_from, out } => xtask::gen_qwen3::generate(seed, vocab_from.as_deref(), &out),
        Cmd::Demo { prompt, max_new, ram_budget } => xtask::demo::demo(&prompt, max_new, &ram_budget),
        Cmd::Bench { which, quick, json, limiter, base, model, prompt } => {
            xtask::bench::run(which, quick, json.as_deref(), limiter, base.as_deref(), &model, prompt)
        }
        Cmd::TestAarch64 => {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            for (pkg, extra) in [("deltafin-core", vec![]), ("deltafin-sched", vec!["--test", "fixture"])] {
                let st = std::process::Command::new(&cargo)
                    .args(["test", "--release", "--target", "aarch64-unknown-linux-gnu", "-p", pkg])
                    .args(extra)
                    .env("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER", "aarch64-linux-gnu-gcc")
                    .env("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER", "qemu-aarch64 -L /usr/aarch64-linux-gnu")
                    .status()?;
                anyhow::ensure!(st.success(), "aarch64 tests of {pkg} failed");
            }
            Ok(())
        }
        Cmd::Oracle { seeds, tokens, qwen3, trained } => {
            if trained {
                xtask::oracle::run_trained()
            } else if qwen3 {
                xtask::oracle::run_qwen3()
            } else {
                xtask::oracle::run(&seeds, tokens)
            }
        }
        Cmd::FuzzStore { cases, seed, report } => xtask::fuzz_store::run_fuzz(cases, seed, report.as_deref(), None),
    }
}
