//! The K3 config: `config.json` in the release's structure, typed and validated.
//!
//! Every dimension and the whole layer schedule come from here; no other module hard-codes a
//! number of the model. Parsing is strict about what changes the math: a value the engine would
//! silently compute wrong (a different activation, grouped routing that is not a no-op, RoPE) is an
//! error naming the field and the value.

use serde_json::Value;

use crate::error::{Error, Result};

mod indexer;
pub use indexer::{IndexerConfig, IndexerRounding};

/// The attention kind of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKind {
    /// Kimi Delta Attention (linear attention with a constant-size state).
    Kda,
    /// Gated NoPE multi-head latent attention with a growing cache.
    Mla,
}

/// The MLP kind of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpKind {
    /// A dense SiTU-GLU MLP (`mlp.*`).
    Dense,
    /// The latent mixture of experts (`block_sparse_moe.*`).
    Moe,
}

/// The validated language-model config of a K3 checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct K3Config {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub vocab_size: usize,
    pub intermediate_size: usize,
    pub rms_norm_eps: f32,
    pub situ_beta: f32,
    pub situ_linear_beta: f32,
    pub attn_res_block_size: usize,
    pub tie_word_embeddings: bool,
    /// Per layer (0-based): attention kind.
    pub attention: Vec<AttentionKind>,
    /// Per layer (0-based): MLP kind.
    pub mlp: Vec<MlpKind>,
    // KDA
    pub kda_heads: usize,
    pub kda_head_dim: usize,
    pub conv_kernel: usize,
    pub gate_lower_bound: f32,
    // MLA
    pub mla_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_dim: usize,
    pub qk_rope_dim: usize,
    pub v_head_dim: usize,
    pub mla_output_gate: bool,
    // MoE
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub num_shared_experts: usize,
    pub moe_intermediate_size: usize,
    pub latent_size: usize,
    pub latent_norm: bool,
    pub routed_scaling_factor: f32,
    pub renormalize: bool,
    /// MXFP4 group size (columns per E8M0 scale).
    pub group_size: usize,
    /// Kimi K3.1's sparse-attention indexer on every MLA layer (`None`: K3, dense MLA).
    pub indexer: Option<IndexerConfig>,
    // special tokens
    pub bos_token_id: u32,
    pub eos_token_id: u32,
    pub pad_token_id: u32,
}

/// Byte layout of one routed expert as stored: the six records `w1,w2,w3` x `packed,scale`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertShape {
    /// w1 and w3: `[inter, latent]`; w2: `[latent, inter]`.
    pub inter: usize,
    pub latent: usize,
    pub group: usize,
}

impl ExpertShape {
    /// Bytes of the packed codes of w1 (= w3 = w2).
    pub fn packed_bytes(&self) -> usize {
        self.inter * self.latent / 2
    }
    /// Bytes of the scales of w1 (= w3 = w2).
    pub fn scale_bytes(&self) -> usize {
        self.inter * self.latent / self.group
    }
    /// Total bytes of one expert (six records).
    pub fn total_bytes(&self) -> usize {
        3 * (self.packed_bytes() + self.scale_bytes())
    }
}

impl K3Config {
    /// Parses `config.json` text (the root `kimi_k3` or `kimi_k31` object, or a bare
    /// `kimi_linear` text config). K3.1 (`kimi_k31`) must carry `text_config.dsa_config`; K3
    /// must not.
    pub fn from_json(text: &str) -> Result<K3Config> {
        let root: Value = serde_json::from_str(text).map_err(|e| Error::Json(e.to_string()))?;
        let root_fields = Fields { v: &root, path: String::new() };
        let model_type = root_fields.str("model_type")?;
        let (tc, k31) = match model_type.as_str() {
            "kimi_k3" => (root_fields.obj("text_config")?, false),
            "kimi_k31" => (root_fields.obj("text_config")?, true),
            "kimi_linear" => (root_fields.clone(), root_fields.opt("dsa_config").is_some()),
            other => return Err(unsupported("model_type", other, "expected `kimi_k3`, `kimi_k31` or `kimi_linear`")),
        };
        if !k31 && tc.opt("dsa_config").is_some() {
            return Err(unsupported(
                &tc.name("dsa_config"),
                "(present)",
                "a sparse-attention indexer belongs to Kimi K3.1: model_type `kimi_k31`",
            ));
        }
        Self::from_text_config(&tc, &root_fields, k31)
    }

