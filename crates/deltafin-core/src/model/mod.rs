//! The K3 model: spine weights and the per-layer steps the engine loop drives.
//!
//! A forward pass over some token rows is a walk the caller performs:
//! [`Model::embed`], then per layer [`Model::attention_block`] (Attention-Residual mix, KDA or MLA,
//! the second mix and norm) followed by either [`Model::dense_mlp`] or the MoE steps
//! ([`Model::route`], [`Model::moe_latent_in`], [`Model::moe_shared`], [`expert_forward`] per
//! expert, [`MoeCombine`], [`Model::moe_finish`]), then [`Model::finish_layer`]; finally [`Model::logits`]. Keeping the
//! walk outside lets the scheduler decide when expert bytes arrive without touching the math.

mod attn_res;
mod indexer;
mod kda;
mod loader;
mod mla;
mod moe;

pub use attn_res::Residual;
pub use indexer::{index_score, prepare_index_query, quantize_e4m3, round_index_key, round_to_bf16, round_to_e4m3, top_keys, ue8m0_scale};
pub(crate) use kda::recurrent_step;
pub use kda::{chunked_delta_rule, KdaState, Recording};
pub use mla::MlaCache;
pub use moe::{expert_forward, expert_row_chunks, ExpertLayout, MoeCombine, Route};

use crate::backend::{Backend, Cpu};
use crate::config::{AttentionKind, K3Config, MlpKind};
use crate::error::{Error, Result};
use crate::tensor::Mat;
use crate::weights::{Bf16Matrix, TensorSource};
use loader::Loader;

/// Name prefix of the language model in the release checkpoint.
pub const LM_PREFIX: &str = "language_model.";

enum Attention {
    Kda(kda::KdaWeights),
    Mla(mla::MlaWeights),
}

enum Mlp {
    Dense(moe::GluWeights),
    Moe(moe::MoeWeights),
}

struct Layer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    attn_res: Vec<f32>,
    mlp_res: Vec<f32>,
    attention: Attention,
    mlp: Mlp,
}

/// Rows of an embedding table read on demand, for a model that does not hold the table (the
/// store reads and checks each row). Core does no I/O: whoever implements this does.
pub trait EmbedRows: Send + Sync {
    /// Row `r`'s BF16 bytes (`hidden_size * 2` of them).
    fn row(&self, r: usize) -> Result<Vec<u8>>;
}

/// The embedding table: held, or read by row.
enum Embedding {
    Resident(Bf16Matrix),
    Rows(std::sync::Arc<dyn EmbedRows>),
}

impl Layer {
    /// Layer `l`'s weights from `src`.
    fn load(cfg: &K3Config, src: &dyn TensorSource, l: usize) -> Result<Layer> {
        let h = cfg.hidden_size;
        let ll = Loader::new(src, Model::layer_prefix(l));
        let attn = ll.sub("self_attn.");
        Ok(Layer {
            input_norm: ll.vector("input_layernorm.weight", h)?,
            post_norm: ll.vector("post_attention_layernorm.weight", h)?,
            attn_res: ll.res_mix("self_attention_res", h)?,
            mlp_res: ll.res_mix("mlp_res", h)?,
            attention: match cfg.attention[l] {
                AttentionKind::Kda => Attention::Kda(kda::KdaWeights::load(cfg, &attn)?),
                AttentionKind::Mla => Attention::Mla(mla::MlaWeights::load(cfg, &attn)?),
            },
            mlp: match cfg.mlp[l] {
                MlpKind::Dense => Mlp::Dense(moe::GluWeights::load(cfg, &ll.sub("mlp."), cfg.intermediate_size)?),
                MlpKind::Moe => Mlp::Moe(moe::MoeWeights::load(cfg, &ll.sub("block_sparse_moe."))?),
            },
        })
    }
}

/// The per-layer state a sequence carries between forward passes.
#[derive(Clone, Debug, PartialEq)]
pub enum LayerState {
    Kda(KdaState),
    Mla(MlaCache),
}

impl LayerState {
    /// Whether the next forward keeps what is needed to rewind it (KDA layers; MLA caches can
    /// always be truncated).
    pub fn set_recording(&mut self, on: bool) {
        self.set_record(if on { Recording::Full } else { Recording::Off });
    }

