//! `cargo xtask gen-k3`: writes a K3-format checkpoint in exactly the release layout.
//!
//! Names, dtypes, the index and several shards as in `moonshotai/Kimi-K3`; MXFP4 experts with
//! each expert's six records contiguous; a tiktoken rank file (the first ranks of the real o200k
//! file, which form a consistent BPE vocabulary) with K3's 256 reserved ids after it.
//! Weights are random but scaled (`1/sqrt(fan_in)`, norms near 1, a wider `lm_head`) so
//! activations stay sane and greedy decoding has clear margins. Every tensor's bytes come from its
//! own seeded stream, so the output depends only on `--preset` and `--seed`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

mod presets;
pub use presets::{IndexerShape, Preset, K31_INDEXER};

fn config_json(p: &Preset) -> Value {
    let n = p.bpe_ranks;
    let text = json!({
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "architectures": ["KimiLinearForCausalLM"],
        "attn_res_block_size": p.block,
        "bos_token_id": n,
        "dtype": "bfloat16",
        "eos_token_id": n + 2,
        "first_k_dense_replace": p.first_dense,
        "hidden_act": "situ",
        "hidden_size": p.hidden,
        "intermediate_size": p.dense_inter,
        "kv_lora_rank": p.kv_lora,
        "latent_moe_use_norm": true,
        "linear_attn_config": {
            "full_attn_layers": p.mla_layers,
            "gate_lower_bound": -5.0,
            "head_dim": p.kda_dim,
            "kda_layers": p.kda_layers(),
            "num_heads": p.kda_heads,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": true
        },
        "max_position_embeddings": 1048576,
        "mla_use_nope": true,
        "mla_use_output_gate": true,
        "model_type": "kimi_linear",
        "moe_intermediate_size": p.moe_inter,
        "moe_layer_freq": 1,
        "moe_renormalize": true,
        "moe_router_activation_func": "sigmoid",
        "num_attention_heads": p.mla_heads,
        "num_expert_group": 1,
        "num_experts": p.experts,
        "num_experts_per_token": p.top_k,
        "num_hidden_layers": p.layers,
        "num_key_value_heads": p.mla_heads,
        "num_nextn_predict_layers": 0,
        "num_shared_experts": p.shared,
        "pad_token_id": n + 255,
        "q_lora_rank": p.q_lora,
        "qk_nope_head_dim": p.nope,
        "qk_rope_head_dim": p.rope,
        "quantization_config": {
            "config_groups": {"group_0": {
                "format": "mxfp4-pack-quantized", "input_activations": null, "output_activations": null,
                "targets": ["Linear"],
                "weights": {"actorder": null, "block_structure": null, "dynamic": false, "group_size": 32,
                    "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8",
                    "strategy": "group", "symmetric": true, "type": "float", "zp_dtype": null}
            }},
            "format": "mxfp4-pack-quantized",
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
            "kv_cache_scheme": null,
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed"
        },
        "rms_norm_eps": 1e-5,
        "routed_expert_hidden_size": p.latent,
        "routed_scaling_factor": 1.0,
        "tie_word_embeddings": false,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "use_grouped_topk": true,
        "v_head_dim": p.v_dim,
        "vocab_size": n + 256
    });
    let mut text = text;
    let (arch, model_type) = match p.indexer {
        None => ("KimiK3ForConditionalGeneration", "kimi_k3"),
        Some(ix) => {
            text["dsa_config"] = json!({
                "index_head_dim": ix.head_dim,
                "index_k_norm_type": "layernorm",
                "index_num_heads": ix.heads,
                "index_rope_dim": 0,
                "index_topk": ix.topk,
                "indexer_use_fp8": false,
                "layers": p.mla_layers,
            });
            ("KimiK31ForConditionalGeneration", "kimi_k31")
        }
    };
    json!({
        "architectures": [arch],
        "bos_token_id": n,
        "eos_token_id": n + 2,
        "pad_token_id": n + 255,
        "model_type": model_type,
        "text_config": text,
        "tie_word_embeddings": false,
        "deltafin_generated": {"preset": p.name}
    })
}

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug)]
enum Init {
    /// Uniform BF16 with this standard deviation.
    Bf16(f32),
    /// BF16 around 1 (norm weights).
    Bf16Norm,
    /// F32 uniform with this std around a mean.
    F32 { mean: f32, std: f32 },
    /// A_log: per-head log(uniform 1..16), then zero padding.
    ALog { heads: usize },
    /// Random E2M1 codes.
    Packed,
    /// E8M0 scales giving weights of this std.
    Scale(f32),
}

