"""An independent float64 Kimi K3.1 (issue 52), for the engine's sparse attention to be checked against.

Written from the formulation in the K3.1 issue and ../shared/K3.md, not from the engine's code:
numpy in float64, keys and values expanded per head (the engine absorbs them into latent space),
every sum in numpy's own order. It runs a K3.1 checkpoint whose layers are all MLA with dense MLPs
(`cargo xtask gen-k3 --preset k31-ref`), so no KDA or experts are needed to check the indexer:

    qr     = q_a_layernorm(q_a_proj(x))
    iq     = wq_b(qr) as heads x head_dim          (no rotary part)
    ik_s   = LayerNorm(wk(x_s)) with bias, eps = rms_norm_eps
    w      = weights_proj(x) * heads^-0.5 * head_dim^-0.5
    I[t,s] = sum_h w[h] * relu(iq[h] . ik_s),  s <= t
    query t attends to the index_topk keys of highest I[t, .] (all while t < index_topk)

It also writes test vectors for `--indexer fp8` (F32 values as their bit patterns): a transcription of vLLM's / DeepSeek-V3.2's
activation quantization (`act_quant` with a UE8M0 scale: amax over a 128-wide block floored at
1e-4, times float32(1/448), rounded up to a power of two; values divided by it, clamped to +-448
and cast to E4M3 round-to-nearest-even; the key rounded to BF16 before) and of `fp8_index`
(relu of each head's dot, weighted by weights_proj * heads^-0.5 * q_scale * head_dim^-0.5,
summed over heads, times the key's scale). E4M3 rounding here is by nearest table entry, not the
engine's bit arithmetic.

Usage:
    cargo xtask gen-k3 --preset k31-ref --seed 7 --out /tmp/k31-ref
    python3 xtask/oracle/k31_reference.py /tmp/k31-ref tests/fixtures/k31
Needs numpy only. Writes reference.json, reference.safetensors and fp8_vectors.json.
"""

import json
import os
import struct
import sys

import numpy as np

SEQ_LEN = 56
SEED = 7


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        raw = data[a:b]
        if meta["dtype"] == "BF16":
            v = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif meta["dtype"] == "F32":
            v = np.frombuffer(raw, dtype="<f4")
        else:
            continue
        out[name] = v.astype(np.float64).reshape(meta["shape"])
    return out


def load(folder):
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    weights = {}
    for shard in sorted(set(index["weight_map"].values())):
        weights.update(read_safetensors(os.path.join(folder, shard)))
    return json.load(open(os.path.join(folder, "config.json"))), weights


def rmsnorm(x, w, eps):
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if w is None else y * w


def layernorm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    d = x - mu
    return d / np.sqrt((d * d).mean(-1, keepdims=True) + eps) * w + b


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def situ(g, u):
    return 4.0 * np.tanh(g / 4.0) * sigmoid(g) * 25.0 * np.tanh(u / 25.0)


def mix(anchors, partial, w_norm, w_proj, eps):
    """Block Attention-Residual mix of anchors + [partial] (raw values weighted)."""
    if not anchors:
        return partial
    cands = np.stack(anchors + [partial])  # [c, T, H]
    logits = (rmsnorm(cands, None, eps) * (w_norm * w_proj[0])).sum(-1)  # [c, T]
    p = softmax(logits.T)  # [T, c]
    return np.einsum("tc,cth->th", p, cands)


def top_keys(scores, k):
    """The k best positions, ties to the earlier, in position order; with the gap at the cut."""
    n = len(scores)
    if n <= k:
        return list(range(n)), float("inf")
    order = sorted(range(n), key=lambda s: (-scores[s], s))
    return sorted(order[:k]), float(scores[order[k - 1]] - scores[order[k]])