    /// What the next forward keeps so it can be undone (KDA layers; MLA caches are truncated).
    pub fn set_record(&mut self, mode: Recording) {
        if let LayerState::Kda(s) = self {
            s.record = mode;
        }
    }

    /// Drops what the last forward recorded and stops recording.
    pub fn forget(&mut self) {
        if let LayerState::Kda(s) = self {
            s.forget();
            s.record = Recording::Off;
        }
    }

    /// Bytes held.
    pub fn bytes(&self, cfg: &K3Config) -> usize {
        match self {
            LayerState::Kda(s) => s.bytes(),
            LayerState::Mla(c) => c.len * MlaCache::bytes_per_token(cfg),
        }
    }
}

/// The K3 spine: every weight except the routed experts, borrowed from the store's bytes.
pub struct Model {
    config: K3Config,
    backend: std::sync::Arc<dyn Backend>,
    embed: Embedding,
    lm_head: Bf16Matrix,
    norm: Vec<f32>,
    output_res: Vec<f32>,
    /// Each layer's weights; `None` while a streamed layer is not loaded.
    layers: Vec<std::sync::RwLock<Option<std::sync::Arc<Layer>>>>,
}

impl Model {
    /// Loads and checks every spine tensor (shape, dtype) from `src`, computing on the fastest
    /// CPU kernels.
    pub fn load(config: K3Config, src: &dyn TensorSource) -> Result<Model> {
        Model::load_with(config, src, std::sync::Arc::new(Cpu::best()))
    }

    /// [`Model::load`] computing through `backend`.
    pub fn load_with(config: K3Config, src: &dyn TensorSource, backend: std::sync::Arc<dyn Backend>) -> Result<Model> {
        Model::load_resident(config, src, backend, &|_| true, None)
    }

    /// [`Model::load_with`], loading only the layers `resident` names: the others are read
    /// each pass by whoever runs the model ([`Model::load_layer`] before the layer,
    /// [`Model::unload_layer`] after), so their tensors are never asked of `src` here. With
    /// `embed_rows` (untied embeddings only) the embedding table is not held: each token's row
    /// is read from it.
    pub fn load_resident(
        config: K3Config,
        src: &dyn TensorSource,
        backend: std::sync::Arc<dyn Backend>,
        resident: &dyn Fn(usize) -> bool,
        embed_rows: Option<std::sync::Arc<dyn EmbedRows>>,
    ) -> Result<Model> {
        let cfg = &config;
        let root = Loader::new(src, format!("{LM_PREFIX}model."));
        let h = cfg.hidden_size;
        let (embed, lm_head) = match embed_rows {
            Some(rows) if !cfg.tie_word_embeddings => {
                (Embedding::Rows(rows), Loader::new(src, LM_PREFIX).matrix("lm_head.weight", cfg.vocab_size, h)?)
            }
            _ => {
                let embed = root.matrix("embed_tokens.weight", cfg.vocab_size, h)?;
                let lm_head = match cfg.tie_word_embeddings {
                    true => embed.clone(),
                    false => Loader::new(src, LM_PREFIX).matrix("lm_head.weight", cfg.vocab_size, h)?,
                };
                (Embedding::Resident(embed), lm_head)
            }
        };
        let layers = (0..cfg.num_layers)
            .map(|l| Ok(std::sync::RwLock::new(if resident(l) { Some(std::sync::Arc::new(Layer::load(cfg, src, l)?)) } else { None })))
            .collect::<Result<Vec<_>>>()?;
        Ok(Model {
            backend,
            embed,
            lm_head,
            norm: root.vector("norm.weight", h)?,
            output_res: root.res_mix("output_attn_res", h)?,
            layers,
            config,
        })
    }

    /// The backend the model computes on.
    pub fn backend(&self) -> &dyn Backend {
        &*self.backend
    }

    /// The config the model was loaded with.
    pub fn config(&self) -> &K3Config {
        &self.config
    }

    /// Fresh per-layer state for a sequence of at most `context` tokens.
    pub fn new_state(&self, context: usize) -> Vec<LayerState> {
        (0..self.config.num_layers).map(|l| self.new_layer_state(l, context)).collect()
    }

