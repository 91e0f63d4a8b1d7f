//! Kimi Delta Attention: short causal convolutions, a lower-bounded per-channel decay gate and
//! the delta rule over a constant-size `[H, V, K]` state.
//!
//! The engine runs the recurrent form for every token, one token after another, for prompts and
//! decode alike: it costs `O(H*K*V)` per token (tiny next to the projections) and makes a prompt
//! forward bit-identical to token-by-token decode. [`chunked_delta_rule`] is the parallel
//! (WY/UT-transform) form over a chunk of tokens; it is tested against the recurrence and kept
//! for backends where the chunked form pays.

use rayon::prelude::*;

use super::loader::Loader;
use crate::backend::Backend;
use crate::config::K3Config;
use crate::error::Result;
use crate::kernels::{dot_f32, Isa};
use crate::math::{sigmoid, silu};
use crate::tensor::Mat;
use crate::weights::Bf16Matrix;

/// KDA weights of one layer.
pub(crate) struct KdaWeights {
    q_proj: Bf16Matrix,
    k_proj: Bf16Matrix,
    v_proj: Bf16Matrix,
    /// Conv weights `[channels, kernel]` for q, k, v.
    conv: [Vec<f32>; 3],
    f_a: Bf16Matrix,
    f_b: Bf16Matrix,
    b_proj: Bf16Matrix,
    g_proj: Bf16Matrix,
    /// `exp(A_log[h])`, per head.
    a_exp: Vec<f32>,
    dt_bias: Vec<f32>,
    o_norm: Vec<f32>,
    o_proj: Bf16Matrix,
}

/// KDA recurrent state of one layer: the last `kernel-1` raw projected inputs of q, k, v and the
/// `[H, V, K]` delta-rule state.
#[derive(Clone, Debug)]
pub struct KdaState {
    /// `[3][kernel-1][channels]`, oldest first.
    pub conv: Vec<f32>,
    /// `[H][V][K]`.
    pub s: Vec<f32>,
    /// What the next forward keeps so it can be undone.
    pub record: Recording,
    replay: Option<Box<KdaReplay>>,
}

/// What a KDA layer keeps about its next forward so it can be undone. The MLA cache needs
/// nothing: it is truncated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recording {
    /// Nothing: the forward cannot be undone.
    #[default]
    Off,
    /// The state it started from (one copy of the layer's state, whatever the context length):
    /// the whole forward can be undone (a failed or cancelled pass).
    Start,
    /// The start and each token's recurrence inputs: it can be cut back to any prefix
    /// (speculative verification).
    Full,
}

impl PartialEq for KdaState {
    /// States are equal when their numbers are (the replay log is bookkeeping).
    fn eq(&self, other: &Self) -> bool {
        self.conv == other.conv && self.s == other.s
    }
}

/// What a recording KDA layer keeps about its last forward: the state it started from and each
/// token's recurrence inputs. Rewinding to a prefix of `p` tokens replays only the `O(H*K*V)`
/// recurrence for those tokens (no projection, no expert read) with the very same operations, so
/// the result is bit-identical to having run just the prefix.
#[derive(Clone, Debug)]
struct KdaReplay {
    conv: Vec<f32>,
    s: Vec<f32>,
    /// Tokens of the recorded forward.
    tokens: usize,
    /// Raw (pre-convolution) q, k, v projections, `[3][T*C]` (empty when only the start was
    /// recorded).
    raw: [Vec<f32>; 3],
    q: Mat,
    k: Mat,
    v: Mat,
    decay: Mat,
    beta: Vec<f32>,
}

impl KdaState {
    /// The zero state.
    pub fn new(cfg: &K3Config) -> KdaState {
        let c = cfg.kda_dim();
        KdaState {
            conv: vec![0.0; 3 * (cfg.conv_kernel - 1) * c],
            s: vec![0.0; cfg.kda_heads * cfg.kda_head_dim * cfg.kda_head_dim],
            record: Recording::Off,
            replay: None,
        }
    }

