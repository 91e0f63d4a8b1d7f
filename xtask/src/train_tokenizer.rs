//! `cargo xtask train-tokenizer`: the tiny trained K3's tokenizer (issue 20). A byte-level BPE
//! learnt on the corpus (`training/corpus.sh`) with K3's own pre-tokenizer pattern, written the
//! way K3 ships its tokenizer: a tiktoken rank file (the 256 bytes, then every merge in the order
//! learnt, so tiktoken's lowest-rank-first merging is exactly the trained BPE) and a
//! `tokenizer_config.json` with K3's special tokens at the reserved ids after the ranks. The
//! engine loads it through the same path as K3's.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{SplitDelimiterBehavior, TokenizerBuilder};

/// Trains `ranks` BPE ranks (256 bytes included) on `files` and writes `tiktoken.model` and
/// `tokenizer_config.json` into `out`.
pub fn train(files: &[PathBuf], ranks: usize, out: &Path) -> Result<()> {
    if ranks <= 256 {
        bail!("{ranks} ranks: a byte-level BPE needs more than the 256 single bytes");
    }
    for f in files {
        if !f.exists() {
            bail!("{} is missing: build the corpus first with training/corpus.sh", f.display());
        }
    }
    let split = Split::new(SplitPattern::Regex(deltafin_core::K3_PATTERN.into()), SplitDelimiterBehavior::Isolated, false)
        .map_err(|e| anyhow::anyhow!("K3's pattern: {e}"))?;
    let pre = Sequence::new(vec![PreTokenizerWrapper::Split(split), PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, false))]);
    let mut tok = TokenizerBuilder::<
        BPE,
        tokenizers::NormalizerWrapper,
        Sequence,
        tokenizers::PostProcessorWrapper,
        tokenizers::DecoderWrapper,
    >::new()
    .with_model(BPE::default())
    .with_pre_tokenizer(Some(pre))
    .build()
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(ranks)
        .min_frequency(2)
        .show_progress(true)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let paths: Vec<String> = files.iter().map(|p| p.display().to_string()).collect();
    tok.train_from_files(&mut trainer, paths).map_err(|e| anyhow::anyhow!("training: {e}"))?;
    // ByteLevel spells each byte as one character: map them back.
    let byte_of: HashMap<char, u8> =
        (0..=255u8).map(|b| (deltafin_core::byte_level_spelling(&[b]).chars().next().expect("one char"), b)).collect();
    let mut by_id: Vec<(u32, Vec<u8>)> = tok
        .get_model()
        .get_vocab()
        .into_iter()
        .map(|(s, id)| {
            s.chars()
                .map(|c| byte_of.get(&c).copied().context("a character outside the byte alphabet"))
                .collect::<Result<Vec<u8>>>()
                .map(|b| (id, b))
        })
        .collect::<Result<_>>()?;
    by_id.sort();
    // Single bytes first (ranks 0..=255 in byte order), then the merges in the order learnt.
    let mut lines: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    lines.extend(by_id.into_iter().map(|(_, b)| b).filter(|b| b.len() > 1));
    let n = lines.len();
    let text: String =
        lines.iter().enumerate().map(|(rank, b)| format!("{} {rank}\n", base64::engine::general_purpose::STANDARD.encode(b))).collect();
    std::fs::create_dir_all(out)?;
    crate::gen_k3::write_atomic(&out.join("tiktoken.model"), text.as_bytes())?;
    crate::gen_k3::write_atomic(&out.join("tokenizer_config.json"), &serde_json::to_vec_pretty(&crate::gen_k3::tokenizer_config(n))?)?;
    eprintln!("{n} ranks (+ {} reserved ids) written to {}", deltafin_core::RESERVED, out.display());
    Ok(())
}
