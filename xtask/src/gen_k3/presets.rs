//! The shapes `gen-k3` writes: K3's own (`k3`, only sparse), smaller ones with K3's structure,
//! random ones (`rand`), and Kimi K3.1's of each size (`k31-*`: an indexer on every MLA layer).

use anyhow::{bail, Result};

use super::{Rng, K3_BYTES, K3_SHARDS};

/// Shape of a generated model.
#[derive(Clone, Debug)]
pub struct Preset {
    pub name: &'static str,
    pub hidden: usize,
    pub layers: usize,
    pub mla_layers: Vec<usize>,
    pub block: usize,
    pub kda_heads: usize,
    pub kda_dim: usize,
    pub mla_heads: usize,
    pub q_lora: usize,
    pub kv_lora: usize,
    pub nope: usize,
    pub rope: usize,
    pub v_dim: usize,
    pub experts: usize,
    pub top_k: usize,
    pub shared: usize,
    pub moe_inter: usize,
    pub latent: usize,
    pub dense_inter: usize,
    pub bpe_ranks: usize,
    pub shard_bytes: u64,
    /// Layers (0-based) below this have a dense MLP (`first_k_dense_replace`; K3: 1).
    pub first_dense: usize,
    /// Kimi K3.1's sparse-attention indexer on every MLA layer (`None`: K3).
    pub indexer: Option<IndexerShape>,
}

/// The shape of K3.1's indexer (`dsa_config`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexerShape {
    pub topk: usize,
    pub heads: usize,
    pub head_dim: usize,
}

/// K3.1's indexer at the real size (the public implementations' reading of `dsa_config`).
pub const K31_INDEXER: IndexerShape = IndexerShape { topk: 2048, heads: 32, head_dim: 128 };

impl Preset {
    /// K3.1 of this shape: the same model with an indexer on every MLA layer.
    fn k31(self, name: &'static str, indexer: IndexerShape) -> Preset {
        Preset { name, indexer: Some(indexer), ..self }
    }

