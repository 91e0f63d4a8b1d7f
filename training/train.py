"""Trains the tiny K3 or its Qwen3 draft on the tokenized corpus and writes what export needs.

    python3 training/train.py --model k3|draft --tokens DIR --out DIR [--steps N] [--batch B]

`DIR` (from `cargo xtask tokenize-corpus`) holds `lit.bin` and `tech.bin`, uint16 token ids. The
last 1% of each is held out for perplexity. Writes into `--out`:
  `{model}-NN.safetensors`  every tensor under its release name and dtype, in parts of <= 15 MiB
  `{model}-reference.safetensors`  fp32 logits of the exported weights on a held-out prompt and
                            its greedy continuation (`logits` [T, vocab], `token_ids` [T])
  `{model}-report.json`     shape, steps, loss curve, held-out perplexity, routing skew
Deterministic for a seed on one machine; runs on CUDA when present (bf16 autocast for the large
matrix products), else on the CPU.
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k3  # noqa: E402
import qwen3  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

# The tiny trained K3: every K3 component at a size that trains in minutes and, with its draft,
# fits in ~32 MB of repository.
K3_SHAPE = {
    "hidden": 256, "layers": 6, "mla_layers": [3, 6], "block": 3,
    "kda_heads": 4, "kda_dim": 64,
    "mla_heads": 4, "q_lora": 128, "kv_lora": 128, "nope": 64, "rope": 32, "v_dim": 64,
    "experts": 32, "top_k": 4, "shared": 1, "moe_inter": 256, "latent": 128,
    "dense_inter": 768, "bpe_ranks": 8192,
}
# The draft: a two-layer Qwen3 over the same vocabulary (K3's ids, specials included).
DRAFT_SHAPE = {
    "hidden": 192, "layers": 2, "heads": 6, "kv_heads": 2, "head_dim": 32, "inter": 512,
    "vocab": 8192 + 256, "rope_theta": 1_000_000.0,
}
SMOKE = {  # --smoke: the same code on shapes a CPU runs in seconds
    "k3": dict(K3_SHAPE, hidden=64, kda_heads=2, kda_dim=32, mla_heads=2, q_lora=32, kv_lora=32, nope=16, rope=16,
               v_dim=16, experts=8, top_k=2, moe_inter=64, latent=32, dense_inter=128),
    "draft": dict(DRAFT_SHAPE, hidden=64, heads=2, kv_heads=1, head_dim=32, inter=128),
}
BIAS_RATE = 1e-3  # auxiliary-free balancing: bias step per update, against each expert's load


def load_tokens(d):
    out = {}
    for name in ("lit", "tech"):
        a = np.fromfile(os.path.join(d, f"{name}.bin"), dtype=np.uint16)
        cut = int(len(a) * 0.99)
        out[name] = (torch.from_numpy(a[:cut].astype(np.int64)), torch.from_numpy(a[cut:].astype(np.int64)))
    return out


def batch(data, split, n, t, gen, lit_share):
    rows = []
    for _ in range(n):
        dom = "lit" if torch.rand((), generator=gen).item() < lit_share else "tech"
        a = data[dom][split]
        i = torch.randint(0, len(a) - t - 1, (), generator=gen).item()
        rows.append(a[i : i + t + 1])
    return torch.stack(rows)


@torch.no_grad()
def held_out_loss(model, data, dom, t, dev, rows=64):
    a = data[dom][1]
    step = max(1, (len(a) - t - 1) // rows)
    xs = torch.stack([a[i : i + t + 1] for i in range(0, step * rows, step)][:rows]).to(dev)
    total = 0.0
    for chunk in xs.split(16):
        logits = model(chunk[:, :-1])  # float32: the exported checkpoint as the engine runs it
        total += torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
    return total / (xs.shape[0] * t)


def autocast(dev):
    return torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")


@torch.no_grad()
def routing_skew(model, data, t, dev):
    """Per MoE layer: share of held-out routes taken by the hottest 10% / 30% of its experts."""
    out = []
    counts = None
    for dom in ("lit", "tech"):
        a = data[dom][1]
        xs = torch.stack([a[i : i + t] for i in range(0, min(len(a) - t, 32 * t), t)]).to(dev)
        model(xs)
        loads = [m.last_load.float().cpu() for m in model.moe_layers()]
        counts = loads if counts is None else [c + l for c, l in zip(counts, loads)]
    for c in counts:
        s = c.sort(descending=True).values
        n = len(s)
        out.append({"hottest_10pct": (s[: max(1, round(n * 0.1))].sum() / s.sum()).item(),
                    "hottest_30pct": (s[: max(1, round(n * 0.3))].sum() / s.sum()).item()})
    return out


@torch.no_grad()
def reference(model, data, dev, prompt_len=24, new=16):
    """Logits of the exported weights (fp32, no autocast) on a held-out prompt + greedy tokens."""
    ids = data["lit"][1][:prompt_len].to(dev)
    for _ in range(new):
        nxt = model(ids[None])[0, -1].argmax()
        ids = torch.cat([ids, nxt[None]])
    return {"logits": model(ids[None])[0].float().cpu().contiguous(), "token_ids": ids.cpu().contiguous()}


def save_parts(tensors, out, prefix, part_bytes=15 << 20):
    parts, cur, size = [], {}, 0
    for name, t in tensors.items():
        b = t.numel() * t.element_size()
        if cur and size + b > part_bytes:
            parts.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += b
    parts.append(cur)
    for i, p in enumerate(parts):
        save_file(p, os.path.join(out, f"{prefix}-{i:02}.safetensors"))
    return len(parts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["k3", "draft"], required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--budget-seconds", type=float, default=0,
                    help="instead of --steps: as many steps as fit, timed over steps 3..10 (the report says how many)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--qat-from", type=float, default=0.7, help="share of steps after which experts train as MXFP4")
    ap.add_argument("--lit-share", type=float, default=0.5, help="share of batches from fiction (a third of the tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, for checking the code on a CPU")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(a.seed)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SMOKE[a.model] if a.smoke else (K3_SHAPE if a.model == "k3" else DRAFT_SHAPE)
    if a.model == "k3":
        k3.check_shapes(shape)
        model = k3.K3(shape).to(dev)
    else:
        model = qwen3.Qwen3(shape).to(dev)
    data = load_tokens(a.tokens)
    vocab = shape["bpe_ranks"] + 256 if a.model == "k3" else shape["vocab"]
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(a.seed)
    warm = 30
    curve = []
    t0 = time.time()
    print(f"{a.model}: {k3.param_count(model) / 1e6:.2f} M parameters on {dev}, {a.steps} steps of "
          f"{a.batch} x {a.seq} tokens", flush=True)
    step = 0
    while step < a.steps:
        if a.budget_seconds and step == 3:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            probe = time.time()
        if a.budget_seconds and step == 11:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - probe) / 8
            a.steps = max(step + 1, int((a.budget_seconds - (time.time() - t0)) / per_step) + step)
            print(f"{per_step * 1e3:.0f} ms per step: {a.steps} steps fit in {a.budget_seconds:.0f} s", flush=True)
        if a.model == "k3" and step == int(a.steps * a.qat_from):
            model.set_qat(True)
            print(f"step {step}: experts now train as MXFP4", flush=True)
        lr = a.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / a.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        xy = batch(data, 0, a.batch, a.seq, gen, a.lit_share).to(dev)
        with autocast(dev):
            logits = model(xy[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), xy[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if a.model == "k3":
            with torch.no_grad():
                for m in model.moe_layers():
                    load = m.last_load.float()
                    m.gate.e_score_correction_bias.add_(BIAS_RATE * torch.sign(load.mean() - load))
        if step % 25 == 0 or step == a.steps - 1:
            el = time.time() - t0
            curve.append({"step": step, "loss": loss.item(), "seconds": round(el, 1)})
            print(f"step {step} loss {loss.item():.3f} lr {lr:.2e} {el:.0f} s "
                  f"({(step + 1) * a.batch * a.seq / el:.0f} tok/s)", flush=True)
        step += 1
    train_s = time.time() - t0
    model.eval()
    k3_or_q = k3 if a.model == "k3" else qwen3
    k3_or_q.as_exported(model)  # what follows measures the checkpoint as exported
    ppl = {dom: math.exp(held_out_loss(model, data, dom, a.seq, dev)) for dom in ("lit", "tech")}
    print(f"held-out perplexity (exported weights): {ppl}", flush=True)
    report = {"model": a.model, "shape": shape, "steps": a.steps, "batch": a.batch, "seq": a.seq, "lr": a.lr,
              "seed": a.seed, "qat_from": a.qat_from, "lit_share": a.lit_share, "parameters": k3.param_count(model),
              "train_seconds": round(train_s, 1), "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "held_out_perplexity": ppl, "held_out_tokens":
              {d: len(data[d][1]) for d in data}, "train_tokens": {d: len(data[d][0]) for d in data},
              "vocab": vocab, "curve": curve}
    if a.model == "k3":
        report["routing_skew"] = routing_skew(model, data, a.seq, dev)
        print(f"routing skew: {report['routing_skew']}", flush=True)
    report["parts"] = save_parts(k3_or_q.release_tensors(model), a.out, a.model)
    if a.model == "k3":
        model.set_chunked(False)  # the reference follows the engine's token-by-token recurrence
    save_file(reference(model, data, dev), os.path.join(a.out, f"{a.model}-reference.safetensors"))
    with open(os.path.join(a.out, f"{a.model}-report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {a.out}", flush=True)


if __name__ == "__main__":
    main()
