#!/usr/bin/env python3
"""Reference values for fdpp's GGUF tests, computed by the `gguf` Python package (llama.cpp's
gguf-py, pure Python/numpy) — an implementation independent of fdpp's.

  python3 scripts/gguf_reference.py quant  > tests/fixtures/gguf/quant_blocks.json
  python3 scripts/gguf_reference.py smollm2 target/models/SmolLM2-135M-Instruct.Q4_1.gguf \
      > tests/fixtures/smollm2/tensors.json

`quant`: for every type fdpp dequantizes, two rows of 256 elements made of random bytes (with
the half-precision scale fields set to random finite values, so every bit pattern of the quants
is exercised) and gguf-py's dequantization of them.
`smollm2`: for a few tensors of the real file, in GGUF's own layout (rows of dims[0] elements,
no Q/K un-permutation): the sum and sum of squares in f64 and sample rows.

Needs: pip install gguf numpy (tested with gguf 0.19.0, numpy 2.4).
"""
import json
from importlib.metadata import version
import sys

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

# Offsets of the f16 scale fields within each block type (ggml-common.h).
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}


def quant():
    rng = np.random.default_rng(20261125)
    out = {"source": f"gguf-py {version('gguf')}, numpy {np.__version__}", "rows": 2, "cols": 256, "types": []}
    for ty in [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]:
        be, bb = gguf.GGML_QUANT_SIZES[ty]
        rows, cols = 2, 256
        nblk = rows * cols // be
        if ty == T.F32:
            raw = rng.standard_normal(rows * cols).astype("<f4").tobytes()
        elif ty == T.F16:
            raw = rng.standard_normal(rows * cols).astype("<f2").tobytes()
        elif ty == T.BF16:
            raw = (rng.standard_normal(rows * cols).astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
        else:
            blocks = rng.integers(0, 256, size=(nblk, bb), dtype=np.uint8)
            for off in F16_FIELDS[ty]:
                # Scales between 1e-3 and 1 in magnitude, mins of either sign.
                v = (rng.uniform(1e-3, 1.0, nblk) * rng.choice([-1, 1], nblk)).astype("<f2")
                blocks[:, off:off + 2] = v.view(np.uint8).reshape(nblk, 2)
            raw = blocks.tobytes()
        data = np.frombuffer(raw, dtype=np.uint8).reshape(rows, -1)
        vals = dequantize(data, ty).astype(np.float32).reshape(-1)
        assert np.all(np.isfinite(vals))
        out["types"].append({
            "type": ty.name, "id": int(ty), "hex": raw.hex(),
            # repr of an f32 widened to f64 is exact: the test compares bit for bit.
            "values": [float(x) for x in vals],
        })
    json.dump(out, sys.stdout)


def smollm2(path):
    r = gguf.GGUFReader(path)
    names = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_norm.weight",
             "blk.29.ffn_down.weight", "output_norm.weight"]
    out = {"source": f"gguf-py {version('gguf')} (numpy {np.__version__}) on {path.split('/')[-1]}", "tensors": []}
    by = {t.name: t for t in r.tensors}
    for n in names:
        t = by[n]
        vals = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        dims = [int(d) for d in t.shape]  # ggml order, fastest first
        flat = vals.reshape(-1, dims[0])
        nr = flat.shape[0]
        picks = sorted({0, min(1, nr - 1), nr // 2, nr - 1})
        out["tensors"].append({
            "name": n, "type": t.tensor_type.name, "dims": dims,
            "sum": float(flat.astype(np.float64).sum()),
            "sum_sq": float((flat.astype(np.float64) ** 2).sum()),
            "rows": {str(i): [float(x) for x in flat[i, :16]] for i in picks},
        })
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "quant":
        quant()
    else:
        smollm2(sys.argv[2])
