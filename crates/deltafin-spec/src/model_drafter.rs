//! A drafter backed by a small draft model ([`Qwen3`]): it runs greedily ahead of K3 and proposes
//! what it would write.
//!
//! **Two vocabularies.** When the draft's vocabulary spells every K3 token with the same bytes
//! under the same id (checked token by token when the drafter is made), K3's ids go straight in
//! and the draft's ids straight out. Otherwise the context is carried as text: K3's ids are
//! decoded, the text re-encoded with the draft's `tokenizer.json`, the draft's guesses decoded
//! and encoded again with K3's tokenizer, and K3 verifies those ids. Re-tokenization can only
//! cost acceptance (a boundary split differently), never exactness.
//!
//! **Its own cache.** The draft keeps its keys and values between calls and only runs what
//! changed: each call finds where its tokens and the new context part, cuts back to there (the
//! guesses K3 rejected) and runs the rest.

use std::sync::Arc;

use deltafin_core::{argmax, HfTokenizer, Tokenizer};

use crate::error::Result;
use crate::qwen3::{KvCache, Qwen3};
use crate::Drafter;

/// A draft model and its tokenizer, shared by the drafters of all sequences.
pub struct DraftModel {
    model: Qwen3,
    tokenizer: HfTokenizer,
    /// The draft spells K3's vocabulary identically: ids pass through unchanged.
    direct: bool,
}

impl DraftModel {
    /// Pairs a loaded model with its `tokenizer.json` and works out whether its vocabulary is
    /// K3's (`k3`): every K3 id must fit the draft, and every K3 BPE id have the same bytes in
    /// both.
    pub fn new(model: Qwen3, tokenizer_json: &[u8], k3: &Tokenizer) -> Result<DraftModel> {
        let tokenizer = HfTokenizer::from_json_bytes(tokenizer_json)?;
        let n = k3.bpe_len();
        let direct = k3.vocab_len() <= model.config().vocab_size
            && (0..n as u32).all(|id| tokenizer.token_bytes(id).is_some_and(|b| b == k3.id_bytes(id)));
        Ok(DraftModel { model, tokenizer, direct })
    }
    /// Whether K3's ids are used directly (no re-tokenization).
    pub fn is_direct(&self) -> bool {
        self.direct
    }
    /// The model.
    pub fn model(&self) -> &Qwen3 {
        &self.model
    }
    /// Resident bytes for `sequences` drafters at once: the weights, shared, plus a cache of
    /// `context` tokens each.
    pub fn memory_bytes(&self, context: usize, sequences: usize) -> u64 {
        self.model.weight_bytes() + (sequences.max(1) * self.model.kv_bytes_per_token() * context) as u64
    }
}

/// Drafts for one sequence with a [`DraftModel`].
pub struct ModelDrafter {
    draft: Arc<DraftModel>,
    k3: Arc<Tokenizer>,
    cache: KvCache,
    /// Draft-vocabulary ids whose keys and values `cache` holds.
    fed: Vec<u32>,
    /// The K3 context already turned into `text` (text path only).
    k3_seen: Vec<u32>,
    text: Vec<u8>,
}

impl ModelDrafter {
    /// A drafter with an empty cache.
    pub fn new(draft: Arc<DraftModel>, k3: Arc<Tokenizer>) -> ModelDrafter {
        let cache = draft.model.new_cache();
        ModelDrafter { draft, k3, cache, fed: Vec::new(), k3_seen: Vec::new(), text: Vec::new() }
    }

    /// The context in the draft's vocabulary.
    fn draft_context(&mut self, context: &[u32]) -> Result<Vec<u32>> {
        if self.draft.direct {
            return Ok(context.to_vec());
        }
        // Decode only what is new since the last call (the context grows between calls).
        if !context.starts_with(&self.k3_seen) {
            self.k3_seen.clear();
            self.text.clear();
        }
        for &id in &context[self.k3_seen.len()..] {
            self.text.extend_from_slice(&self.k3.id_bytes(id));
        }
        self.k3_seen = context.to_vec();
        Ok(self.draft.tokenizer.encode(&String::from_utf8_lossy(&self.text))?)
    }

    /// Runs `target` through the draft (reusing the cached prefix) and `n` greedy tokens past it.
    fn run_ahead(&mut self, target: &[u32], n: usize) -> Result<Vec<u32>> {
        let common = self.fed.iter().zip(target).take_while(|(a, b)| a == b).count();
        // The last context token must run again to give the next token's logits.
        let keep = common.min(target.len().saturating_sub(1));
        self.draft.model.truncate(&mut self.cache, keep);
        self.fed.truncate(keep);
        let mut logits = self.draft.model.forward(&mut self.cache, &target[keep..])?;
        self.fed.extend_from_slice(&target[keep..]);
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let t = argmax(&logits);
            out.push(t);
            if i + 1 < n {
                logits = self.draft.model.forward(&mut self.cache, &[t])?;
                self.fed.push(t);
            }
        }
        Ok(out)
    }

    fn try_draft(&mut self, context: &[u32], n: usize) -> Result<Vec<u32>> {
        let target = self.draft_context(context)?;
        if target.is_empty() {
            return Ok(Vec::new());
        }
        if self.draft.direct {
            let mut ids = self.run_ahead(&target, n)?;
            // Only K3's own ids can be verified.
            if let Some(bad) = ids.iter().position(|&t| t as usize >= self.k3.bpe_len()) {
                ids.truncate(bad);
            }
            return Ok(ids);
        }
        // A K3 token is often longer than a draft token: run a little further than asked.
        let guessed = self.run_ahead(&target, n + n / 2 + 1)?;
        let text = self.draft.tokenizer.decode(&guessed)?;
        let mut ids = self.k3.encode_ordinary(&text);
        ids.truncate(n);
        Ok(ids)
    }
}

impl Drafter for ModelDrafter {
    fn draft(&mut self, context: &[u32], n: usize) -> Vec<u32> {
        if n == 0 {
            return Vec::new();
        }
        // A draft that fails to run proposes nothing: K3 decodes on alone, output unchanged.
        self.try_draft(context, n).unwrap_or_else(|_| {
            self.fed.clear();
            self.draft.model.truncate(&mut self.cache, 0);
            Vec::new()
        })
    }
}
