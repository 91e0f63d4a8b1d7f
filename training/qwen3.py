"""A PyTorch Qwen3 (the draft architecture of the speculative decoding issue), Hugging Face names.

Grouped-query attention with per-head RMS norms on queries and keys, rotary positions on each
head's two halves, a SwiGLU MLP and tied embeddings, as `Qwen3ForCausalLM`.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from k3 import RMSNorm, linear


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, hd = c["hidden"], c["head_dim"]
        self.nh, self.nkv, self.hd = c["heads"], c["kv_heads"], hd
        self.q_proj = linear(self.nh * hd, h)
        self.k_proj = linear(self.nkv * hd, h)
        self.v_proj = linear(self.nkv * hd, h)
        self.o_proj = linear(h, self.nh * hd)
        self.q_norm = RMSNorm(hd, 1e-6)
        self.k_norm = RMSNorm(hd, 1e-6)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, t, self.nh, self.hd))
        k = self.k_norm(self.k_proj(x).reshape(b, t, self.nkv, self.hd))
        v = self.v_proj(x).reshape(b, t, self.nkv, self.hd)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.nh * self.hd))


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden"], 1e-6)
        self.post_attention_layernorm = RMSNorm(c["hidden"], 1e-6)
        self.self_attn = Attention(c)
        self.mlp = nn.Module()
        self.mlp.gate_proj = linear(c["inter"], c["hidden"])
        self.mlp.up_proj = linear(c["inter"], c["hidden"])
        self.mlp.down_proj = linear(c["hidden"], c["inter"])


class Qwen3(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c["vocab"], c["hidden"])
        nn.init.normal_(self.model.embed_tokens.weight, std=0.02)
        self.model.layers = nn.ModuleList([Layer(c) for _ in range(c["layers"])])
        self.model.norm = RMSNorm(c["hidden"], 1e-6)
        hd = c["head_dim"]
        inv = c["rope_theta"] ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, ids):
        b, t = ids.shape
        pos = torch.arange(t, device=ids.device, dtype=torch.float64)
        ang = pos[:, None] * self.inv_freq[None, :]
        cos, sin = ang.cos().float()[None, :, None, :], ang.sin().float()[None, :, None, :]
        x = self.model.embed_tokens(ids).float()
        for layer in self.model.layers:
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin).float()
            h = layer.post_attention_layernorm(x)
            m = layer.mlp
            x = x + m.down_proj(F.silu(m.gate_proj(h).float()) * m.up_proj(h).float()).float()
        h = self.model.norm(x)
        return (h @ self.model.embed_tokens.weight.t().to(h.dtype)).float()


def release_tensors(model):
    """Hugging Face names, BF16 (tied embeddings: no `lm_head.weight`)."""
    return {n: t.detach().cpu().to(torch.bfloat16).contiguous() for n, t in model.state_dict().items()}


@torch.no_grad()
def as_exported(model):
    for p in model.parameters():
        p.copy_(p.to(torch.bfloat16).float())
