"""Reference logits from mlx-lm's independent `kimi_k3` implementation, at float32.

Usage: python3 mlx_k3_logits.py CHECKPOINT_DIR OUT.safetensors ID,ID,...

Loads the checkpoint exactly as mlx-lm does (MXFP4 experts through its compressed-tensors path),
casts every floating parameter to float32 (mlx-lm's bf16 default is far too noisy to compare),
runs one forward over the ids and writes F32 `logits` [T, vocab]. Used by `cargo xtask oracle`
to make the committed fixtures under tests/fixtures/mlx/; CI never runs it.
"""
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.utils import load_model


def main():
    path, out, ids = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
    mx.set_default_device(mx.cpu)
    model, _ = load_model(__import__("pathlib").Path(path))
    floats = {k: v.astype(mx.float32) for k, v in nn.utils.tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating) and not k.endswith("scales")}
    model.load_weights(list(floats.items()), strict=False)
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    mx.eval(logits)
    mx.save_safetensors(out, {"logits": logits})
    print(f"{out}: logits {tuple(logits.shape)}")


if __name__ == "__main__":
    main()
