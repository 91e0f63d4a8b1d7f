//! Gated NoPE multi-head latent attention with a compact cache.
//!
//! The cache keeps, per token, the normalized KV latent and the shared `k_pe` (576 values per
//! token for K3), never expanded keys. Queries are absorbed into latent space
//! (`q_lat = W_kb^T q_nope`), so a prompt row and a decode step run exactly the same arithmetic
//! over the same cached values: prefill and decode agree bit for bit. No rotary embedding: K3's
//! "rope" dims enter the dot product unrotated.

use rayon::prelude::*;

use super::indexer::IndexerWeights;
use super::loader::Loader;
use crate::backend::{Backend, MlaHead};
use crate::config::K3Config;
use crate::error::{Error, Result};
use crate::math::sigmoid;
use crate::tensor::Mat;
use crate::weights::{bf16_to_f32, Bf16Matrix};

/// Epsilon of `q_a_layernorm` and `kv_a_layernorm` (Moonshot, HF and mlx-lm use 1e-6).
const LORA_NORM_EPS: f32 = 1e-6;

/// MLA weights of one layer.
pub(crate) struct MlaWeights {
    q_a: Bf16Matrix,
    q_a_norm: Vec<f32>,
    q_b: Bf16Matrix,
    kv_a: Bf16Matrix,
    kv_a_norm: Vec<f32>,
    kv_b: Bf16Matrix,
    o_proj: Bf16Matrix,
    g_proj: Option<Bf16Matrix>,
    /// Kimi K3.1's sparse-attention indexer (`None`: K3's dense attention).
    indexer: Option<IndexerWeights>,
}

/// The MLA cache of one layer: normalized latents and `k_pe` for every past token, and K3.1's
/// indexer keys.
#[derive(Clone, Debug)]
pub struct MlaCache {
    /// `[len][kv_lora_rank]`.
    pub latent: Vec<f32>,
    /// `[len][qk_rope_dim]`.
    pub k_pe: Vec<f32>,
    /// Tokens cached.
    pub len: usize,
    /// Most tokens this cache may hold.
    pub limit: usize,
    /// Tokens the last forward appended (for rewinding it).
    pub last_forward: usize,
    /// K3.1: `[len][index_head_dim]` indexer keys (E4M3 values in `fp8` mode); empty for K3.
    pub index_keys: Vec<f32>,
    /// K3.1 in `fp8` mode: each cached indexer key's scale.
    pub index_scales: Vec<f32>,
    /// When set, every query's attended key positions are appended here (a diagnostic: which
    /// keys K3.1's sparse attention read).
    pub trace: Option<Vec<Vec<u32>>>,
}

impl PartialEq for MlaCache {
    /// Caches are equal when their tokens' numbers are (`last_forward` is bookkeeping).
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len
            && self.latent == other.latent
            && self.k_pe == other.k_pe
            && self.index_keys == other.index_keys
            && self.index_scales == other.index_scales
    }
}

impl MlaCache {
    /// An empty cache holding at most `limit` tokens.
    pub fn new(limit: usize) -> MlaCache {
        MlaCache {
            latent: Vec::new(),
            k_pe: Vec::new(),
            len: 0,
            limit,
            last_forward: 0,
            index_keys: Vec::new(),
            index_scales: Vec::new(),
            trace: None,
        }
    }
    /// An empty cache with room reserved for `limit` tokens of `cfg` (address space only: pages
    /// are touched as tokens arrive), so appending never moves the cache.
    pub fn with_capacity(cfg: &K3Config, limit: usize) -> MlaCache {
        MlaCache {
            latent: Vec::with_capacity(limit * cfg.kv_lora_rank),
            k_pe: Vec::with_capacity(limit * cfg.qk_rope_dim),
            len: 0,
            limit,
            last_forward: 0,
            index_keys: Vec::with_capacity(limit * cfg.indexer.as_ref().map_or(0, |ix| ix.head_dim)),
            index_scales: Vec::new(),
            trace: None,
        }
    }
    /// Bytes per cached token (the indexer key included).
    pub fn bytes_per_token(cfg: &K3Config) -> usize {
        4 * (cfg.kv_lora_rank + cfg.qk_rope_dim) + cfg.indexer.as_ref().map_or(0, |ix| ix.key_bytes())
    }
    /// Drops every token after the first `len` (rollback of a speculative forward).
    pub fn truncate(&mut self, cfg: &K3Config, len: usize) {
        if len < self.len {
            self.latent.truncate(len * cfg.kv_lora_rank);
            self.k_pe.truncate(len * cfg.qk_rope_dim);
            if let Some(ix) = &cfg.indexer {
                self.index_keys.truncate(len * ix.head_dim);
                self.index_scales.truncate(len);
            }
            self.len = len;
        }
    }
}

impl MlaWeights {
    pub fn load(cfg: &K3Config, l: &Loader<'_>) -> Result<MlaWeights> {
        let (h, n) = (cfg.hidden_size, cfg.mla_heads);
        Ok(MlaWeights {
            q_a: l.matrix("q_a_proj.weight", cfg.q_lora_rank, h)?,
            q_a_norm: l.vector("q_a_layernorm.weight", cfg.q_lora_rank)?,
            q_b: l.matrix("q_b_proj.weight", n * cfg.qk_head_dim(), cfg.q_lora_rank)?,
            kv_a: l.matrix("kv_a_proj_with_mqa.weight", cfg.kv_lora_rank + cfg.qk_rope_dim, h)?,
            kv_a_norm: l.vector("kv_a_layernorm.weight", cfg.kv_lora_rank)?,
            kv_b: l.matrix("kv_b_proj.weight", n * (cfg.qk_nope_dim + cfg.v_head_dim), cfg.kv_lora_rank)?,
            o_proj: l.matrix("o_proj.weight", h, n * cfg.v_head_dim)?,
            g_proj: if cfg.mla_output_gate { Some(l.matrix("g_proj.weight", n * cfg.v_head_dim, h)?) } else { None },
            indexer: match &cfg.indexer {
                Some(ix) => Some(IndexerWeights::load(cfg, ix, &l.sub("indexer."))?),
                None => None,
            },
        })
    }