struct Spec {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
    init: Init,
}

impl Spec {
    fn bytes(&self) -> u64 {
        let n: usize = self.shape.iter().product();
        (n * match self.dtype {
            "BF16" => 2,
            "F32" => 4,
            _ => 1,
        }) as u64
    }
}

fn bf16(name: String, shape: Vec<usize>, std: f32) -> Spec {
    Spec { name, dtype: "BF16", shape, init: Init::Bf16(std) }
}

fn linear(name: String, out: usize, inp: usize) -> Spec {
    bf16(name, vec![out, inp], 1.0 / (inp as f32).sqrt())
}

fn norm(name: String, n: usize) -> Spec {
    Spec { name, dtype: "BF16", shape: vec![n], init: Init::Bf16Norm }
}

fn specs(p: &Preset) -> Vec<Vec<Spec>> {
    let m = "language_model.model";
    let h = p.hidden;
    let c = p.kda_heads * p.kda_dim;
    let mut groups = Vec::new();
    for l in 0..p.layers {
        let mut g = Vec::new();
        let pre = format!("{m}.layers.{l}");
        g.push(norm(format!("{pre}.input_layernorm.weight"), h));
        g.push(norm(format!("{pre}.post_attention_layernorm.weight"), h));
        for r in ["self_attention_res", "mlp_res"] {
            g.push(norm(format!("{pre}.{r}_norm.weight"), h));
            g.push(bf16(format!("{pre}.{r}_proj.weight"), vec![1, h], 1.0 / (h as f32).sqrt()));
        }
        let a = format!("{pre}.self_attn");
        if p.mla_layers.contains(&(l + 1)) {
            g.push(linear(format!("{a}.q_a_proj.weight"), p.q_lora, h));
            g.push(norm(format!("{a}.q_a_layernorm.weight"), p.q_lora));
            g.push(linear(format!("{a}.q_b_proj.weight"), p.mla_heads * (p.nope + p.rope), p.q_lora));
            g.push(linear(format!("{a}.kv_a_proj_with_mqa.weight"), p.kv_lora + p.rope, h));
            g.push(norm(format!("{a}.kv_a_layernorm.weight"), p.kv_lora));
            g.push(linear(format!("{a}.kv_b_proj.weight"), p.mla_heads * (p.nope + p.v_dim), p.kv_lora));
            g.push(linear(format!("{a}.o_proj.weight"), h, p.mla_heads * p.v_dim));
            g.push(linear(format!("{a}.g_proj.weight"), p.mla_heads * p.v_dim, h));
            if let Some(ix) = p.indexer {
                g.extend(indexer_specs(&format!("{a}.indexer"), ix, p));
            }
        } else {
            for n in ["q", "k", "v"] {
                g.push(linear(format!("{a}.{n}_proj.weight"), c, h));
                g.push(Spec {
                    name: format!("{a}.{n}_conv1d.weight"),
                    dtype: "F32",
                    shape: vec![c, 1, 4],
                    init: Init::F32 { mean: 0.0, std: 0.5 },
                });
            }
            g.push(linear(format!("{a}.f_a_proj.weight"), p.kda_dim, h));
            g.push(linear(format!("{a}.f_b_proj.weight"), c, p.kda_dim));
            g.push(linear(format!("{a}.b_proj.weight"), p.kda_heads, h));
            g.push(linear(format!("{a}.g_proj.weight"), c, h));
            g.push(Spec {
                name: format!("{a}.A_log"),
                dtype: "F32",
                shape: vec![p.kda_dim.max(p.kda_heads)],
                init: Init::ALog { heads: p.kda_heads },
            });
            g.push(Spec { name: format!("{a}.dt_bias"), dtype: "F32", shape: vec![c], init: Init::F32 { mean: 0.0, std: 0.5 } });
            g.push(Spec {
                name: format!("{a}.o_norm.weight"),
                dtype: "F32",
                shape: vec![p.kda_dim],
                init: Init::F32 { mean: 1.0, std: 0.05 },
            });
            g.push(linear(format!("{a}.o_proj.weight"), h, c));
        }
        if l < p.first_dense {
            for (n, o, i) in [("gate_proj", p.dense_inter, h), ("up_proj", p.dense_inter, h), ("down_proj", h, p.dense_inter)] {
                g.push(linear(format!("{pre}.mlp.{n}.weight"), o, i));
            }
        } else {
            let b = format!("{pre}.block_sparse_moe");
            g.push(linear(format!("{b}.gate.weight"), p.experts, h));
            g.push(Spec {
                name: format!("{b}.gate.e_score_correction_bias"),
                dtype: "F32",
                shape: vec![p.experts],
                init: Init::F32 { mean: 0.0, std: if p.name == "slice-hot" { HOT_BIAS_STD } else { 0.05 } },
            });
            g.push(linear(format!("{b}.routed_expert_down_proj.weight"), p.latent, h));
            g.push(norm(format!("{b}.routed_expert_norm.weight"), p.latent));
            g.push(linear(format!("{b}.routed_expert_up_proj.weight"), h, p.latent));
            let si = p.moe_inter * p.shared;
            for (n, o, i) in [("gate_proj", si, h), ("up_proj", si, h), ("down_proj", h, si)] {
                if si > 0 {
                    g.push(linear(format!("{b}.shared_experts.{n}.weight"), o, i));
                }
            }
            groups.push(g);
            for e in 0..p.experts {
                let mut eg = Vec::new();
                for (w, rows, cols) in [("w1", p.moe_inter, p.latent), ("w2", p.latent, p.moe_inter), ("w3", p.moe_inter, p.latent)] {
                    let x = format!("{b}.experts.{e}.{w}");
                    eg.push(Spec { name: format!("{x}.weight_packed"), dtype: "U8", shape: vec![rows, cols / 2], init: Init::Packed });
                    eg.push(Spec {
                        name: format!("{x}.weight_scale"),
                        dtype: "U8",
                        shape: vec![rows, cols / 32],
                        init: Init::Scale(1.0 / (cols as f32).sqrt()),
                    });
                }
                groups.push(eg);
            }
            continue;
        }
        groups.push(g);
    }
    groups.push(vec![
        bf16(format!("{m}.embed_tokens.weight"), vec![p.bpe_ranks + 256, h], 1.0),
        norm(format!("{m}.norm.weight"), h),
        norm(format!("{m}.output_attn_res_norm.weight"), h),
        bf16(format!("{m}.output_attn_res_proj.weight"), vec![1, h], 1.0 / (h as f32).sqrt()),
        bf16("language_model.lm_head.weight".into(), vec![p.bpe_ranks + 256, h], 4.0 / (h as f32).sqrt()),
    ]);
    if p.full_size() {
        // K3's own byte and tensor counts, the vision tower filling what its text model leaves;
        // K3.1's indexer comes on top.
        let k3 = |s: &&Spec| !s.name.contains(".indexer.");
        let have: u64 = groups.iter().flatten().filter(k3).map(Spec::bytes).sum();
        let count: usize = groups.iter().flatten().filter(k3).count();
        groups.push(k3_vision_tower(K3_BYTES - have, K3_TENSORS - count));
        return groups;
    }
    // A stand-in for the vision tower the release carries (text inference must ignore it).
    groups.push(vec![
        bf16("vision_tower.patch_embed.proj.weight".into(), vec![32, 3, 2, 2], 0.1),
        norm("mm_projector.post_norm.weight".into(), 32),
    ]);
    groups
}