    /// Fresh state of layer `l` alone, for at most `context` tokens.
    pub fn new_layer_state(&self, l: usize, context: usize) -> LayerState {
        match self.config.attention[l] {
            AttentionKind::Kda => LayerState::Kda(KdaState::new(&self.config)),
            AttentionKind::Mla => LayerState::Mla(MlaCache::with_capacity(&self.config, context)),
        }
    }

    /// A stand-in for a layer's state that holds nothing and allocates nothing (a transient
    /// sequence's layers before and after their turn).
    pub fn released_layer_state(&self) -> LayerState {
        LayerState::Mla(MlaCache::with_capacity(&self.config, 0))
    }

    /// Most bytes one layer's state holds for `tokens` tokens (KDA: constant; MLA: per token).
    pub fn layer_state_bytes(&self, tokens: usize) -> usize {
        let c = self.config.kda_dim();
        let kda = 4 * (3 * (self.config.conv_kernel - 1) * c + self.config.kda_heads * self.config.kda_head_dim * self.config.kda_head_dim);
        let mla = tokens * MlaCache::bytes_per_token(&self.config);
        let has_kda = self.config.attention.contains(&AttentionKind::Kda);
        mla.max(if has_kda { kda } else { 0 })
    }

    /// Token embeddings, one row per id.
    pub fn embed(&self, ids: &[u32]) -> Result<Mat> {
        let mut m = Mat::zeros(ids.len(), self.config.hidden_size);
        for (t, &id) in ids.iter().enumerate() {
            if id as usize >= self.config.vocab_size {
                return Err(Error::TokenOutOfRange { id, vocab: self.config.vocab_size });
            }
            match &self.embed {
                Embedding::Resident(e) => m.row_mut(t).copy_from_slice(&e.row_f32(id as usize)),
                Embedding::Rows(rows) => {
                    let bytes = rows.row(id as usize)?;
                    for (v, c) in m.row_mut(t).iter_mut().zip(bytes.chunks_exact(2)) {
                        *v = crate::weights::bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
                    }
                }
            }
        }
        Ok(m)
    }

    /// Attention half of layer `l`: mixes, attends (advancing `state`), updates the residual and
    /// returns the normed MLP input.
    pub fn attention_block(&self, l: usize, state: &mut LayerState, res: &mut Residual) -> Result<Mat> {
        let cfg = &self.config;
        let layer = self.layer(l);
        let eps = cfg.rms_norm_eps;
        let h = attn_res::mix(&*self.backend, &res.anchors, &res.partial, &layer.attn_res, eps);
        let x = self.backend.rms_norm_rows(&h, &layer.input_norm, eps);
        let y = match (&layer.attention, state) {
            (Attention::Kda(w), LayerState::Kda(s)) => w.forward(cfg, &*self.backend, &x, s),
            (Attention::Mla(w), LayerState::Mla(c)) => w.forward(cfg, &*self.backend, &x, c)?,
            _ => panic!("layer state kind does not match layer {l}"),
        };
        if cfg.is_block_start(l) {
            let anchor = std::mem::replace(&mut res.partial, y);
            res.anchors.push(anchor);
        } else {
            res.partial.add_assign(&y);
        }
        let m = attn_res::mix(&*self.backend, &res.anchors, &res.partial, &layer.mlp_res, eps);
        Ok(self.backend.rms_norm_rows(&m, &layer.post_norm, eps))
    }

    /// Rewinds a layer's state so that only the first `keep` tokens of its last forward count.
    /// KDA layers must have recorded that forward ([`LayerState::set_recording`]).
    pub fn rewind(&self, state: &mut LayerState, keep: usize) -> Result<()> {
        match state {
            LayerState::Kda(s) => {
                if !s.rewind(&self.config, &*self.backend, keep) {
                    return Err(Error::ContextLimit(format!(
                        "cannot rewind to {keep} tokens: the last forward was not recorded or was shorter"
                    )));
                }
            }
            LayerState::Mla(c) => {
                if keep > c.last_forward {
                    return Err(Error::ContextLimit(format!("cannot rewind to {keep} tokens of a {}-token forward", c.last_forward)));
                }
                let len = c.len - (c.last_forward - keep);
                c.truncate(&self.config, len);
                c.last_forward = keep;
            }
        }
        Ok(())
    }