    fn from_text_config(tc: &Fields<'_>, root: &Fields<'_>, k31: bool) -> Result<K3Config> {
        expect_str(tc, "hidden_act", "situ")?;
        expect_str(tc, "moe_router_activation_func", "sigmoid")?;
        expect_str(tc, "topk_method", "noaux_tc")?;
        if !tc.bool_or("mla_use_nope", false)? {
            return Err(unsupported(&tc.name("mla_use_nope"), "false", "only NoPE MLA exists in K3"));
        }
        if tc.opt("num_nextn_predict_layers").is_some() && tc.usize("num_nextn_predict_layers")? != 0 {
            let n = tc.usize("num_nextn_predict_layers")?;
            return Err(unsupported(&tc.name("num_nextn_predict_layers"), &n.to_string(), "MTP heads are not supported"));
        }
        let num_layers = tc.usize("num_hidden_layers")?;
        let hidden_size = tc.usize("hidden_size")?;
        let la = tc.obj("linear_attn_config")?;
        let full = la.usize_list("full_attn_layers")?;
        let kda = la.usize_list("kda_layers")?;
        let mut attention = vec![None; num_layers];
        for (list, kind, field) in [(&full, AttentionKind::Mla, "full_attn_layers"), (&kda, AttentionKind::Kda, "kda_layers")] {
            for &one_based in list {
                if one_based == 0 || one_based > num_layers {
                    return Err(unsupported(
                        &la.name(field),
                        &one_based.to_string(),
                        &format!("layer indices are 1-based and at most num_hidden_layers = {num_layers}"),
                    ));
                }
                if attention[one_based - 1].replace(kind).is_some() {
                    return Err(unsupported(
                        &la.name(field),
                        &one_based.to_string(),
                        "layer listed twice across full_attn_layers and kda_layers",
                    ));
                }
            }
        }
        let attention: Vec<AttentionKind> = attention
            .into_iter()
            .enumerate()
            .map(|(i, k)| {
                k.ok_or_else(|| {
                    unsupported(
                        &la.name("kda_layers"),
                        &format!("(missing {})", i + 1),
                        "every layer must be in full_attn_layers or kda_layers",
                    )
                })
            })
            .collect::<Result<_>>()?;

        let num_experts = tc.usize("num_experts")?;
        let first_dense = tc.usize("first_k_dense_replace")?;
        let freq = tc.usize("moe_layer_freq")?;
        if freq == 0 {
            return Err(unsupported(&tc.name("moe_layer_freq"), "0", "must be at least 1"));
        }
        let mlp = (0..num_layers)
            .map(|l| if num_experts > 0 && l >= first_dense && l % freq == 0 { MlpKind::Moe } else { MlpKind::Dense })
            .collect();

        let experts_per_token = tc.usize("num_experts_per_token")?;
        if experts_per_token == 0 || experts_per_token > num_experts {
            return Err(unsupported(
                &tc.name("num_experts_per_token"),
                &experts_per_token.to_string(),
                &format!("must be in 1..=num_experts ({num_experts})"),
            ));
        }
        if tc.bool_or("use_grouped_topk", false)? {
            let groups = tc.usize("num_expert_group")?;
            let topk_group = tc.usize("topk_group")?;
            if groups != topk_group {
                return Err(unsupported(
                    &tc.name("topk_group"),
                    &topk_group.to_string(),
                    &format!("grouped routing must be a no-op (topk_group = num_expert_group = {groups})"),
                ));
            }
        }
        let group_size = quant_group_size(tc)?;
        let moe_intermediate_size = tc.usize("moe_intermediate_size")?;
        let latent_size = tc.usize("routed_expert_hidden_size")?;
        for (field, v) in [("moe_intermediate_size", moe_intermediate_size), ("routed_expert_hidden_size", latent_size)] {
            if v % group_size != 0 || v == 0 {
                return Err(unsupported(
                    &tc.name(field),
                    &v.to_string(),
                    &format!("must be a positive multiple of the MXFP4 group size {group_size}"),
                ));
            }
        }
        let rms_norm_eps = tc.f32("rms_norm_eps")?;
        let indexer = if k31 { Some(indexer::parse(tc, &full, rms_norm_eps)?) } else { None };
        let cfg = K3Config {
            hidden_size,
            num_layers,
            vocab_size: tc.usize("vocab_size")?,
            intermediate_size: tc.usize("intermediate_size")?,
            rms_norm_eps,
            situ_beta: tc.f32("activation_situ_beta")?,
            situ_linear_beta: tc.f32("activation_situ_linear_beta")?,
            attn_res_block_size: tc.usize("attn_res_block_size")?,
            tie_word_embeddings: root.bool_or("tie_word_embeddings", tc.bool_or("tie_word_embeddings", false)?)?,
            attention,
            mlp,
            kda_heads: la.usize("num_heads")?,
            kda_head_dim: la.usize("head_dim")?,
            conv_kernel: la.usize("short_conv_kernel_size")?,
            gate_lower_bound: la.f32("gate_lower_bound")?,
            mla_heads: tc.usize("num_attention_heads")?,
            q_lora_rank: tc.usize("q_lora_rank")?,
            kv_lora_rank: tc.usize("kv_lora_rank")?,
            qk_nope_dim: tc.usize("qk_nope_head_dim")?,
            qk_rope_dim: tc.usize("qk_rope_head_dim")?,
            v_head_dim: tc.usize("v_head_dim")?,
            mla_output_gate: tc.bool_or("mla_use_output_gate", false)?,
            num_experts,
            experts_per_token,
            num_shared_experts: tc.usize("num_shared_experts")?,
            moe_intermediate_size,
            latent_size,
            latent_norm: tc.bool_or("latent_moe_use_norm", false)?,
            routed_scaling_factor: tc.f32("routed_scaling_factor")?,
            renormalize: tc.bool_or("moe_renormalize", true)?,
            group_size,
            indexer,
            bos_token_id: root.u32_or_inner("bos_token_id", tc)?,
            eos_token_id: root.u32_or_inner("eos_token_id", tc)?,
            pad_token_id: root.u32_or_inner("pad_token_id", tc)?,
        };
        if !la.bool_or("use_full_rank_gate", true)? {
            return Err(unsupported(&la.name("use_full_rank_gate"), "false", "K3 uses a full-rank output gate `g_proj`"));
        }
        for (field, v) in [
            ("hidden_size", cfg.hidden_size),
            ("vocab_size", cfg.vocab_size),
            ("attn_res_block_size", cfg.attn_res_block_size),
            ("num_attention_heads", cfg.mla_heads),
            ("intermediate_size", cfg.intermediate_size),
        ] {
            if v == 0 {
                return Err(unsupported(&tc.name(field), "0", "must be positive"));
            }
        }
        if cfg.conv_kernel < 1 {
            return Err(unsupported(&la.name("short_conv_kernel_size"), "0", "must be positive"));
        }
        if cfg.rms_norm_eps.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            return Err(unsupported(&tc.name("rms_norm_eps"), &cfg.rms_norm_eps.to_string(), "must be positive"));
        }
        Ok(cfg)
    }

    /// The byte shape of one routed expert.
    pub fn expert_shape(&self) -> ExpertShape {
        ExpertShape { inter: self.moe_intermediate_size, latent: self.latent_size, group: self.group_size }
    }

    /// Indices of MoE layers.
    pub fn moe_layers(&self) -> Vec<usize> {
        (0..self.num_layers).filter(|&l| self.mlp[l] == MlpKind::Moe).collect()
    }

    /// Whether a layer starts an Attention-Residual block.
    pub fn is_block_start(&self, layer: usize) -> bool {
        layer.is_multiple_of(self.attn_res_block_size)
    }

    /// KDA projection width (heads x head_dim).
    pub fn kda_dim(&self) -> usize {
        self.kda_heads * self.kda_head_dim
    }

    /// MLA query head width (nope + rope).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_dim + self.qk_rope_dim
    }
}