/// K3.1's indexer tensors of one MLA layer (`self_attn.indexer.*`): BF16 throughout (the
/// release's dtypes are not known; the loader also takes F32 norms).
fn indexer_specs(pre: &str, ix: IndexerShape, p: &Preset) -> Vec<Spec> {
    vec![
        linear(format!("{pre}.wq_b.weight"), ix.heads * ix.head_dim, p.q_lora),
        linear(format!("{pre}.wk.weight"), ix.head_dim, p.hidden),
        linear(format!("{pre}.weights_proj.weight"), ix.heads, p.hidden),
        norm(format!("{pre}.k_norm.weight"), ix.head_dim),
        bf16(format!("{pre}.k_norm.bias"), vec![ix.head_dim], 0.1),
    ]
}

/// The real K3's shard count, tensor count and tensor bytes (../shared/K3.md).
pub const K3_SHARDS: usize = 96;
pub const K3_TENSORS: usize = 497_220;
pub const K3_BYTES: u64 = 1_560_860_324_864;

/// A vision tower of exactly `bytes` in `count` BF16 tensors (ViT blocks, a patch embedding,
/// the projector; the last tensor takes the remainder), so the checkpoint has the release's
/// tensor count and size: text inference must skip all of it.
fn k3_vision_tower(bytes: u64, count: usize) -> Vec<Spec> {
    let (w, ff) = (1152, 4304);
    let v = |name: String, shape: Vec<usize>| bf16(name, shape, 0.02);
    let mut g = vec![
        v("vision_tower.patch_embed.proj.weight".into(), vec![w, 3, 14, 14]),
        v("mm_projector.pre_norm.weight".into(), vec![w]),
        v("mm_projector.proj.0.weight".into(), vec![7168, 4608]),
        v("mm_projector.proj.0.bias".into(), vec![7168]),
    ];
    let mut b = 0;
    while g.len() + 6 < count {
        let pre = format!("vision_tower.encoder.blocks.{b}");
        for (n, shape) in [("norm1.weight", vec![w]), ("attn.qkv.weight", vec![3 * w, w]), ("attn.proj.weight", vec![w, w])] {
            g.push(v(format!("{pre}.{n}"), shape));
        }
        for (n, shape) in [("norm2.weight", vec![w]), ("mlp.fc1.weight", vec![ff, w]), ("mlp.fc2.weight", vec![w, ff])] {
            g.push(v(format!("{pre}.{n}"), shape));
        }
        b += 1;
    }
    while g.len() + 1 < count {
        g.push(v(format!("vision_tower.encoder.post_norm.{}.weight", g.len()), vec![w]));
    }
    let rest = bytes - g.iter().map(Spec::bytes).sum::<u64>();
    g.push(v("vision_tower.pos_embed".into(), vec![rest as usize / 2]));
    g
}

