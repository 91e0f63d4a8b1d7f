"""A PyTorch Kimi K3 for training the tiny trained model (issue 20).

A third, independent K3 implementation, written from ../shared/K3.md: KDA (gated delta rule with
per-channel decay, short convolutions, per-head A_log), gated NoPE MLA, Block Attention-Residuals,
the sigmoid router with bias-corrected top-k and auxiliary-free balancing, the latent MoE with a
shared expert, and SiTU. Experts are quantization-aware: with `qat` on, their forward uses the
MXFP4 values they will be exported as (straight-through gradients), so the exported checkpoint is
the model that was trained.

Parameter names are K3's release names (without `language_model.`), so export is a rename-free
walk over `state_dict()`. Activations are fp32; on a GPU the large matrix products may run under
bf16 autocast while the KDA recurrence always runs in fp32.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

# E2M1 magnitudes by code (bit 3 is the sign).
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# Midpoints between neighbouring magnitudes: a magnitude rounds to the code above a midpoint
# it exceeds (ties go down, to the smaller magnitude).
E2M1_MID = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def mxfp4_codes(w):
    """MXFP4 of `w` [rows, cols]: (codes uint8 [rows, cols], scale bytes uint8 [rows, cols/32]).

    Each group of 32 along a row shares a power-of-two scale 2^e chosen so its largest magnitude
    fits in E2M1's range without clipping (e = ceil(log2(amax / 6))).
    """
    rows, cols = w.shape
    g = w.detach().float().reshape(rows, cols // 32, 32)
    amax = g.abs().amax(-1, keepdim=True).clamp(min=2.0**-120)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = (g / torch.exp2(e)).abs().clamp(max=6.0)
    idx = torch.bucketize(scaled, E2M1_MID.to(w.device), right=False)
    sign = ((g < 0) & (idx > 0)).to(torch.uint8) << 3
    codes = (idx.to(torch.uint8) | sign).reshape(rows, cols)
    scale = (e.squeeze(-1) + 127).to(torch.uint8)
    return codes, scale


def mxfp4_values(codes, scale):
    """The float32 values MXFP4 `codes` [rows, cols] and `scale` [rows, cols/32] stand for."""
    rows, cols = codes.shape
    mag = E2M1.to(codes.device)[(codes & 7).long()]
    val = torch.where((codes & 8) > 0, -mag, mag).reshape(rows, cols // 32, 32)
    return (val * torch.exp2(scale.float() - 127).unsqueeze(-1)).reshape(rows, cols)


def mxfp4_pack(codes):
    """Two codes per byte, the even column in the low nibble (K3's `weight_packed`)."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def fake_mxfp4(w):
    """`w` [experts, rows, cols] as MXFP4 in the forward, identity in the backward."""
    e, r, c = w.shape
    codes, scale = mxfp4_codes(w.reshape(e * r, c))
    q = mxfp4_values(codes, scale).reshape(e, r, c).to(w.dtype)
    return w + (q - w).detach()


def situ(g, u):
    """SiTU: 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25)."""
    return 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * 25.0 * torch.tanh(u / 25.0)


def rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return rms(x.float(), self.eps) * self.weight


def linear(out, inp):
    lin = nn.Linear(inp, out, bias=False)
    nn.init.normal_(lin.weight, std=inp**-0.5)
    return lin


class Kda(nn.Module):
    """Kimi Delta Attention: S <- diag(exp g) S; S += beta k (v - S k)^T; o = S q, per head."""

    def __init__(self, c):
        super().__init__()
        h, heads, d = c["hidden"], c["kda_heads"], c["kda_dim"]
        ch = heads * d
        self.heads, self.d, self.lb, self.eps = heads, d, -5.0, 1e-5
        for n in "qkv":
            setattr(self, f"{n}_proj", linear(ch, h))
            conv = nn.Parameter(torch.zeros(ch, 1, 4))
            with torch.no_grad():
                conv[:, 0, 3] = 1.0
                conv.add_(torch.randn_like(conv) * 0.1)
            setattr(self, f"{n}_conv1d", nn.Module())
            getattr(self, f"{n}_conv1d").weight = conv
        self.f_a_proj = linear(d, h)
        self.f_b_proj = linear(ch, d)
        self.b_proj = linear(heads, h)
        self.g_proj = linear(ch, h)
        a = torch.zeros(max(d, heads))
        a[:heads] = torch.log(torch.linspace(1.0, 16.0, heads))
        self.A_log = nn.Parameter(a)
        self.dt_bias = nn.Parameter(torch.zeros(ch))
        self.o_norm = RMSNorm(d, self.eps)
        self.o_proj = linear(h, ch)
        self.chunked = True

    def forward(self, x):
        b, t, _ = x.shape
        heads, d = self.heads, self.d

        def conv(name):
            y = getattr(self, f"{name}_proj")(x).float().transpose(1, 2)
            w = getattr(self, f"{name}_conv1d").weight
            with torch.autocast(device_type=x.device.type, enabled=False):
                y = F.silu(F.conv1d(F.pad(y, (3, 0)), w.float(), groups=w.shape[0]))
            return y.transpose(1, 2).reshape(b, t, heads, d)

        q, k, v = conv("q"), conv("k"), conv("v")
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * d**-0.5
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        a = self.f_b_proj(self.f_a_proj(x)).float().reshape(b, t, heads, d)
        a_exp = torch.exp(self.A_log[:heads]).reshape(1, 1, heads, 1)
        decay = torch.exp(self.lb * torch.sigmoid(a_exp * (a + self.dt_bias.reshape(heads, d))))
        beta = torch.sigmoid(self.b_proj(x).float())
        with torch.autocast(device_type=x.device.type, enabled=False):
            if self.chunked and t % CHUNK == 0:
                o = chunked_delta_rule(q, k, v.float(), decay.log(), beta)
            else:
                o = recurrent_delta_rule(q, k, v.float(), decay, beta)
        o = self.o_norm(o).reshape(b, t, heads * d) * torch.sigmoid(self.g_proj(x).float())
        return self.o_proj(o)


def recurrent_delta_rule(q, k, v, decay, beta):
    """The engine's recurrence, token by token: q, k, v, decay [B, T, H, D], beta [B, T, H]."""
    b, t, heads, d = q.shape
    s = q.new_zeros(b, heads, d, d)  # [V][K] per head
    outs = []
    for i in range(t):
        s = s * decay[:, i].unsqueeze(2)
        ki = k[:, i]
        mem = (s @ ki.unsqueeze(-1)).squeeze(-1)
        delta = (v[:, i] - mem) * beta[:, i].unsqueeze(-1)
        s = s + delta.unsqueeze(-1) * ki.unsqueeze(2)
        outs.append((s @ q[:, i].unsqueeze(-1)).squeeze(-1))
    return torch.stack(outs, 1)


# Tokens per chunk of the chunked form. With the gate's lower bound of -5 a chunk's cumulative
# log decay stays above -80, so exp(-G) below fits in float32 (exp(88) would not).
CHUNK = 16


def chunked_delta_rule(q, k, v, g, beta):
    """The same recurrence, chunk-parallel (training speed): one sequential step per CHUNK tokens.

    With S in [K][V] form, S_t = diag(a_t) S_{t-1} + b_t k_t (v_t - k_t^T diag(a_t) S_{t-1})^T.
    Inside a chunk, with G_t the cumulative log decay since its start, S_t = D_t (S_0 + sum_{j<=t}
    k^_j u_j^T) where D_t = diag(exp G_t), k^_j = exp(-G_j) k_j and the pseudo-values solve the
    unit lower-triangular system u_t = b_t (v_t - S_0^T k~_t - sum_{j<t} (k~_t . k^_j) u_j),
    k~_t = exp(G_t) k_t. Outputs o_t = S_0^T q~_t + sum_{j<=t} (q~_t . k^_j) u_j.
    """
    b, t, heads, d = q.shape
    n = t // CHUNK

    def chunks(x):  # [B, T, H, ...] -> [B, H, N, C, ...]
        return x.reshape(b, n, CHUNK, heads, *x.shape[3:]).transpose(1, 3).transpose(2, 3)

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    gc = g.cumsum(-2)
    kt, qt, kh = k * gc.exp(), q * gc.exp(), k * (-gc).exp()
    kbar = k * (gc[..., -1:, :] - gc).exp()  # exp(G_C - G_j) k_j: to the chunk's end
    lower = torch.tril(torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device), -1)
    a = (kt @ kh.transpose(-1, -2)).masked_fill(~lower, 0.0) * beta.unsqueeze(-1)
    eye = torch.eye(CHUNK, device=q.device, dtype=q.dtype)
    bk = torch.linalg.solve_triangular(a + eye, beta.unsqueeze(-1) * kt, upper=False, unitriangular=True)
    bv = torch.linalg.solve_triangular(a + eye, beta.unsqueeze(-1) * v, upper=False, unitriangular=True)
    m = (qt @ kh.transpose(-1, -2)).masked_fill(~torch.tril(torch.ones_like(lower)), 0.0)
    s = q.new_zeros(b, heads, d, d)  # [K][V]
    outs = []
    for i in range(n):
        u = bv[:, :, i] - bk[:, :, i] @ s
        outs.append(qt[:, :, i] @ s + m[:, :, i] @ u)
        s = gc[:, :, i, -1].exp().unsqueeze(-1) * s + kbar[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(outs, 2)  # [B, H, N, C, V]
    return o.permute(0, 2, 3, 1, 4).reshape(b, t, heads, d)


class Mla(nn.Module):
    """Gated NoPE multi-head latent attention (no rotary anywhere; k_pe shared by all heads)."""

    def __init__(self, c):
        super().__init__()
        h, n = c["hidden"], c["mla_heads"]
        self.n, self.nope, self.rope, self.v, self.lora = n, c["nope"], c["rope"], c["v_dim"], c["kv_lora"]
        self.q_a_proj = linear(c["q_lora"], h)
        self.q_a_layernorm = RMSNorm(c["q_lora"], 1e-6)
        self.q_b_proj = linear(n * (self.nope + self.rope), c["q_lora"])
        self.kv_a_proj_with_mqa = linear(self.lora + self.rope, h)
        self.kv_a_layernorm = RMSNorm(self.lora, 1e-6)
        self.kv_b_proj = linear(n * (self.nope + self.v), self.lora)
        self.o_proj = linear(h, n * self.v)
        self.g_proj = linear(n * self.v, h)

    def forward(self, x):
        b, t, _ = x.shape
        n, nope, rope = self.n, self.nope, self.rope
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).reshape(b, t, n, nope + rope)
        kv = self.kv_a_proj_with_mqa(x)
        lat, k_pe = kv[..., : self.lora], kv[..., self.lora :]
        kvb = self.kv_b_proj(self.kv_a_layernorm(lat)).reshape(b, t, n, nope + self.v)
        k = torch.cat([kvb[..., :nope], k_pe.unsqueeze(2).expand(b, t, n, rope)], -1)
        vals = kvb[..., nope:]
        q, k, vals = (z.transpose(1, 2) for z in (q, k, vals))
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), vals.to(q.dtype), is_causal=True, scale=(nope + rope) ** -0.5)
        o = o.transpose(1, 2).reshape(b, t, n * self.v).float() * torch.sigmoid(self.g_proj(x).float())
        return self.o_proj(o)


