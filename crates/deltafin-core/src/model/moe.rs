//! The latent mixture of experts: sigmoid router with bias-corrected top-k, the MXFP4 expert
//! forward over borrowed bytes, a fixed-order combine, latent norm, up-projection, shared MLP.
//!
//! The engine loop (in `deltafin-sched`) owns the order in which experts are fetched and run; this
//! module only guarantees that the *result* does not depend on that order: every expert's output
//! lands in its token's slot, and slots are summed in ascending expert id.

use rayon::prelude::*;

use super::loader::Loader;
use crate::backend::Backend;
use crate::config::{ExpertShape, K3Config};
use crate::error::{Error, Result};
use crate::kernels::{for_row_chunks, matmul_mxfp4, permute_for_mxfp4_into, row_chunks, Isa, LinedRows, Mxfp4Matrix, PromptKernel};
use crate::math::{sigmoid, situ_in_place};
use crate::tensor::Mat;
use crate::weights::Bf16Matrix;

/// A SiTU-GLU MLP: `down(situ(up x, gate x))`.
pub(crate) struct GluWeights {
    gate: Bf16Matrix,
    up: Bf16Matrix,
    down: Bf16Matrix,
}

impl GluWeights {
    pub fn load(cfg: &K3Config, l: &Loader<'_>, inter: usize) -> Result<GluWeights> {
        let h = cfg.hidden_size;
        Ok(GluWeights {
            gate: l.matrix("gate_proj.weight", inter, h)?,
            up: l.matrix("up_proj.weight", inter, h)?,
            down: l.matrix("down_proj.weight", h, inter)?,
        })
    }
    pub fn forward(&self, cfg: &K3Config, be: &dyn Backend, x: &Mat) -> Mat {
        let g = be.matmul_bf16(x, &self.gate);
        let mut u = be.matmul_bf16(x, &self.up);
        be.situ_in_place(&mut u.data, &g.data, cfg.situ_beta, cfg.situ_linear_beta);
        be.matmul_bf16(&u, &self.down)
    }
}

/// Spine weights of one MoE layer (experts live in the store).
pub(crate) struct MoeWeights {
    router: Bf16Matrix,
    bias: Vec<f32>,
    down: Bf16Matrix,
    up: Bf16Matrix,
    norm: Option<Vec<f32>>,
    shared: Option<GluWeights>,
}

impl MoeWeights {
    pub fn load(cfg: &K3Config, l: &Loader<'_>) -> Result<MoeWeights> {
        let (h, e, lat) = (cfg.hidden_size, cfg.num_experts, cfg.latent_size);
        Ok(MoeWeights {
            router: l.matrix("gate.weight", e, h)?,
            bias: l.f32_tensor("gate.e_score_correction_bias", &[e])?,
            down: l.matrix("routed_expert_down_proj.weight", lat, h)?,
            up: l.matrix("routed_expert_up_proj.weight", h, lat)?,
            norm: if cfg.latent_norm { Some(l.vector("routed_expert_norm.weight", lat)?) } else { None },
            shared: if cfg.num_shared_experts > 0 {
                Some(GluWeights::load(cfg, &l.sub("shared_experts."), cfg.moe_intermediate_size * cfg.num_shared_experts)?)
            } else {
                None
            },
        })
    }

    pub fn route(&self, cfg: &K3Config, be: &dyn Backend, x: &Mat) -> Vec<Route> {
        let logits = be.matmul_bf16(x, &self.router);
        (0..x.rows).map(|t| route_one(cfg, logits.row(t), &self.bias)).collect()
    }

    pub fn latent_in(&self, be: &dyn Backend, x: &Mat) -> Mat {
        be.matmul_bf16(x, &self.down)
    }

    /// The shared experts over `x` (they need no expert bytes, so the engine runs them while
    /// routed experts are still being read).
    pub fn shared(&self, cfg: &K3Config, be: &dyn Backend, x: &Mat) -> Option<Mat> {
        self.shared.as_ref().map(|s| s.forward(cfg, be, x))
    }

    pub fn finish(&self, cfg: &K3Config, be: &dyn Backend, mut routed: Mat, shared: Option<Mat>) -> Mat {
        if let Some(w) = &self.norm {
            for t in 0..routed.rows {
                be.rms_norm_in_place(routed.row_mut(t), Some(w), cfg.rms_norm_eps);
            }
        }
        let mut y = be.matmul_bf16(&routed, &self.up);
        if let Some(s) = shared {
            y.add_assign(&s);
        }
        y
    }
}

/// The experts one token is routed to, ascending by id, with their weights.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
}

