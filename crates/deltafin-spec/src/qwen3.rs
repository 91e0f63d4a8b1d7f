//! The Qwen3 dense architecture (the small drafts people run beside K3), from its Hugging Face
//! checkpoint: `Qwen3ForCausalLM` with grouped-query attention, per-head RMS norms on queries
//! and keys, rotary positions (the halves layout), and a SwiGLU MLP; BF16 weights.
//!
//! Its matmuls and norms go through the core's [`Backend`], so they share the kernels (and their
//! fixed reduction order) with K3. Exactness does not depend on it: a draft only guesses, and K3
//! verifies every guess. Checked against mlx-lm's `qwen3` at float32
//! (`crates/deltafin-spec/tests/qwen3.rs`).

use std::sync::Arc;

use deltafin_core::{softmax_in_place, Backend, Bf16Matrix, DType, Mat, TensorSource};

use crate::error::{Error, Result};

/// The fields of a Qwen3 `config.json` the model uses, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Qwen3Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
}

impl Qwen3Config {
    /// Parses and checks a `config.json`.
    pub fn from_json(text: &str) -> Result<Qwen3Config> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| Error::config("config.json", format!("not JSON: {e}")))?;
        let arch = v["architectures"].get(0).and_then(|a| a.as_str()).unwrap_or("");
        if arch != "Qwen3ForCausalLM" && v["model_type"].as_str() != Some("qwen3") {
            return Err(Error::config(
                "architectures",
                format!("`{arch}` is not Qwen3ForCausalLM: draft models must be Qwen3 dense checkpoints"),
            ));
        }
        let int = |k: &str| -> Result<usize> {
            v[k].as_u64().map(|x| x as usize).filter(|&x| x > 0).ok_or_else(|| Error::config(k, "missing or not a positive integer"))
        };
        let (hidden, heads) = (int("hidden_size")?, int("num_attention_heads")?);
        let head_dim = if v["head_dim"].is_null() { hidden / heads } else { int("head_dim")? };
        let kv = int("num_key_value_heads")?;
        if heads % kv != 0 {
            return Err(Error::config("num_key_value_heads", format!("{kv} does not divide num_attention_heads {heads}")));
        }
        if head_dim % 2 != 0 {
            return Err(Error::config("head_dim", format!("{head_dim} is odd: rotary positions need pairs")));
        }
        if v["attention_bias"].as_bool() == Some(true) {
            return Err(Error::config("attention_bias", "true is not supported (Qwen3 has none)"));
        }
        if !v["rope_scaling"].is_null() {
            return Err(Error::config("rope_scaling", "scaled rotary positions are not supported (drafts run at short contexts)"));
        }
        Ok(Qwen3Config {
            vocab_size: int("vocab_size")?,
            hidden_size: hidden,
            intermediate_size: int("intermediate_size")?,
            num_hidden_layers: int("num_hidden_layers")?,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim,
            rms_norm_eps: v["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32,
            rope_theta: v["rope_theta"].as_f64().unwrap_or(1_000_000.0),
            tie_word_embeddings: v["tie_word_embeddings"].as_bool().unwrap_or(false),
        })
    }
}

struct Layer {
    input_norm: Vec<f32>,
    q: Bf16Matrix,
    k: Bf16Matrix,
    v: Bf16Matrix,
    o: Bf16Matrix,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    post_norm: Vec<f32>,
    gate: Bf16Matrix,
    up: Bf16Matrix,
    down: Bf16Matrix,
}

/// A loaded Qwen3 model (weights borrowed from the checkpoint's memory maps).
pub struct Qwen3 {
    cfg: Qwen3Config,
    embed: Bf16Matrix,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Bf16Matrix,
    /// `theta^(-2i/head_dim)` for each rotary pair.
    inv_freq: Vec<f64>,
    backend: Arc<dyn Backend>,
}

/// Keys and values of the tokens a [`Qwen3`] has seen, per layer.
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    len: usize,
}

impl KvCache {
    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Keeps only the first `len` tokens.
    pub fn truncate(&mut self, len: usize, width: usize) {
        if len < self.len {
            for k in self.keys.iter_mut().chain(self.values.iter_mut()) {
                k.truncate(len * width);
            }
            self.len = len;
        }
    }
}