    /// A guess at the routes of MoE layer `l` before the layer before it has finished: adds the
    /// provisional `mlp_out` to a copy of `res`, runs layer `l`'s attention on a throwaway copy
    /// of `state` (an MLA cache is appended to and truncated back) and its router. `state` ends
    /// as it was; the result is only good for prefetching.
    pub fn guess_routes(&self, l: usize, state: &mut LayerState, res: &Residual, mlp_out: &Mat) -> Result<Vec<Route>> {
        if !self.layer_loaded(l) {
            // A streamed layer not read yet: no guess (prefetch only; output unaffected).
            return Ok(Vec::new());
        }
        let mut r = res.clone();
        self.finish_layer(&mut r, mlp_out);
        let x = self.scratch_attention(l, state, &mut r)?;
        Ok(self.route(l, &x))
    }

    /// The next token a step would produce if this last layer's MLP output were `mlp_out` (a
    /// provisional output, some experts still missing): the argmax of its logits. Only good for
    /// prefetching: the real next token may differ.
    pub fn provisional_next_token(&self, res: &Residual, mlp_out: &Mat) -> Option<u32> {
        let mut r = res.clone();
        self.finish_layer(&mut r, mlp_out);
        let rows = r.partial.rows;
        if rows == 0 {
            return None;
        }
        let logits = self.logits(&r, rows - 1..rows);
        Some(crate::math::argmax(logits.row(0)))
    }

    /// Runs `token` up to the first MoE layer on throwaway copies of `states` and returns that
    /// layer and its routes (`None` without an MoE layer); `states` end as they were.
    pub fn first_moe_routes(&self, states: &mut [LayerState], token: u32) -> Result<Option<(usize, Vec<Route>)>> {
        let first = self.config.mlp.iter().position(|m| *m == MlpKind::Moe).unwrap_or(0);
        if !(0..=first.min(states.len().saturating_sub(1))).all(|l| self.layer_loaded(l)) {
            // Streamed layers on the way: no guess (prefetch only).
            return Ok(None);
        }
        let mut r = Residual::new(self.embed(&[token])?);
        for (l, state) in states.iter_mut().enumerate() {
            let x = self.scratch_attention(l, state, &mut r)?;
            match self.config.mlp[l] {
                MlpKind::Moe => return Ok(Some((l, self.route(l, &x)))),
                MlpKind::Dense => {
                    let out = self.dense_mlp(l, &x);
                    self.finish_layer(&mut r, &out);
                }
            }
        }
        Ok(None)
    }

    /// [`Model::provisional_next_token`] then [`Model::first_moe_routes`]: the routes of the next
    /// token's first MoE layer, guessed from a provisional last-layer output.
    pub fn guess_next_token_routes(&self, states: &mut [LayerState], res: &Residual, mlp_out: &Mat) -> Result<Option<(usize, Vec<Route>)>> {
        match self.provisional_next_token(res, mlp_out) {
            Some(t) => self.first_moe_routes(states, t),
            None => Ok(None),
        }
    }

    /// Layer `l`'s attention on a throwaway copy of `state`: a KDA state is copied, an MLA cache
    /// is appended to and truncated back, so `state` ends as it was.
    fn scratch_attention(&self, l: usize, state: &mut LayerState, r: &mut Residual) -> Result<Mat> {
        match state {
            LayerState::Kda(s) => self.attention_block(l, &mut LayerState::Kda(s.scratch_copy()), r),
            LayerState::Mla(c) => {
                // A guess is no read of the sequence's keys: it stays out of the trace.
                let (len, last, trace) = (c.len, c.last_forward, c.trace.take());
                let x = self.attention_block(l, state, r);
                if let LayerState::Mla(c) = state {
                    c.truncate(&self.config, len);
                    c.last_forward = last;
                    c.trace = trace;
                }
                x
            }
        }
    }

    /// The dense MLP of layer `l` (panics on an MoE layer: a scheduling bug).
    pub fn dense_mlp(&self, l: usize, x: &Mat) -> Mat {
        match &self.layer(l).mlp {
            Mlp::Dense(w) => w.forward(&self.config, &*self.backend, x),
            Mlp::Moe(_) => panic!("layer {l} is an MoE layer"),
        }
    }