    /// Rewinds the last recorded forward so that only its first `keep` tokens count.
    pub(crate) fn rewind(&mut self, cfg: &K3Config, be: &dyn Backend, keep: usize) -> bool {
        let Some(r) = self.replay.take() else { return false };
        let (heads, d, c, kern) = (cfg.kda_heads, cfg.kda_head_dim, cfg.kda_dim(), cfg.conv_kernel);
        let start_only = r.beta.is_empty() && r.tokens > 0;
        if keep > r.tokens || (keep > 0 && start_only) {
            self.replay = Some(r);
            return false;
        }
        let w = (kern - 1) * c;
        for i in 0..3 {
            let mut hist = r.conv[i * w..(i + 1) * w].to_vec();
            hist.extend_from_slice(&r.raw[i][..keep * c]);
            self.conv[i * w..(i + 1) * w].copy_from_slice(&hist[hist.len() - w..]);
        }
        self.s.copy_from_slice(&r.s);
        let mut out = vec![0f32; d];
        for (hh, s) in self.s.chunks_mut(d * d).enumerate() {
            let sl = hh * d..(hh + 1) * d;
            for t in 0..keep {
                be.kda_step(
                    s,
                    &r.q.row(t)[sl.clone()],
                    &r.k.row(t)[sl.clone()],
                    &r.v.row(t)[sl.clone()],
                    &r.decay.row(t)[sl.clone()],
                    r.beta[t * heads + hh],
                    &mut out,
                );
            }
        }
        true
    }
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        4 * (self.conv.len() + self.s.len())
    }
    /// A copy of the numbers only (no replay log, not recording), to run a throwaway step on.
    pub(crate) fn scratch_copy(&self) -> KdaState {
        KdaState { conv: self.conv.clone(), s: self.s.clone(), record: Recording::Off, replay: None }
    }

    /// Drops what the last forward recorded (it will not be undone).
    pub(crate) fn forget(&mut self) {
        self.replay = None;
    }
}

impl KdaWeights {
    pub fn load(cfg: &K3Config, l: &Loader<'_>) -> Result<KdaWeights> {
        let (h, d, c) = (cfg.hidden_size, cfg.kda_head_dim, cfg.kda_dim());
        let conv = |n: &str| l.f32_tensor(&format!("{n}_conv1d.weight"), &[c, 1, cfg.conv_kernel]);
        let a_log = l.f32_at_least("A_log", cfg.kda_heads)?;
        Ok(KdaWeights {
            q_proj: l.matrix("q_proj.weight", c, h)?,
            k_proj: l.matrix("k_proj.weight", c, h)?,
            v_proj: l.matrix("v_proj.weight", c, h)?,
            conv: [conv("q")?, conv("k")?, conv("v")?],
            f_a: l.matrix("f_a_proj.weight", d, h)?,
            f_b: l.matrix("f_b_proj.weight", c, d)?,
            b_proj: l.matrix("b_proj.weight", cfg.kda_heads, h)?,
            g_proj: l.matrix("g_proj.weight", c, h)?,
            // Per head: the stored tensor holds H values then zero padding.
            a_exp: a_log[..cfg.kda_heads].iter().map(|&a| crate::math::exp(a)).collect(),
            dt_bias: l.f32_tensor("dt_bias", &[c])?,
            o_norm: l.f32_tensor("o_norm.weight", &[d])?,
            o_proj: l.matrix("o_proj.weight", h, c)?,
        })
    }