    pub fn by_name(name: &str) -> Result<Preset> {
        let tiny = Preset {
            name: "tiny",
            hidden: 64,
            layers: 6,
            mla_layers: vec![3, 6],
            block: 2,
            kda_heads: 2,
            kda_dim: 32,
            mla_heads: 2,
            q_lora: 32,
            kv_lora: 32,
            nope: 16,
            rope: 16,
            v_dim: 16,
            experts: 16,
            top_k: 4,
            shared: 1,
            moe_inter: 64,
            latent: 32,
            dense_inter: 128,
            bpe_ranks: 2048,
            shard_bytes: 1 << 20,
            first_dense: 1,
            indexer: None,
        };
        // Small K3.1s keep few keys, so short contexts already select.
        let small_indexer = IndexerShape { topk: 16, heads: 4, head_dim: 16 };
        let mid_indexer = IndexerShape { topk: 64, heads: 8, head_dim: 64 };
        Ok(match name {
            "tiny" => tiny,
            "small" => Preset {
                name: "small",
                hidden: 1024,
                layers: 8,
                mla_layers: vec![4, 8],
                block: 4,
                kda_heads: 8,
                kda_dim: 64,
                mla_heads: 8,
                q_lora: 256,
                kv_lora: 128,
                nope: 64,
                rope: 32,
                v_dim: 64,
                experts: 64,
                top_k: 8,
                shared: 2,
                moe_inter: 512,
                latent: 512,
                dense_inter: 2048,
                bpe_ranks: 16384,
                shard_bytes: 100 << 20,
                first_dense: 1,
                indexer: None,
            },
            // Real K3 expert shape (17,547,264 bytes per expert), fewer layers and experts.
            "slice" => Preset {
                name: "slice",
                hidden: 2048,
                layers: 6,
                mla_layers: vec![3, 6],
                block: 3,
                kda_heads: 8,
                kda_dim: 128,
                mla_heads: 8,
                q_lora: 512,
                kv_lora: 512,
                nope: 128,
                rope: 64,
                v_dim: 128,
                experts: 48,
                top_k: 8,
                shared: 1,
                moe_inter: 3072,
                latent: 3584,
                dense_inter: 4096,
                bpe_ranks: 16384,
                shard_bytes: 1 << 30,
                first_dense: 1,
                indexer: None,
            },
            // `slice` whose router prefers some experts, as a trained router does: tokens share
            // experts, so a verify of several rows reads fewer than rows x top-k experts (the
            // speculation benchmark; random routers share almost none).
            "slice-hot" => Preset { name: "slice-hot", ..Preset::by_name("slice")? },
            // Real expert size, small enough to replicate on four emulated drives (drive ladder).
            "slice-mini" => Preset {
                name: "slice-mini",
                hidden: 1024,
                layers: 4,
                mla_layers: vec![4],
                block: 2,
                kda_heads: 8,
                kda_dim: 64,
                mla_heads: 8,
                q_lora: 256,
                kv_lora: 256,
                nope: 64,
                rope: 32,
                v_dim: 64,
                experts: 16,
                top_k: 4,
                shared: 1,
                moe_inter: 3072,
                latent: 3584,
                dense_inter: 2048,
                bpe_ranks: 8192,
                shard_bytes: 1 << 30,
                first_dense: 1,
                indexer: None,
            },
            // The real K3 (../shared/K3.md): 93 layers, 896 experts, 1.56 TB in 96 shards. Only
            // ever written `--sparse`.
            "k3" => Preset {
                name: "k3",
                hidden: 7168,
                layers: 93,
                mla_layers: (4..=92).step_by(4).chain([93]).collect(),
                block: 12,
                kda_heads: 96,
                kda_dim: 128,
                mla_heads: 96,
                q_lora: 1536,
                kv_lora: 512,
                nope: 128,
                rope: 64,
                v_dim: 128,
                experts: 896,
                top_k: 16,
                shared: 2,
                moe_inter: 3072,
                latent: 3584,
                dense_inter: 33792,
                bpe_ranks: 163_584,
                shard_bytes: K3_BYTES.div_ceil(K3_SHARDS as u64),
                first_dense: 1,
                indexer: None,
            },
            // Kimi K3.1: each shape above with the indexer on its MLA layers.
            "k31" => Preset::by_name("k3")?.k31("k31", K31_INDEXER),
            "k31-tiny" => Preset::by_name("tiny")?.k31("k31-tiny", small_indexer),
            "k31-small" => Preset::by_name("small")?.k31("k31-small", mid_indexer),
            "k31-slice" => Preset::by_name("slice")?.k31("k31-slice", mid_indexer),
            "k31-slice-mini" => Preset::by_name("slice-mini")?.k31("k31-slice-mini", mid_indexer),
            // The float64 reference's model (`xtask/oracle/k31_reference.py`): MLA and dense
            // MLPs only, so the reference needs no KDA or experts to check the indexer.
            "k31-ref" => Preset {
                name: "k31-ref",
                layers: 3,
                mla_layers: vec![1, 2, 3],
                block: 2,
                first_dense: 3,
                bpe_ranks: 1024,
                ..tiny.k31("k31-ref", small_indexer)
            },
            other => bail!(
                "unknown preset {other:?}: use tiny, rand, small, slice, slice-hot, slice-mini, k3, or K3.1's k31-tiny, k31-small, k31-slice, k31-slice-mini, k31, k31-ref"
            ),
        })
    }

    /// A tiny model whose every dimension and the layer schedule are drawn from `seed`
    /// (`--preset rand`): exercises config-driven code paths the fixed presets do not.
    pub fn random(seed: u64) -> Preset {
        let mut r = Rng::for_tensor(seed, "preset");
        let mut pick = |choices: &[usize]| choices[(r.next() % choices.len() as u64) as usize];
        let layers = pick(&[4, 5, 6, 7]);
        let mut mla_layers: Vec<usize> = (2..=layers).filter(|_| pick(&[0, 0, 1]) == 1).collect();
        if mla_layers.is_empty() {
            mla_layers.push(layers);
        }
        let nope = pick(&[16, 32]);
        let experts = pick(&[8, 16, 24]);
        Preset {
            name: "rand",
            hidden: pick(&[64, 96, 128]),
            layers,
            mla_layers,
            block: pick(&[2, 3, 4]),
            kda_heads: pick(&[1, 2, 3]),
            kda_dim: pick(&[16, 32]),
            mla_heads: pick(&[1, 2, 4]),
            q_lora: pick(&[32, 48]),
            kv_lora: pick(&[32, 64]),
            nope,
            rope: pick(&[8, 16]),
            v_dim: pick(&[16, 24]),
            experts,
            top_k: pick(&[2, 4, 6]).min(experts),
            shared: pick(&[0, 1, 2]),
            moe_inter: pick(&[32, 64, 96]),
            latent: pick(&[32, 64]),
            dense_inter: pick(&[64, 160]),
            bpe_ranks: 1024,
            shard_bytes: 256 << 10,
            first_dense: 1,
            indexer: None,
        }
    }

    /// Whether this is the real size (only ever written `--sparse`).
    pub fn full_size(&self) -> bool {
        matches!(self.name, "k3" | "k31")
    }

    pub(super) fn kda_layers(&self) -> Vec<usize> {
        (1..=self.layers).filter(|l| !self.mla_layers.contains(l)).collect()
    }
}