/// Spread of the router's score-correction bias in `slice-hot`: about the spread of the
/// sigmoid scores themselves, so the favoured experts win most rows.
const HOT_BIAS_STD: f32 = 0.3;

/// A small, fast, seedable generator (xorshift64*), one stream per tensor.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn for_tensor(seed: u64, name: &str) -> Rng {
        let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for b in name.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
        Rng(h | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    pub(crate) fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

pub(crate) fn to_bf16(x: f32) -> [u8; 2] {
    // Round to nearest even.
    let b = x.to_bits();
    let r = b.wrapping_add(0x7FFF + ((b >> 16) & 1));
    ((r >> 16) as u16).to_le_bytes()
}

fn write_values(spec: &Spec, seed: u64, out: &mut impl Write) -> Result<()> {
    let mut rng = Rng::for_tensor(seed, &spec.name);
    let n: usize = spec.shape.iter().product();
    let sqrt3 = 3f32.sqrt();
    let mut buf: Vec<u8> = Vec::with_capacity(1 << 20);
    let flush = |buf: &mut Vec<u8>, out: &mut dyn Write, force: bool| -> Result<()> {
        if force || buf.len() >= 1 << 20 {
            out.write_all(buf)?;
            buf.clear();
        }
        Ok(())
    };
    match spec.init {
        Init::Bf16(std) => {
            for _ in 0..n {
                buf.extend_from_slice(&to_bf16(rng.unit() * std * sqrt3));
                flush(&mut buf, out, false)?;
            }
        }
        Init::Bf16Norm => {
            for _ in 0..n {
                buf.extend_from_slice(&to_bf16(1.0 + 0.1 * rng.unit()));
            }
        }
        Init::F32 { mean, std } => {
            for _ in 0..n {
                buf.extend_from_slice(&(mean + rng.unit() * std * sqrt3).to_le_bytes());
            }
        }
        Init::ALog { heads } => {
            for i in 0..n {
                let v = if i < heads { (1.0 + 7.5 * (rng.unit() + 1.0)).ln() } else { 0.0 };
                buf.extend_from_slice(&v.to_le_bytes());
            }
        }
        Init::Packed => {
            let mut i = 0;
            while i < n {
                let r = rng.next().to_le_bytes();
                let take = (n - i).min(8);
                buf.extend_from_slice(&r[..take]);
                i += take;
                flush(&mut buf, out, false)?;
            }
        }
        Init::Scale(std) => {
            // Random E2M1 codes have RMS ~2.93; pick 2^k so weights have about this std,
            // varied by +-1 per group.
            let k = (std / 2.93).log2().round() as i32;
            for _ in 0..n {
                let jitter = (rng.next() % 3) as i32 - 1;
                buf.push((127 + k + jitter) as u8);
            }
        }
    }
    flush(&mut buf, out, true)
}

/// The first `n` ranks of the real o200k file, rebuilt from the copy tiktoken-rs carries inside
/// itself (each rank's bytes, base64, then the rank): no cargo, no file, so a prebuilt `xtask`
/// generates models on a machine without a Rust toolchain (the GPU machine).
fn o200k_prefix(n: usize) -> Result<String> {
    use base64::Engine as _;
    let bpe = tiktoken_rs::o200k_base_singleton();
    let mut out = String::with_capacity(n * 16);
    for rank in 0..n as u32 {
        let bytes = bpe.decode_bytes(&[rank]).map_err(|e| anyhow::anyhow!("o200k has no rank {rank} (it has fewer than {n}): {e}"))?;
        out.push_str(&base64::engine::general_purpose::STANDARD.encode(bytes));
        out.push(' ');
        out.push_str(&rank.to_string());
        out.push('\n');
    }
    Ok(out)
}

/// K3's `tokenizer_config.json` for a rank file of `n` BPE ranks: its special tokens at the
/// reserved ids right after them.
pub fn tokenizer_config(n: usize) -> Value {
    let mut added = serde_json::Map::new();
    for off in 0..deltafin_core::RESERVED {
        let name = deltafin_core::reserved_token_name(off, n);
        added.insert(
            (n + off).to_string(),
            json!({"content": name, "lstrip": false, "normalized": false, "rstrip": false, "single_word": false, "special": true}),
        );
    }
    json!({
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", "[start_header_id]", "[end_header_id]", "[EOT]"],
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": false,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer"
    })
}

pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Writes the checkpoint for `preset` with `seed` into `out`.
pub fn generate(preset: &str, seed: u64, out: &Path) -> Result<()> {
    generate_with(preset, seed, out, false)
}

/// As [`generate`]; `sparse` writes every weight as zeros left unwritten (holes in sparse
/// files): the full K3 layout in seconds, costing the headers' disk space only.
pub fn generate_with(preset: &str, seed: u64, out: &Path, sparse: bool) -> Result<()> {
    let p = if preset == "rand" { Preset::random(seed) } else { Preset::by_name(preset)? };
    if p.full_size() && !sparse {
        bail!("the {} preset is 1.56 TB of weights: write it with --sparse (every weight zero, almost no disk)", p.name);
    }
    let values = if sparse { Values::Sparse } else { Values::Seeded(seed) };
    write_release(&p, values, &o200k_prefix(p.bpe_ranks)?, out)
}

/// Where a written checkpoint's weights come from.
pub enum Values<'a> {
    /// Drawn from per-tensor streams of this seed.
    Seeded(u64),
    /// Zeros left unwritten (holes in sparse files).
    Sparse,
    /// Trained tensors by release name, each `(dtype, shape, bytes)`, checked against the
    /// layout; tensors the release has but training does not (the vision tower stand-in) are
    /// drawn from seed 0.
    Trained(&'a crate::gen_qwen3::Trained),
}

/// Writes `p`'s checkpoint in the release layout into `out`: shards, index, `ranks` as the
/// tiktoken rank file with K3's specials after them, and the configs.
pub fn write_release(p: &Preset, values: Values<'_>, ranks: &str, out: &Path) -> Result<()> {
    let p = p.clone();
    let sparse = matches!(values, Values::Sparse);
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    // Pack tensor groups into shards of about `shard_bytes`, never splitting a group (an expert's
    // six records stay together).
    let groups = specs(&p);
    let mut shards: Vec<Vec<Spec>> = vec![Vec::new()];
    let mut size = 0u64;
    let all: u64 = groups.iter().flatten().map(Spec::bytes).sum();
    let mut before = 0u64;
    for g in groups {
        let gb: u64 = g.iter().map(Spec::bytes).sum();
        let full = match p.full_size() {
            // A group goes to the shard its first byte falls in when the model is cut into 96
            // equal parts: exactly 96 shards, as in the release.
            true => (before as u128 * K3_SHARDS as u128 / all as u128) as usize >= shards.len(),
            false => size > 0 && size + gb > p.shard_bytes,
        };
        if full {
            shards.push(Vec::new());
            size = 0;
        }
        size += gb;
        before += gb;
        shards.last_mut().expect("one shard").extend(g);
    }
    let total: u64 = shards.iter().flatten().map(Spec::bytes).sum();
    let bar = if quiet() { indicatif::ProgressBar::hidden() } else { indicatif::ProgressBar::new(total) }.with_style(
        indicatif::ProgressStyle::with_template("gen-k3 {msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}")
            .expect("template"),
    );
    bar.set_message(p.name);
    bar.set_length(total);
    let count = shards.len();
    let mut weight_map = serde_json::Map::new();
    for (i, shard) in shards.iter().enumerate() {
        let fname = format!("model-{:05}-of-{:06}.safetensors", i + 1, count);
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), json!({"format": "pt"}));
        let mut off = 0u64;
        for s in shard {
            header.insert(s.name.clone(), json!({"dtype": s.dtype, "shape": s.shape, "data_offsets": [off, off + s.bytes()]}));
            off += s.bytes();
            weight_map.insert(s.name.clone(), json!(fname));
        }
        let mut hbytes = serde_json::to_vec(&Value::Object(header))?;
        while hbytes.len() % 8 != 0 {
            hbytes.push(b' ');
        }
        let path = out.join(&fname);
        let tmp = path.with_extension("tmp");
        let mut w = BufWriter::with_capacity(4 << 20, File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?);
        w.write_all(&(hbytes.len() as u64).to_le_bytes())?;
        w.write_all(&hbytes)?;
        if sparse {
            // The data as a hole: reads give zeros, the disk holds only the header.
            let f = w.into_inner().map_err(|e| e.into_error())?;
            f.set_len(8 + hbytes.len() as u64 + off).with_context(|| format!("extending {}", tmp.display()))?;
            bar.inc(off);
            f.sync_all()?;
            std::fs::rename(&tmp, &path)?;
            continue;
        }
        for s in shard {
            match (&values, trained_bytes(&values, s)?) {
                (_, Some(bytes)) => w.write_all(bytes)?,
                (Values::Seeded(seed), None) => write_values(s, *seed, &mut w)?,
                _ => write_values(s, 0, &mut w)?,
            }
            bar.inc(s.bytes());
        }
        w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, &path)?;
    }
    bar.finish();
    write_atomic(
        &out.join("model.safetensors.index.json"),
        &serde_json::to_vec_pretty(&json!({"metadata": {"total_size": total}, "weight_map": weight_map}))?,
    )?;
    write_atomic(&out.join("tiktoken.model"), ranks.as_bytes())?;
    write_atomic(&out.join("tokenizer_config.json"), &serde_json::to_vec_pretty(&tokenizer_config(p.bpe_ranks))?)?;
    write_atomic(
        &out.join("generation_config.json"),
        &serde_json::to_vec_pretty(&json!({"bos_token_id": p.bpe_ranks, "eos_token_id": p.bpe_ranks + 2, "do_sample": false}))?,
    )?;
    write_atomic(&out.join("config.json"), &serde_json::to_vec_pretty(&config_json(&p))?)?;
    if !quiet() {
        eprintln!("wrote {} ({} shards, {:.1} MB) to {}", p.name, count, total as f64 / 1e6, out.display());
    }
    Ok(())
}

/// A trained tensor's bytes for `spec`, checked to have its release dtype and shape; `None`
/// where the values are not trained ones (or the tensor is not one training makes).
fn trained_bytes<'a>(values: &'a Values<'_>, spec: &Spec) -> Result<Option<&'a [u8]>> {
    let Values::Trained(t) = values else { return Ok(None) };
    let Some((dtype, shape, bytes)) = t.get(&spec.name) else {
        if spec.name.starts_with("language_model.") {
            bail!("the trained tensors lack {} ({} {:?})", spec.name, spec.dtype, spec.shape);
        }
        return Ok(None);
    };
    if dtype != spec.dtype || shape != &spec.shape || bytes.len() as u64 != spec.bytes() {
        bail!("trained {} is {dtype} {shape:?}; the release layout has {} {:?}", spec.name, spec.dtype, spec.shape);
    }
    Ok(Some(bytes))
}

/// The release names of every tensor `p` has (trained exports are checked against these).
pub fn tensor_names(p: &Preset) -> Vec<String> {
    specs(p).into_iter().flatten().map(|s| s.name).collect()
}

/// Library callers (tests) generate silently.
fn quiet() -> bool {
    std::env::var_os("DELTAFIN_QUIET").is_some()
}