fn quant_group_size(tc: &Fields<'_>) -> Result<usize> {
    let q = tc.obj("quantization_config")?;
    let format = q.str("format")?;
    if format != "mxfp4-pack-quantized" {
        return Err(unsupported(&q.name("format"), &format, "only `mxfp4-pack-quantized` experts are supported"));
    }
    let groups = q.obj("config_groups")?;
    let mut size = None;
    if let Value::Object(map) = groups.v {
        for key in map.keys() {
            let w = groups.obj(key)?.obj("weights")?;
            let bits = w.usize("num_bits")?;
            if bits != 4 {
                return Err(unsupported(&w.name("num_bits"), &bits.to_string(), "MXFP4 has 4 bits"));
            }
            let ty = w.str("type")?;
            if ty != "float" {
                return Err(unsupported(&w.name("type"), &ty, "MXFP4 is a float (E2M1) format"));
            }
            let g = w.usize("group_size")?;
            if g != 32 {
                return Err(unsupported(&w.name("group_size"), &g.to_string(), "MXFP4 groups are 32 wide"));
            }
            size = Some(g);
        }
    }
    size.ok_or_else(|| Error::MissingField { field: groups.name("group_0"), expected: "object" })
}

fn expect_str(f: &Fields<'_>, key: &str, want: &str) -> Result<()> {
    let got = f.str(key)?;
    if got != want {
        return Err(unsupported(&f.name(key), &format!("{got:?}"), &format!("K3 uses {want:?}")));
    }
    Ok(())
}