    /// Runs `x` (the normed attention input, one row per token) through the layer, advancing state.
    pub fn forward(&self, cfg: &K3Config, be: &dyn Backend, x: &Mat, state: &mut KdaState) -> Mat {
        let (heads, d, c, kern) = (cfg.kda_heads, cfg.kda_head_dim, cfg.kda_dim(), cfg.conv_kernel);
        let t_len = x.rows;
        let mut qkv = [be.matmul_bf16(x, &self.q_proj), be.matmul_bf16(x, &self.k_proj), be.matmul_bf16(x, &self.v_proj)];
        let start = match state.record {
            Recording::Off => None,
            Recording::Start => Some((state.conv.clone(), state.s.clone(), [Vec::new(), Vec::new(), Vec::new()])),
            Recording::Full => Some((state.conv.clone(), state.s.clone(), [qkv[0].data.clone(), qkv[1].data.clone(), qkv[2].data.clone()])),
        };
        // Causal depthwise conv over [state ; x], then SiLU; keep the last kernel-1 raw inputs.
        for (i, m) in qkv.iter_mut().enumerate() {
            let st = &mut state.conv[i * (kern - 1) * c..(i + 1) * (kern - 1) * c];
            let mut hist: Vec<f32> = st.to_vec();
            hist.extend_from_slice(&m.data);
            let w = &self.conv[i];
            m.for_each_row(|t, out| {
                for ch in 0..c {
                    let mut acc = 0f32;
                    for j in 0..kern {
                        acc += w[ch * kern + j] * hist[(t + j) * c + ch];
                    }
                    out[ch] = silu(acc);
                }
            });
            st.copy_from_slice(&hist[hist.len() - (kern - 1) * c..]);
        }
        let [mut q, mut k, v] = qkv;
        let scale = crate::math::inv_sqrt_of(d);
        q.for_each_row(|_, row| {
            for qh in row.chunks_exact_mut(d).take(heads) {
                let nq = 1.0 / (be.dot_f32(qh, qh) + 1e-6).sqrt();
                qh.iter_mut().for_each(|v| *v = *v * nq * scale);
            }
        });
        k.for_each_row(|_, row| {
            for kh in row.chunks_exact_mut(d).take(heads) {
                let nk = 1.0 / (be.dot_f32(kh, kh) + 1e-6).sqrt();
                kh.iter_mut().for_each(|v| *v *= nk);
            }
        });
        let a = be.matmul_bf16(&be.matmul_bf16(x, &self.f_a), &self.f_b);
        let lb = cfg.gate_lower_bound;
        let mut decay = Mat::zeros(t_len, c);
        decay.for_each_row(|t, row| {
            for (ch, out) in row.iter_mut().enumerate() {
                let g = lb * sigmoid(self.a_exp[ch / d] * (a.row(t)[ch] + self.dt_bias[ch]));
                *out = crate::math::exp(g);
            }
        });
        let b = be.matmul_bf16(x, &self.b_proj);
        let beta: Vec<f32> = b.data.iter().map(|&v| sigmoid(v)).collect();

        state.replay = start.map(|(conv, s0, raw)| {
            let full = state.record == Recording::Full;
            let keep = |m: &Mat| if full { m.clone() } else { Mat::zeros(0, m.cols) };
            Box::new(KdaReplay {
                conv,
                s: s0,
                tokens: t_len,
                raw,
                q: keep(&q),
                k: keep(&k),
                v: keep(&v),
                decay: keep(&decay),
                beta: if full { beta.clone() } else { Vec::new() },
            })
        });
        // The recurrence, one head per task (heads are independent).
        let mut o = Mat::zeros(t_len, c);
        let outs: Vec<Vec<f32>> = state
            .s
            .par_chunks_mut(d * d)
            .enumerate()
            .map(|(hh, s)| {
                let mut out = vec![0f32; t_len * d];
                for t in 0..t_len {
                    let sl = hh * d..(hh + 1) * d;
                    be.kda_step(
                        s,
                        &q.row(t)[sl.clone()],
                        &k.row(t)[sl.clone()],
                        &v.row(t)[sl.clone()],
                        &decay.row(t)[sl],
                        beta[t * heads + hh],
                        &mut out[t * d..(t + 1) * d],
                    );
                }
                out
            })
            .collect();
        for (hh, out) in outs.iter().enumerate() {
            for t in 0..t_len {
                o.row_mut(t)[hh * d..(hh + 1) * d].copy_from_slice(&out[t * d..(t + 1) * d]);
            }
        }
        let gate = be.matmul_bf16(x, &self.g_proj);
        o.for_each_row(|t, row| {
            for hh in 0..heads {
                be.rms_norm_in_place(&mut row[hh * d..(hh + 1) * d], Some(&self.o_norm), cfg.rms_norm_eps);
            }
            for (v, g) in row.iter_mut().zip(gate.row(t)) {
                *v *= sigmoid(*g);
            }
        });
        be.matmul_bf16(&o, &self.o_proj)
    }
}

/// One delta-rule step for one head: `S <- diag(decay) S; S += beta k (v - S k)^T; o = S q`,
/// with `S` stored `[V][K]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn recurrent_step(isa: Isa, s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], decay: &[f32], beta: f32, o: &mut [f32]) {
    let d = k.len();
    for vi in 0..v.len() {
        let row = &mut s[vi * d..(vi + 1) * d];
        for (x, g) in row.iter_mut().zip(decay) {
            *x *= g;
        }
        let mem = dot_f32(isa, row, k);
        let delta = (v[vi] - mem) * beta;
        for (x, kk) in row.iter_mut().zip(k) {
            *x += kk * delta;
        }
        o[vi] = dot_f32(isa, row, q);
    }
}

