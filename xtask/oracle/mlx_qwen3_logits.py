"""Reference logits for a Qwen3 checkpoint from mlx-lm's independent `qwen3` model at float32.

usage: mlx_qwen3_logits.py MODEL_DIR IDS(comma-separated) OUT.json

Writes, for every position, the argmax and the logits at a fixed set of columns (all of them
for vocabularies up to 4096, else every 151st), so the fixture stays small.
"""
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import qwen3


def main():
    model_dir, ids, out = Path(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")], sys.argv[3]
    config = json.loads((model_dir / "config.json").read_text())
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    weights = mx.load(str(model_dir / "model.safetensors"))
    weights = {k: v.astype(mx.float32) for k, v in weights.items()}
    weights = model.sanitize(weights)
    model.load_weights(list(weights.items()))
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    mx.eval(logits)
    vocab = logits.shape[-1]
    cols = list(range(vocab)) if vocab <= 4096 else list(range(0, vocab, 151))
    rows = [[float(x) for x in logits[r, mx.array(cols)].tolist()] for r in range(len(ids))]
    argmax = [int(x) for x in mx.argmax(logits, axis=-1).tolist()]
    json.dump({"ids": ids, "cols": cols, "logits": rows, "argmax": argmax, "mlx_lm": "0.32.2 qwen3, float32"}, open(out, "w"))


if __name__ == "__main__":
    main()