def forward(cfg, w, ids):
    tc = cfg["text_config"]
    dsa = tc["dsa_config"]
    eps = tc["rms_norm_eps"]
    m = "language_model.model."
    heads, nope, rope, vd = tc["num_attention_heads"], tc["qk_nope_head_dim"], tc["qk_rope_head_dim"], tc["v_head_dim"]
    lora = tc["kv_lora_rank"]
    ih, idim, topk = dsa["index_num_heads"], dsa["index_head_dim"], dsa["index_topk"]
    assert dsa["index_rope_dim"] == 0 and tc["first_k_dense_replace"] >= tc["num_hidden_layers"]
    T = len(ids)
    x0 = w[m + "embed_tokens.weight"][ids]
    anchors, partial = [], x0
    selections, margins = [], []
    for l in range(tc["num_hidden_layers"]):
        p = f"{m}layers.{l}."
        a = p + "self_attn."
        assert l + 1 in tc["linear_attn_config"]["full_attn_layers"]
        h = mix(anchors, partial, w[p + "self_attention_res_norm.weight"], w[p + "self_attention_res_proj.weight"], eps)
        x = rmsnorm(h, w[p + "input_layernorm.weight"], eps)
        # MLA, keys and values expanded per head.
        qr = rmsnorm(x @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], 1e-6)
        q = (qr @ w[a + "q_b_proj.weight"].T).reshape(T, heads, nope + rope)
        kv = x @ w[a + "kv_a_proj_with_mqa.weight"].T
        lat = rmsnorm(kv[:, :lora], w[a + "kv_a_layernorm.weight"], 1e-6)
        k_pe = kv[:, lora:]
        kvb = (lat @ w[a + "kv_b_proj.weight"].T).reshape(T, heads, nope + vd)
        k_nope, v = kvb[:, :, :nope], kvb[:, :, nope:]
        # The indexer.
        ix = a + "indexer."
        iq = (qr @ w[ix + "wq_b.weight"].T).reshape(T, ih, idim)
        ik = layernorm(x @ w[ix + "wk.weight"].T, w[ix + "k_norm.weight"], w[ix + "k_norm.bias"], eps)
        iw = (x @ w[ix + "weights_proj.weight"].T) * ih**-0.5 * idim**-0.5
        out = np.zeros((T, heads, vd))
        layer_sel, layer_margin = [], []
        for t in range(T):
            index = (np.maximum(iq[t] @ ik[: t + 1].T, 0.0) * iw[t][:, None]).sum(0)  # [t+1]
            keys, margin = top_keys(index, topk)
            layer_sel.append(keys)
            layer_margin.append(margin if margin != float("inf") else -1.0)
            for hd in range(heads):
                s = (q[t, hd, :nope] @ k_nope[keys, hd].T + q[t, hd, nope:] @ k_pe[keys].T) * (nope + rope) ** -0.5
                out[t, hd] = softmax(s) @ v[keys, hd]
        selections.append(layer_sel)
        margins.append(layer_margin)
        attn = out.reshape(T, heads * vd) * sigmoid(x @ w[a + "g_proj.weight"].T)
        y = attn @ w[a + "o_proj.weight"].T
        if l % tc["attn_res_block_size"] == 0:
            anchors.append(partial)
            partial = y
        else:
            partial = partial + y
        hm = mix(anchors, partial, w[p + "mlp_res_norm.weight"], w[p + "mlp_res_proj.weight"], eps)
        xm = rmsnorm(hm, w[p + "post_attention_layernorm.weight"], eps)
        mp = p + "mlp."
        u = situ(xm @ w[mp + "gate_proj.weight"].T, xm @ w[mp + "up_proj.weight"].T)
        partial = partial + u @ w[mp + "down_proj.weight"].T
    hf = mix(anchors, partial, w[m + "output_attn_res_norm.weight"], w[m + "output_attn_res_proj.weight"], eps)
    logits = rmsnorm(hf, w[m + "norm.weight"], eps) @ w["language_model.lm_head.weight"].T
    return logits, selections, margins


# ---- fp8 (vLLM's rounding), transcribed ----

E4M3 = np.array(sorted({s * m * 2.0**e for s in (1,) for e in range(-6, 9) for m in [1 + i / 8 for i in range(8)]} | {i * 2.0**-9 for i in range(8)}))
E4M3 = E4M3[E4M3 <= 448.0]