    /// Attends `x` (normed attention input) over the cache plus itself, appending to the cache.
    pub fn forward(&self, cfg: &K3Config, be: &dyn Backend, x: &Mat, cache: &mut MlaCache) -> Result<Mat> {
        let (heads, nope, rope, vd, lora) = (cfg.mla_heads, cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_head_dim, cfg.kv_lora_rank);
        let t_len = x.rows;
        if cache.len + t_len > cache.limit {
            return Err(Error::ContextLimit(format!(
                "the MLA cache holds at most {} tokens and {} more do not fit after {}; raise the context limit or the RAM budget",
                cache.limit, t_len, cache.len
            )));
        }
        let qr = be.rms_norm_rows(&be.matmul_bf16(x, &self.q_a), &self.q_a_norm, LORA_NORM_EPS);
        let q = be.matmul_bf16(&qr, &self.q_b);
        let kv = be.matmul_bf16(x, &self.kv_a);
        for t in 0..t_len {
            let row = kv.row(t);
            let mut lat = row[..lora].to_vec();
            be.rms_norm_in_place(&mut lat, Some(&self.kv_a_norm), LORA_NORM_EPS);
            cache.latent.extend_from_slice(&lat);
            cache.k_pe.extend_from_slice(&row[lora..]);
        }
        let past = cache.len;
        cache.len += t_len;
        cache.last_forward = t_len;
        let selected = self.select_keys(cfg, be, x, &qr, past, cache);
        let scale = crate::math::inv_sqrt_of(nope + rope);
        let per_head = nope + vd;
        let cache_ref = &*cache;
        // One task per (token, head): independent, fixed order inside.
        let outs: Vec<Vec<f32>> = (0..t_len * heads)
            .into_par_iter()
            .map(|task| {
                let (t, h) = (task / heads, task % heads);
                let qrow = &q.row(t)[h * (nope + rope)..(h + 1) * (nope + rope)];
                let (q_nope, q_pe) = qrow.split_at(nope);
                // q_lat[c] = sum_i q_nope[i] * W_kb[h*per_head + i][c], i ascending, a product
                // and a sum each (no fused multiply-add). Walking a whole weight row per `i`
                // lets the compiler run the `c`s in SIMD lanes: each `c` keeps its own
                // operations in the same order, so the bits are the scalar loop's.
                let mut q_lat = vec![0f32; lora];
                for (i, &qi) in q_nope.iter().enumerate() {
                    let row = self.kv_b.row(h * per_head + i);
                    for (ql, w) in q_lat.iter_mut().zip(row.chunks_exact(2)) {
                        *ql += qi * bf16_to_f32(u16::from_le_bytes([w[0], w[1]]));
                    }
                }
                let n_keys = past + t + 1;
                let values = h * per_head + nope..h * per_head + nope + vd;
                let head = MlaHead {
                    q_lat: &q_lat,
                    q_pe,
                    latent: &cache_ref.latent[..n_keys * lora],
                    k_pe: &cache_ref.k_pe[..n_keys * rope],
                    keys: selected[t].as_deref(),
                    scale,
                };
                be.mla_attend(head, &self.kv_b, values)
            })
            .collect();
        let mut attn = Mat::zeros(t_len, heads * vd);
        for (task, o) in outs.into_iter().enumerate() {
            let (t, h) = (task / heads, task % heads);
            attn.row_mut(t)[h * vd..(h + 1) * vd].copy_from_slice(&o);
        }
        if let Some(g) = &self.g_proj {
            let gate = be.matmul_bf16(x, g);
            for (a, g) in attn.data.iter_mut().zip(&gate.data) {
                *a *= sigmoid(*g);
            }
        }
        Ok(be.matmul_bf16(&attn, &self.o_proj))
    }

    /// K3.1: appends the new rows' indexer keys to `cache` (whose `len` already counts them,
    /// `past` before them) and returns, per new row, the key positions it attends to: `None`
    /// (every key, K3's dense attention) while the row sees at most `index_topk` keys.
    fn select_keys(&self, cfg: &K3Config, be: &dyn Backend, x: &Mat, qr: &Mat, past: usize, cache: &mut MlaCache) -> Vec<Option<Vec<u32>>> {
        let t_len = x.rows;
        let mut selected = vec![None; t_len];
        if let (Some(ix), Some(w)) = (&cfg.indexer, &self.indexer) {
            w.append_keys(ix, be, x, cache);
            if past + t_len > ix.topk {
                let queries = w.queries(ix, be, qr, x);
                for (t, sel) in selected.iter_mut().enumerate().filter(|(t, _)| past + t + 1 > ix.topk) {
                    *sel = Some(super::indexer::top_keys(&queries.scores(ix, be, t, cache, past + t + 1), ix.topk));
                }
            }
        }
        if let Some(trace) = &mut cache.trace {
            for (t, sel) in selected.iter().enumerate() {
                trace.push(sel.clone().unwrap_or_else(|| (0..(past + t + 1) as u32).collect()));
            }
        }
        selected
    }
}