/// Sigmoid scores; the top-k by `score + bias` (ties to the lower id); weights are the chosen
/// *uncorrected* scores, renormalized and scaled. The bias selects; it never weighs.
fn route_one(cfg: &K3Config, logits: &[f32], bias: &[f32]) -> Route {
    let scores: Vec<f32> = logits.iter().map(|&v| sigmoid(v)).collect();
    let mut order: Vec<u32> = (0..scores.len() as u32).collect();
    let choice = |e: u32| scores[e as usize] + bias[e as usize];
    order.sort_by(|&a, &b| choice(b).total_cmp(&choice(a)).then(a.cmp(&b)));
    let mut experts = order[..cfg.experts_per_token].to_vec();
    experts.sort_unstable();
    let mut weights: Vec<f32> = experts.iter().map(|&e| scores[e as usize]).collect();
    if cfg.renormalize {
        let sum: f32 = weights.iter().sum::<f32>() + 1e-20;
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    weights.iter_mut().for_each(|w| *w *= cfg.routed_scaling_factor);
    Route { experts, weights }
}

/// Where each of the six records of an expert sits inside its contiguous byte span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertLayout {
    /// Offsets of `w1.packed, w1.scale, w2.packed, w2.scale, w3.packed, w3.scale`.
    pub offsets: [usize; 6],
    pub shape: ExpertShape,
}

impl ExpertLayout {
    /// The six records back to back in their order (w1 codes, w1 scales, w2 ..., w3 ...), as
    /// the release's shards hold them.
    pub fn packed(shape: ExpertShape) -> ExpertLayout {
        let (pb, sb) = (shape.packed_bytes(), shape.scale_bytes());
        ExpertLayout { offsets: [0, pb, pb + sb, 2 * pb + sb, 2 * pb + 2 * sb, 3 * pb + 2 * sb], shape }
    }
    /// Span length covered by the six records.
    pub fn span_len(&self) -> usize {
        self.shape.total_bytes()
    }
    fn matrices<'a>(&self, bytes: &'a [u8]) -> Result<[Mxfp4Matrix<'a>; 3]> {
        if bytes.len() < self.span_len() {
            return Err(Error::ExpertLayout(format!("expert span is {} bytes, expected {}", bytes.len(), self.span_len())));
        }
        let s = self.shape;
        let (pb, sb) = (s.packed_bytes(), s.scale_bytes());
        let rec = |i: usize, len: usize| -> Result<&'a [u8]> {
            bytes.get(self.offsets[i]..self.offsets[i] + len).ok_or_else(|| Error::ExpertLayout(format!("record {i} out of range")))
        };
        Ok([
            Mxfp4Matrix::new(s.inter, s.latent, rec(0, pb)?, rec(1, sb)?)?,
            Mxfp4Matrix::new(s.latent, s.inter, rec(2, pb)?, rec(3, sb)?)?,
            Mxfp4Matrix::new(s.inter, s.latent, rec(4, pb)?, rec(5, sb)?)?,
        ])
    }
}

/// Weight rows per chunk at the end of an [`expert_forward`] product (the last a core may wait on),
/// and all along for 2 to 31 tokens: the register tiles keep a chunk's lane accumulators (rows x
/// 4 inputs x 64 bytes, 8 KB at 32 rows) in L1 beside 16 KB of inputs.
const ROW_BLOCK: usize = 32;
/// Weight rows per chunk at its start for one token and for a prompt on panels: each panel
/// chunk reads every token's inputs once per K block, so a prompt wants big ones (the decoded
/// panel still fits L2); and handing out a chunk costs atomics whose cache lines move between the cores,
/// which 32-row chunks of one token's products (a few microseconds each) did not amortize
/// (decode ran ~5% slower on `small`).
const PROMPT_ROW_BLOCK: usize = 128;
/// Tokens from which an expert's products run as a prompt's (`PromptKernel`: decoded panels, or
/// register tiles where the CPU runs those faster).
const PROMPT_ROWS: usize = 32;

/// The chunks of weight rows [`expert_forward`]'s threads take, first come, first served, when
/// it runs `tokens` token rows over a matrix of `rows` rows on `isa`: the split a benchmark of
/// the expert kernels must use to measure what the engine runs. Chunks shrink to [`ROW_BLOCK`]
/// toward the end, so no core waits long on the other's last chunk; a prompt on register tiles
/// keeps them small all along, as 2 to 31 tokens do.
pub fn expert_row_chunks(isa: Isa, rows: usize, tokens: usize) -> Vec<std::ops::Range<usize>> {
    let panels = isa.prompt_kernel() == PromptKernel::Panels;
    let first = if tokens <= 1 || (tokens >= PROMPT_ROWS && panels) { PROMPT_ROW_BLOCK } else { ROW_BLOCK };
    row_chunks(rows, first, ROW_BLOCK, rayon::current_num_threads())
}

/// Fills each row `i` of `rows` with `fill(i, row)`, on every core for a prompt's many rows
/// (on one for decode's few, where handing work to threads costs more than it saves).
fn fill_rows(rows: &mut LinedRows, fill: impl Fn(usize, &mut [f32]) + Sync + Send) {
    if rows.rows() >= PROMPT_ROWS {
        rows.par_rows_mut().enumerate().for_each(|(i, r)| fill(i, r));
    } else {
        for i in 0..rows.rows() {
            fill(i, rows.row_mut(i));
        }
    }
}