fn f32_vec(src: &dyn TensorSource, name: &str, len: usize) -> Result<Vec<f32>> {
    let t = src.tensor(name)?;
    let t = match t.dtype {
        DType::Bf16 => t.expect(DType::Bf16, &[len])?,
        _ => t.expect(DType::F32, &[len])?,
    };
    Ok(t.to_f32_vec())
}

fn matrix(src: &dyn TensorSource, name: &str, rows: usize, cols: usize) -> Result<Bf16Matrix> {
    Ok(Bf16Matrix::from_tensor(src.tensor(name)?, rows, cols)?)
}

impl Qwen3 {
    /// Loads every weight named by the config from `src`, checking dtypes and shapes.
    pub fn load(cfg: Qwen3Config, src: &dyn TensorSource, backend: Arc<dyn Backend>) -> Result<Qwen3> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (qw, kvw) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}.");
            layers.push(Layer {
                input_norm: f32_vec(src, &format!("{p}input_layernorm.weight"), h)?,
                q: matrix(src, &format!("{p}self_attn.q_proj.weight"), qw, h)?,
                k: matrix(src, &format!("{p}self_attn.k_proj.weight"), kvw, h)?,
                v: matrix(src, &format!("{p}self_attn.v_proj.weight"), kvw, h)?,
                o: matrix(src, &format!("{p}self_attn.o_proj.weight"), h, qw)?,
                q_norm: f32_vec(src, &format!("{p}self_attn.q_norm.weight"), hd)?,
                k_norm: f32_vec(src, &format!("{p}self_attn.k_norm.weight"), hd)?,
                post_norm: f32_vec(src, &format!("{p}post_attention_layernorm.weight"), h)?,
                gate: matrix(src, &format!("{p}mlp.gate_proj.weight"), cfg.intermediate_size, h)?,
                up: matrix(src, &format!("{p}mlp.up_proj.weight"), cfg.intermediate_size, h)?,
                down: matrix(src, &format!("{p}mlp.down_proj.weight"), h, cfg.intermediate_size)?,
            });
        }
        let embed = matrix(src, "model.embed_tokens.weight", cfg.vocab_size, h)?;
        let lm_head = if cfg.tie_word_embeddings { embed.clone() } else { matrix(src, "lm_head.weight", cfg.vocab_size, h)? };
        let inv_freq = (0..hd / 2).map(|i| cfg.rope_theta.powf(-((2 * i) as f64) / hd as f64)).collect();
        Ok(Qwen3 { norm: f32_vec(src, "model.norm.weight", h)?, cfg, embed, layers, lm_head, inv_freq, backend })
    }

    /// The config.
    pub fn config(&self) -> &Qwen3Config {
        &self.cfg
    }

    /// Bytes of one token's keys and values over all layers (memory accounting).
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * 4 * self.cfg.num_hidden_layers * self.cfg.num_key_value_heads * self.cfg.head_dim
    }

    /// A cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        KvCache { keys: vec![Vec::new(); self.cfg.num_hidden_layers], values: vec![Vec::new(); self.cfg.num_hidden_layers], len: 0 }
    }

    /// Cuts `cache` back to its first `len` tokens.
    pub fn truncate(&self, cache: &mut KvCache, len: usize) {
        cache.truncate(len, self.cfg.num_key_value_heads * self.cfg.head_dim);
    }

    /// Rotates each head's halves by its position (`pos` of the first row, then one per row).
    fn rope(&self, m: &mut Mat, heads: usize, pos: usize) {
        let hd = self.cfg.head_dim;
        let half = hd / 2;
        for r in 0..m.rows {
            let p = (pos + r) as f64;
            let row = m.row_mut(r);
            for h in 0..heads {
                let x = &mut row[h * hd..(h + 1) * hd];
                for (i, f) in self.inv_freq.iter().enumerate() {
                    let (sin, cos) = (p * f).sin_cos();
                    let (a, b) = (x[i], x[i + half]);
                    x[i] = a * cos as f32 - b * sin as f32;
                    x[i + half] = b * cos as f32 + a * sin as f32;
                }
            }
        }
    }

    /// Runs `ids` after what `cache` holds; returns logits for the last row.
    ///
    /// On a compute thread, as the target's steps run (`deltafin_core::on_compute_threads`: one
    /// sleep of the caller per pass, not one per product).
    pub fn forward(&self, cache: &mut KvCache, ids: &[u32]) -> Result<Vec<f32>> {
        deltafin_core::on_compute_threads(|| self.forward_here(cache, ids))
    }

    fn forward_here(&self, cache: &mut KvCache, ids: &[u32]) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let (hd, nh, nkv) = (c.head_dim, c.num_attention_heads, c.num_key_value_heads);
        let mut x = Mat::zeros(ids.len(), c.hidden_size);
        for (r, &id) in ids.iter().enumerate() {
            if id as usize >= c.vocab_size {
                return Err(deltafin_core::Error::TokenOutOfRange { id, vocab: c.vocab_size }.into());
            }
            x.row_mut(r).copy_from_slice(&self.embed.row_f32(id as usize));
        }
        let pos = cache.len;
        let b = &self.backend;
        let scale = 1.0 / (hd as f32).sqrt();
        for (l, layer) in self.layers.iter().enumerate() {
            let h = b.rms_norm_rows(&x, &layer.input_norm, c.rms_norm_eps);
            let mut q = b.matmul_bf16(&h, &layer.q);
            let mut k = b.matmul_bf16(&h, &layer.k);
            let v = b.matmul_bf16(&h, &layer.v);
            for r in 0..ids.len() {
                q.row_mut(r).chunks_exact_mut(hd).for_each(|head| b.rms_norm_in_place(head, Some(&layer.q_norm), c.rms_norm_eps));
                k.row_mut(r).chunks_exact_mut(hd).for_each(|head| b.rms_norm_in_place(head, Some(&layer.k_norm), c.rms_norm_eps));
            }
            self.rope(&mut q, nh, pos);
            self.rope(&mut k, nkv, pos);
            cache.keys[l].extend_from_slice(&k.data);
            cache.values[l].extend_from_slice(&v.data);
            let (keys, values) = (&cache.keys[l], &cache.values[l]);
            let kvw = nkv * hd;
            let mut attn = Mat::zeros(ids.len(), nh * hd);
            for r in 0..ids.len() {
                let seen = pos + r + 1;
                for head in 0..nh {
                    let g = head / (nh / nkv);
                    let qh = &q.row(r)[head * hd..(head + 1) * hd];
                    let mut scores: Vec<f32> =
                        (0..seen).map(|j| b.dot_f32(qh, &keys[j * kvw + g * hd..j * kvw + (g + 1) * hd]) * scale).collect();
                    softmax_in_place(&mut scores);
                    let out = &mut attn.row_mut(r)[head * hd..(head + 1) * hd];
                    for (j, p) in scores.iter().enumerate() {
                        for (o, v) in out.iter_mut().zip(&values[j * kvw + g * hd..j * kvw + (g + 1) * hd]) {
                            *o += p * v;
                        }
                    }
                }
            }
            x.add_assign(&b.matmul_bf16(&attn, &layer.o));
            let h = b.rms_norm_rows(&x, &layer.post_norm, c.rms_norm_eps);
            let mut gate = b.matmul_bf16(&h, &layer.gate);
            let up = b.matmul_bf16(&h, &layer.up);
            for (g, u) in gate.data.iter_mut().zip(&up.data) {
                *g = *g / (1.0 + (-*g).exp()) * u;
            }
            x.add_assign(&b.matmul_bf16(&gate, &layer.down));
        }
        cache.len += ids.len();
        let last = x.rows_range(x.rows - 1, 1);
        let h = b.rms_norm_rows(&last, &self.norm, c.rms_norm_eps);
        Ok(b.matmul_bf16(&h, &self.lm_head).data)
    }

    /// Bytes of its weights (tied embeddings counted once).
    pub fn weight_bytes(&self) -> u64 {
        let m = |w: &Bf16Matrix| w.byte_len() as u64;
        let layers: u64 = self.layers.iter().map(|l| m(&l.q) + m(&l.k) + m(&l.v) + m(&l.o) + m(&l.gate) + m(&l.up) + m(&l.down)).sum();
        layers + m(&self.embed) + if self.cfg.tie_word_embeddings { 0 } else { m(&self.lm_head) }
    }
}