    fn with_moe<T>(&self, l: usize, f: impl FnOnce(&moe::MoeWeights) -> T) -> T {
        match &self.layer(l).mlp {
            Mlp::Moe(w) => f(w),
            Mlp::Dense(_) => panic!("layer {l} is a dense layer"),
        }
    }

    /// Router of MoE layer `l`: the chosen experts per row.
    pub fn route(&self, l: usize, x: &Mat) -> Vec<Route> {
        self.with_moe(l, |m| m.route(&self.config, &*self.backend, x))
    }

    /// The latent input of the routed experts.
    pub fn moe_latent_in(&self, l: usize, x: &Mat) -> Mat {
        self.with_moe(l, |m| m.latent_in(&*self.backend, x))
    }

    /// Routed expert `expert` of layer `l` over latent rows, from its stored bytes.
    pub fn expert(&self, l: usize, expert: u32, layout: &ExpertLayout, bytes: &[u8], z: &Mat) -> Result<Mat> {
        self.backend.expert_forward(&self.config, crate::backend::ExpertId { layer: l, expert }, layout, bytes, z)
    }

    /// The shared experts of MoE layer `l` over its MLP input (`None` if it has none).
    pub fn moe_shared(&self, l: usize, x: &Mat) -> Option<Mat> {
        self.with_moe(l, |m| m.shared(&self.config, &*self.backend, x))
    }

    /// Latent norm and up-projection of the combined routed output, plus the shared experts'
    /// output from [`Model::moe_shared`].
    pub fn moe_finish(&self, l: usize, routed: Mat, shared: Option<Mat>) -> Mat {
        self.with_moe(l, |m| m.finish(&self.config, &*self.backend, routed, shared))
    }

    /// Adds the MLP output to the residual's partial sum.
    pub fn finish_layer(&self, res: &mut Residual, mlp_out: &Mat) {
        res.partial.add_assign(mlp_out);
    }

    /// Logits `[rows, vocab]` for the residual rows `rows`.
    pub fn logits(&self, res: &Residual, rows: std::ops::Range<usize>) -> Mat {
        let anchors: Vec<Mat> = res.anchors.iter().map(|a| a.rows_range(rows.start, rows.len())).collect();
        let partial = res.partial.rows_range(rows.start, rows.len());
        let h = attn_res::mix(&*self.backend, &anchors, &partial, &self.output_res, self.config.rms_norm_eps);
        let x = self.backend.rms_norm_rows(&h, &self.norm, self.config.rms_norm_eps);
        self.backend.matmul_bf16(&x, &self.lm_head)
    }

    /// The name prefix of layer `l`'s spine tensors (its routed experts aside).
    pub fn layer_prefix(l: usize) -> String {
        format!("{LM_PREFIX}model.layers.{l}.")
    }

    /// Whether layer `l`'s weights are in the model now.
    pub fn layer_loaded(&self, l: usize) -> bool {
        self.layers[l].read().expect("poisoned").is_some()
    }

    /// Loads layer `l`'s weights from `src` (tensors under [`Model::layer_prefix`]).
    pub fn load_layer(&self, l: usize, src: &dyn TensorSource) -> Result<()> {
        let layer = Layer::load(&self.config, src, l)?;
        *self.layers[l].write().expect("poisoned") = Some(std::sync::Arc::new(layer));
        Ok(())
    }

    /// Drops layer `l`'s weights (they go when the last computation holding them ends).
    pub fn unload_layer(&self, l: usize) {
        *self.layers[l].write().expect("poisoned") = None;
    }

    /// Layer `l`'s weights; the engine loads a streamed layer before running it, so a missing
    /// one is a scheduling bug.
    fn layer(&self, l: usize) -> std::sync::Arc<Layer> {
        self.layers[l].read().expect("poisoned").clone().unwrap_or_else(|| panic!("layer {l} is not loaded"))
    }

    /// Bytes of spine weights this model borrows.
    pub fn spine_bytes(&self) -> usize {
        let embed = match &self.embed {
            Embedding::Resident(e) => e.byte_len(),
            Embedding::Rows(_) => 0,
        };
        embed + if self.config.tie_word_embeddings { 0 } else { self.lm_head.byte_len() }
    }
}