/// One expert applied to some latent rows: `w2(situ(w3 z, w1 z))`, straight from its bytes.
pub fn expert_forward(cfg: &K3Config, isa: Isa, layout: &ExpertLayout, bytes: &[u8], z: &Mat) -> Result<Mat> {
    let [w1, w2, w3] = layout.matrices(bytes)?;
    let (inter, latent) = (layout.shape.inter, layout.shape.latent);
    // Rows go to threads in chunks; `matmul_mxfp4` walks a chunk in register tiles that decode
    // each weight group once for several token rows and cache-blocks a prompt's inputs. Every
    // value is still its one fixed-order dot, whatever the number of tokens.
    let t = z.rows;
    // Inputs on cache lines, which the prompt kernels read in place from every task.
    let mut zp = LinedRows::new(t, z.cols);
    fill_rows(&mut zp, |i, out| permute_for_mxfp4_into(z.row(i), out));
    let zr = zp.refs();
    // Row-major `[row][token]` outputs written in place.
    let mut act = vec![0f32; inter * t];
    for_row_chunks(&mut act, t, &expert_row_chunks(isa, inter, t), |rows, act| {
        let mut up = vec![0f32; act.len()];
        matmul_mxfp4(isa, &zr, &w3, rows.clone(), act);
        matmul_mxfp4(isa, &zr, &w1, rows, &mut up);
        situ_in_place(isa, act, &up, cfg.situ_beta, cfg.situ_linear_beta);
    });
    // Token `i`'s activations, column `c` from `act[c * t + i]`, permuted for MXFP4.
    let mut ap = LinedRows::new(t, inter);
    fill_rows(&mut ap, |i, out| {
        for (c, v) in act.iter().skip(i).step_by(t.max(1)).enumerate() {
            out[32 * (c / 32) + 16 * (c % 2) + (c % 32) / 2] = *v;
        }
    });
    let ar = ap.refs();
    let mut y = vec![0f32; latent * t];
    for_row_chunks(&mut y, t, &expert_row_chunks(isa, latent, t), |rows, y| matmul_mxfp4(isa, &ar, &w2, rows, y));
    let mut out = Mat::zeros(z.rows, latent);
    out.for_each_row(|i, o| {
        for (r, o) in o.iter_mut().enumerate() {
            *o = y[r * t + i];
        }
    });
    Ok(out)
}

/// Collects expert outputs in any arrival order and sums them in one fixed order.
pub struct MoeCombine {
    routes: Vec<Route>,
    /// `[token][slot][latent]`.
    slots: Vec<Option<Vec<f32>>>,
    latent: usize,
}

impl MoeCombine {
    /// Prepares slots for these routes.
    pub fn new(routes: Vec<Route>, latent: usize) -> MoeCombine {
        let n = routes.iter().map(|r| r.experts.len()).sum();
        MoeCombine { routes, slots: vec![None; n], latent }
    }
    /// The routes being combined.
    pub fn routes(&self) -> &[Route] {
        &self.routes
    }
    /// Distinct experts over all tokens, ascending, each with the token rows routed to it.
    pub fn expert_rows(&self) -> Vec<(u32, Vec<usize>)> {
        let mut map: std::collections::BTreeMap<u32, Vec<usize>> = Default::default();
        for (t, r) in self.routes.iter().enumerate() {
            for &e in &r.experts {
                map.entry(e).or_default().push(t);
            }
        }
        map.into_iter().collect()
    }
    /// Records expert `e`'s outputs for `rows` (one output row each).
    pub fn add(&mut self, e: u32, rows: &[usize], out: &Mat) {
        let k = self.routes.first().map_or(0, |r| r.experts.len());
        for (i, &t) in rows.iter().enumerate() {
            let slot = self.routes[t].experts.iter().position(|&x| x == e).expect("expert not routed for this row");
            self.slots[t * k + slot] = Some(out.row(i).to_vec());
        }
    }
    /// The weighted sum per token, slots in ascending expert id. Panics if an output is missing
    /// (a scheduling bug, never data-dependent).
    pub fn finish(self) -> Mat {
        self.sum(false)
    }
    /// The weighted sum of the outputs recorded so far, missing ones left out: a provisional
    /// result to guess the next layer's experts from, never an output.
    pub fn partial(&self) -> Mat {
        self.sum(true)
    }
    fn sum(&self, skip_missing: bool) -> Mat {
        let k = self.routes.first().map_or(0, |r| r.experts.len());
        let mut out = Mat::zeros(self.routes.len(), self.latent);
        out.for_each_row(|t, o| {
            for (s, w) in self.routes[t].weights.iter().enumerate() {
                let Some(y) = self.slots[t * k + s].as_ref() else {
                    assert!(skip_missing, "expert output missing");
                    continue;
                };
                for (oi, yi) in o.iter_mut().zip(y) {
                    *oi += w * yi;
                }
            }
        });
        out
    }
}