class GluMlp(nn.Module):
    """SiTU-GLU MLP (layer 0's dense MLP and the shared experts)."""

    def __init__(self, h, inter):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = linear(inter, h), linear(inter, h), linear(h, inter)

    def forward(self, x):
        return self.down_proj(situ(self.gate_proj(x).float(), self.up_proj(x).float()))


class Router(nn.Module):
    def __init__(self, h, experts):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, h) * h**-0.5)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts), requires_grad=False)


class Experts(nn.Module):
    """All routed experts of a layer as three stacked weights (named per expert on export)."""

    def __init__(self, e, inter, latent):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(e, inter, latent) * latent**-0.5)
        self.w3 = nn.Parameter(torch.randn(e, inter, latent) * latent**-0.5)
        self.w2 = nn.Parameter(torch.randn(e, latent, inter) * inter**-0.5)


class LatentMoe(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, e = c["hidden"], c["experts"]
        self.top_k = c["top_k"]
        self.gate = Router(h, e)
        self.routed_expert_down_proj = linear(c["latent"], h)
        self.routed_expert_norm = RMSNorm(c["latent"], 1e-5)
        self.routed_expert_up_proj = linear(h, c["latent"])
        self.experts = Experts(e, c["moe_inter"], c["latent"])
        self.shared_experts = GluMlp(h, c["moe_inter"] * c["shared"])
        self.qat = False
        self.last_load = None

    def routes(self, x):
        """(chosen expert ids [N, k], their weights [N, k]) for rows `x` [N, h]."""
        with torch.autocast(device_type=x.device.type, enabled=False):  # the router is fp32
            s = torch.sigmoid(x.float() @ self.gate.weight.float().t())
        chosen = torch.topk(s + self.gate.e_score_correction_bias, self.top_k, dim=-1).indices
        w = s.gather(-1, chosen)
        return chosen, w / (w.sum(-1, keepdim=True) + 1e-20)

    def forward(self, x):
        b, t, h = x.shape
        rows = x.reshape(b * t, h)
        chosen, w = self.routes(rows)
        self.last_load = torch.bincount(chosen.flatten(), minlength=self.gate.weight.shape[0])
        dense = torch.zeros(b * t, self.gate.weight.shape[0], device=x.device, dtype=torch.float32)
        dense.scatter_(1, chosen, w)
        z = self.routed_expert_down_proj(rows)
        w1, w2, w3 = self.experts.w1, self.experts.w2, self.experts.w3
        if self.qat:
            w1, w2, w3 = fake_mxfp4(w1), fake_mxfp4(w2), fake_mxfp4(w3)
        # Every expert on every row, weighted by the (mostly zero) route weights: simple and fast
        # at this size on a GPU.
        g = torch.einsum("nl,eil->eni", z, w1.to(z.dtype)).float()
        u = torch.einsum("nl,eil->eni", z, w3.to(z.dtype)).float()
        a = situ(g, u) * dense.t().unsqueeze(-1)
        y = torch.einsum("eni,eli->nl", a.to(z.dtype), w2.to(z.dtype)).float()
        y = self.routed_expert_up_proj(self.routed_expert_norm(y))
        return (y + self.shared_experts(rows)).reshape(b, t, h)


class ResMix(nn.Module):
    """One Block Attention-Residuals mix: softmax over candidates of dot(rmsnorm(v), w_norm*w_proj)."""

    def __init__(self, h, eps):
        super().__init__()
        self.norm = RMSNorm(h, eps)
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.zeros(1, h))
        self.eps = eps

    def forward(self, cands):
        v = torch.stack(cands, 0).float()  # [C, B, T, h]
        w = (self.norm.weight * self.proj.weight[0]).float()
        score = (rms(v, self.eps) * w).sum(-1)
        p = torch.softmax(score, 0).unsqueeze(-1)
        return (p * v).sum(0)