fn unsupported(field: &str, value: &str, why: &str) -> Error {
    Error::Unsupported { field: field.to_string(), value: value.to_string(), why: why.to_string() }
}

/// A JSON object with its path, so every error names the full field (`text_config.hidden_size`).
#[derive(Clone)]
struct Fields<'a> {
    v: &'a Value,
    path: String,
}

impl<'a> Fields<'a> {
    fn name(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }
    fn opt(&self, key: &str) -> Option<&'a Value> {
        self.v.get(key).filter(|v| !v.is_null())
    }
    fn get(&self, key: &str, expected: &'static str) -> Result<&'a Value> {
        self.opt(key).ok_or_else(|| Error::MissingField { field: self.name(key), expected })
    }
    fn obj(&self, key: &str) -> Result<Fields<'a>> {
        let v = self.get(key, "object")?;
        if !v.is_object() {
            return Err(Error::MissingField { field: self.name(key), expected: "object" });
        }
        Ok(Fields { v, path: self.name(key) })
    }
    fn str(&self, key: &str) -> Result<String> {
        self.get(key, "string")?
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| Error::MissingField { field: self.name(key), expected: "string" })
    }
    fn usize(&self, key: &str) -> Result<usize> {
        let v = self.get(key, "non-negative integer")?;
        v.as_u64().map(|x| x as usize).ok_or_else(|| match v.as_i64() {
            Some(n) => unsupported(&self.name(key), &n.to_string(), "must be non-negative"),
            None => Error::MissingField { field: self.name(key), expected: "non-negative integer" },
        })
    }
    fn f32(&self, key: &str) -> Result<f32> {
        let v = self.get(key, "number")?;
        let x = v.as_f64().ok_or_else(|| Error::MissingField { field: self.name(key), expected: "number" })?;
        if !x.is_finite() {
            return Err(unsupported(&self.name(key), &x.to_string(), "must be finite"));
        }
        Ok(x as f32)
    }
    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.opt(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| Error::MissingField { field: self.name(key), expected: "boolean" }),
        }
    }
    fn usize_list(&self, key: &str) -> Result<Vec<usize>> {
        let v = self.get(key, "array of integers")?;
        let arr = v.as_array().ok_or_else(|| Error::MissingField { field: self.name(key), expected: "array of integers" })?;
        arr.iter()
            .map(|x| {
                x.as_u64()
                    .map(|n| n as usize)
                    .ok_or_else(|| unsupported(&self.name(key), &x.to_string(), "entries must be non-negative integers"))
            })
            .collect()
    }
    /// Special token ids live at the root in the release and in `text_config` too; root wins.
    fn u32_or_inner(&self, key: &str, inner: &Fields<'_>) -> Result<u32> {
        let f = if self.opt(key).is_some() { self } else { inner };
        let v = f.usize(key)?;
        u32::try_from(v).map_err(|_| unsupported(&f.name(key), &v.to_string(), "must fit in 32 bits"))
    }
}

#[cfg(test)]
mod tests;