def e4m3(v):
    """Nearest E4M3 value of each entry (|v| <= 448), ties to the even mantissa."""
    a = np.abs(v)
    i = np.searchsorted(E4M3, a)
    lo, hi = E4M3[np.maximum(i - 1, 0)], E4M3[np.minimum(i, len(E4M3) - 1)]
    pick_hi = (hi - a) < (a - lo)
    tie = (hi - a) == (a - lo)
    # Even mantissa: the table's index parity is the last mantissa bit within a binade.
    hi_even = (np.minimum(i, len(E4M3) - 1) % 2) == 0
    pick_hi = pick_hi | (tie & hi_even)
    return np.sign(v) * np.where(pick_hi, hi, lo)


def ue8m0(amax):
    s = np.float32(max(float(amax), 1e-4)) * np.float32(1.0 / 448.0)
    mant, exp = np.frexp(np.float64(s))
    return np.float32(2.0 ** (exp - 1 if mant == 0.5 else exp))


def act_quant(block):
    block = block.astype(np.float32)
    scale = ue8m0(np.abs(block).max())
    q = e4m3(np.clip(block.astype(np.float64) / np.float64(scale), -448.0, 448.0))
    return q.astype(np.float32), scale


def bf16(x):
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return r.astype(np.uint32).view(np.float32)


def fp8_vectors(rng):
    cases = []
    for heads, dim, n, topk in [(4, 16, 40, 16), (8, 128, 120, 64), (2, 32, 17, 16)]:
        q = (rng.standard_normal((heads, dim)) * rng.choice([1e-3, 1.0, 300.0])).astype(np.float32)
        keys = (rng.standard_normal((n, dim)) * rng.choice([0.5, 3.0])).astype(np.float32)
        wp = rng.standard_normal(heads).astype(np.float32)
        qq, qs = zip(*(act_quant(q[h]) for h in range(heads)))
        kq, ks = zip(*(act_quant(bf16(keys[s])) for s in range(n)))
        wq = [np.float32(np.float32(np.float32(wp[h] * np.float32(heads**-0.5)) * qs[h]) * np.float32(dim**-0.5)) for h in range(heads)]
        scores = [
            sum(max(float(np.dot(qq[h].astype(np.float64), kq[s].astype(np.float64))), 0.0) * float(wq[h]) for h in range(heads)) * float(ks[s])
            for s in range(n)
        ]
        sel, margin = top_keys(np.array(scores), topk)
        bits = lambda a: [int(b) for b in np.asarray(a, dtype=np.float32).ravel().view(np.uint32)]
        cases.append({
            "heads": heads, "head_dim": dim, "topk": topk,
            "q": bits(q), "keys": bits(keys), "weights_proj": bits(wp),
            "q_e4m3": bits(np.concatenate(qq)), "q_scales": bits(qs),
            "k_e4m3": bits(np.concatenate(kq)), "k_scales": bits(ks),
            "head_weights": bits(wq),
            "selected": sel, "margin": margin,
        })
    return cases


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        raw = a.astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def main():
    folder, out = sys.argv[1], sys.argv[2]
    cfg, w = load(folder)
    rng = np.random.default_rng(SEED)
    vocab = cfg["text_config"]["vocab_size"] - 256
    ids = [int(i) for i in rng.integers(0, vocab, SEQ_LEN)]
    logits, selections, margins = forward(cfg, w, ids)
    os.makedirs(out, exist_ok=True)
    write_safetensors(os.path.join(out, "reference.safetensors"), {"logits": logits})
    json.dump({"config": cfg, "ids": ids, "selections": selections, "margins": margins}, open(os.path.join(out, "reference.json"), "w"))
    json.dump({"cases": fp8_vectors(rng)}, open(os.path.join(out, "fp8_vectors.json"), "w"))
    print(f"wrote {out}: {SEQ_LEN} tokens, {len(selections)} layers, logits {logits.shape}")


if __name__ == "__main__":
    main()