class Layer(nn.Module):
    def __init__(self, c, idx):
        super().__init__()
        h, eps = c["hidden"], 1e-5
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.self_attention_res = ResMix(h, eps)
        self.mlp_res = ResMix(h, eps)
        self.self_attn = Mla(c) if (idx + 1) in c["mla_layers"] else Kda(c)
        if idx == 0:
            self.mlp = GluMlp(h, c["dense_inter"])
        else:
            self.block_sparse_moe = LatentMoe(c)
        self.block_start = idx % c["block"] == 0


class K3(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.vocab = c["bpe_ranks"] + 256
        h = c["hidden"]
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(self.vocab, h)
        nn.init.normal_(self.model.embed_tokens.weight, std=1.0)
        self.model.layers = nn.ModuleList([Layer(c, i) for i in range(c["layers"])])
        self.model.norm = RMSNorm(h, 1e-5)
        self.model.output_attn_res = ResMix(h, 1e-5)
        self.lm_head = linear(self.vocab, h)

    def moe_layers(self):
        return [l.block_sparse_moe for l in self.model.layers if hasattr(l, "block_sparse_moe")]

    def set_chunked(self, on):
        """Chunk-parallel KDA (training) or the token-by-token recurrence (reference logits)."""
        for layer in self.model.layers:
            if isinstance(layer.self_attn, Kda):
                layer.self_attn.chunked = on

    def set_qat(self, on):
        for m in self.moe_layers():
            m.qat = on

    def forward(self, ids, hidden_after=None):
        x = self.model.embed_tokens(ids).float()
        anchors, p = [], x
        for layer in self.model.layers:
            h = layer.self_attention_res(anchors + [p]) if anchors else p
            y = layer.self_attn(layer.input_layernorm(h)).float()
            if layer.block_start:
                anchors.append(p)
                p = y
            else:
                p = p + y
            m = layer.post_attention_layernorm(layer.mlp_res(anchors + [p]))
            mlp = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe
            p = p + mlp(m).float()
        out = self.model.output_attn_res(anchors + [p])
        return self.lm_head(self.model.norm(out)).float()


# Checkpoint dtypes: these stay F32 in the release; experts are MXFP4; the rest is BF16.
F32_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")


def release_tensors(model):
    """Every tensor under K3's release name, in its release dtype (BF16 / F32 / U8 MXFP4)."""
    out = {}
    for name, t in model.state_dict().items():
        name = name.replace("self_attention_res.norm.", "self_attention_res_norm.")
        name = name.replace("self_attention_res.proj.", "self_attention_res_proj.")
        name = name.replace("mlp_res.norm.", "mlp_res_norm.").replace("mlp_res.proj.", "mlp_res_proj.")
        name = name.replace("output_attn_res.norm.", "output_attn_res_norm.").replace("output_attn_res.proj.", "output_attn_res_proj.")
        t = t.detach().cpu()
        if ".experts.w" in name:
            base, w = name.rsplit(".", 1)
            for e in range(t.shape[0]):
                codes, scale = mxfp4_codes(t[e].float())
                out[f"language_model.{base}.{e}.{w}.weight_packed"] = mxfp4_pack(codes).contiguous()
                out[f"language_model.{base}.{e}.{w}.weight_scale"] = scale.contiguous()
            continue
        if name.endswith(F32_SUFFIXES):
            out[f"language_model.{name}"] = t.float().contiguous()
        else:
            out[f"language_model.{name}"] = t.to(torch.bfloat16).contiguous()
    return out


@torch.no_grad()
def as_exported(model):
    """Sets every weight to the value the release stores (BF16 rounding, MXFP4 experts), so the
    fp32 forward is the exported checkpoint's forward."""
    for name, p in model.named_parameters():
        if ".experts.w" in name:
            e, r, c = p.shape
            codes, scale = mxfp4_codes(p.reshape(e * r, c))
            p.copy_(mxfp4_values(codes, scale).reshape(e, r, c))
        elif not name.endswith(F32_SUFFIXES):
            p.copy_(p.to(torch.bfloat16).float())
    model.set_qat(False)


def param_count(model):
    return sum(p.numel() for p in model.parameters())


def check_shapes(c):
    for key in ("latent", "moe_inter"):
        if c[key] % 32:
            raise ValueError(f"{key} = {c[key]} must be a multiple of 32 (MXFP4 groups)")