/// The chunked (parallel) form of the delta rule for one head over `T` tokens, starting from
/// state `s` (`[V][K]`), returning the outputs `[T][V]` and leaving the final state in `s`.
///
/// Within a chunk, with cumulative decays `G_t = prod_{i<=t} decay_i`, the rule becomes
/// `U = (I + A)^-1 (beta * (V - (k*G) S0))` with strictly lower `A_ti = beta_t (k_t*G_t/G_i).k_i`,
/// then `o_t = (q_t*G_t) S0 + sum_{i<=t} (q_t*G_t/G_i).k_i u_i` and
/// `S' = G_T S0 + sum_i (G_T/G_i) k_i u_i^T`. Exact in real arithmetic; in F32 it agrees with the
/// recurrence to rounding (tested). Chunks must be short enough that `G` does not underflow.
#[allow(clippy::too_many_arguments)]
pub fn chunked_delta_rule(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], decay: &[f32], beta: &[f32], d: usize, chunk: usize) -> Vec<f32> {
    let t_len = beta.len();
    let mut out = vec![0f32; t_len * d];
    let mut start = 0;
    while start < t_len {
        let n = chunk.min(t_len - start);
        let idx = |t: usize, i: usize| (start + t) * d + i;
        // Cumulative decay per key channel.
        let mut g = vec![0f32; n * d];
        for t in 0..n {
            for i in 0..d {
                let prev = if t == 0 { 1.0 } else { g[(t - 1) * d + i] };
                g[t * d + i] = prev * decay[idx(t, i)];
            }
        }
        // S0 k~_t with k~ = k * G  ([V] per t), and the right-hand side.
        let mut u = vec![0f32; n * d];
        for t in 0..n {
            for vi in 0..d {
                let mut acc = 0f32;
                for i in 0..d {
                    acc += s[vi * d + i] * k[idx(t, i)] * g[t * d + i];
                }
                u[t * d + vi] = beta[start + t] * (v[idx(t, vi)] - acc);
            }
        }
        // Forward substitution with A_tj = beta_t sum_i k_t,i G_t,i / G_j,i k_j,i.
        for t in 0..n {
            for j in 0..t {
                let mut a = 0f32;
                for i in 0..d {
                    a += k[idx(t, i)] * g[t * d + i] / g[j * d + i] * k[idx(j, i)];
                }
                a *= beta[start + t];
                for vi in 0..d {
                    u[t * d + vi] -= a * u[j * d + vi];
                }
            }
        }
        for t in 0..n {
            for vi in 0..d {
                let mut acc = 0f32;
                for i in 0..d {
                    acc += s[vi * d + i] * q[idx(t, i)] * g[t * d + i];
                }
                for j in 0..=t {
                    let mut w = 0f32;
                    for i in 0..d {
                        w += q[idx(t, i)] * g[t * d + i] / g[j * d + i] * k[idx(j, i)];
                    }
                    acc += w * u[j * d + vi];
                }
                out[(start + t) * d + vi] = acc;
            }
        }
        let last = (n - 1) * d;
        for vi in 0..d {
            for i in 0..d {
                let mut acc = g[last + i] * s[vi * d + i];
                for j in 0..n {
                    acc += g[last + i] / g[j * d + i] * k[idx(j, i)] * u[j * d + vi];
                }
                s[vi * d + i] = acc;
            }
        }
        start += n;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_form_equals_recurrent_form() {
        let (d, t_len) = (16usize, 37usize);
        let mut x = 12345u64;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 10000) as f32 / 10000.0
        };
        let mut unit_rows = |scale: f32| -> Vec<f32> {
            let mut v: Vec<f32> = (0..t_len * d).map(|_| rnd() - 0.5).collect();
            for r in v.chunks_mut(d) {
                let n = r.iter().map(|a| a * a).sum::<f32>().sqrt();
                r.iter_mut().for_each(|a| *a *= scale / n);
            }
            v
        };
        let q = unit_rows(0.25);
        let k = unit_rows(1.0);
        let v: Vec<f32> = (0..t_len * d).map(|_| rnd() - 0.5).collect();
        let decay: Vec<f32> = (0..t_len * d).map(|_| 0.6 + 0.4 * rnd()).collect();
        let beta: Vec<f32> = (0..t_len).map(|_| rnd()).collect();
        let s0: Vec<f32> = (0..d * d).map(|_| 0.1 * (rnd() - 0.5)).collect();
        let mut s_rec = s0.clone();
        let mut o_rec = vec![0f32; t_len * d];
        for t in 0..t_len {
            let r = t * d..(t + 1) * d;
            recurrent_step(Isa::SCALAR, &mut s_rec, &q[r.clone()], &k[r.clone()], &v[r.clone()], &decay[r.clone()], beta[t], &mut o_rec[r]);
        }
        for chunk in [1, 4, 8, 64] {
            let mut s = s0.clone();
            let o = chunked_delta_rule(&mut s, &q, &k, &v, &decay, &beta, d, chunk);
            let worst_o = o.iter().zip(&o_rec).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            let worst_s = s.iter().zip(&s_rec).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst_o < 1e-4 && worst_s < 1e-4, "chunk {chunk}: outputs differ by {worst_o}, state by {worst_s}");
        }
    }
}
