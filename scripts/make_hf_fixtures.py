#!/usr/bin/env python3
"""Make the HF-transformers correctness fixtures of tests/engine_hf.rs (issue #5, item 9).

Writes, under --out (default tests/fixtures/hf), one directory per model:

    llama-gqa/        LlamaForCausalLM, GQA (4 query heads, 2 KV heads), llama3 rope_scaling
    qwen2-bias-tied/  Qwen2ForCausalLM, q/k/v bias, tie_word_embeddings
    mistral/          MistralForCausalLM, GQA

each holding config.json, model.safetensors (fp16, from save_pretrained), generation_config.json,
tokenizer.json and expected.json: for three fixed prompts, the prompt text and ids and what HF
transformers computes on the fp32 model loaded from the saved fp16 files (so the reference sees
exactly the fp16 weights): the logits at the last prompt position and after each of the 32
greedy tokens, and the 32 tokens of model.generate(do_sample=False) with EOS ignored.

Nothing is downloaded: the tokenizer is a small BPE trained here, with the `tokenizers`
library, on a fixed text written below; the weights are random with fixed seeds. The script
needs torch (CPU is enough), transformers, tokenizers and safetensors, and is deterministic for
a given torch/transformers version (the versions are recorded in expected.json).

Random weights at the usual tiny init scale give logits whose top two are often within a
fraction of a percent of each other, so an fp16 engine could pick the other token without being
wrong. The weights here are scaled so activations are of unit size, and the untied LM heads get
a "successor" term (the row of token j leans toward the embedding of the token before j in a
fixed permutation), which separates the top logit; the script then checks the greedy path of
every prompt: at each of the 32 steps the top-2 gap must be at least MARGIN x max|logit|. A
model that fails is rebuilt from the next seed, with the successor term (or, for the tied model,
the embedding scale) raised after every few seeds. MARGIN is twice the tests' tolerance, so
that logits within the tolerance cannot change the greedy token.

Usage: python3 scripts/make_hf_fixtures.py [--out tests/fixtures/hf]
"""

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

# Tests' tolerance on max|fdpp - hf| / max|hf| over the vocabulary (tests/engine_hf.rs).
TOLERANCE = 1e-2
MARGIN = 2 * TOLERANCE
STEPS = 32
VOCAB = 256
SEEDS_PER_LEVEL = 12

# A fixed text to train the tokenizer on (written for this script).
CORPUS = """\
The engine reads the weights of a small model and runs it one token at a time.
Each layer normalizes its input, mixes the positions through attention, and then
passes every position through a gated feed forward block. A rotary embedding turns
the queries and the keys by an angle that grows with the position, so that their
dot product depends on how far apart two tokens are. Grouped query attention lets
several query heads share one key and value head, which keeps the cache small.
The cache holds the keys and values of every token seen so far, in pages of a fixed
size, and a block table says which page holds which part of a sequence. When a
prompt arrives, the whole prompt is run at once; after that, each step adds a single
token to every sequence in the batch. The last hidden state is normalized once more
and multiplied by the output head to give one logit for every word in the vocabulary.
Greedy decoding takes the largest logit; sampling draws from the softmax instead.
A quiet river runs past the old mill, and the miller counts the sacks of grain.
Seven birds sat on the fence at noon, watching the farmer plant rows of beans.
Numbers such as 12, 34 and 2048 appear in logs, next to words like batch and step.
"""

PROMPTS = [
    "The engine reads the weights",
    "A quiet river runs past the mill, and seven birds watch the farmer count 34 sacks.",
    "Each step adds a single token to every sequence, and the cache holds the keys and values of every token seen so far in pages",
]


def build_tokenizer():
    """A byte-free BPE of VOCAB entries with a SentencePiece-like metaspace ("▁" marks a word
    start, as in Llama's tokenizer), <unk>/<s>/</s> at ids 0/1/2 and <s> prepended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    try:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    except TypeError:  # tokenizers < 0.19 spells it add_prefix_space
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", add_prefix_space=True)
        tok.decoder = decoders.Metaspace(replacement="▁", add_prefix_space=True)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    bos = tok.token_to_id("<s>")
    if (tok.token_to_id("<unk>"), bos, tok.token_to_id("</s>")) != (0, 1, 2):
        raise SystemExit("tokenizer: expected <unk>, <s>, </s> at ids 0, 1, 2")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    for p in PROMPTS:
        if tok.token_to_id("<unk>") in tok.encode(p).ids:
            raise SystemExit(f"tokenizer: prompt {p!r} has characters outside the corpus")
    return tok


# The three models: (directory, transformers class name, config kwargs).
# fdpp's attention kernels take head_dim 64, 128 or 256: Llama and Mistral give the head
# dimension explicitly (4 heads of 64 on a hidden size of 128, as Llama 3.x / Mistral configs
# may); Qwen2 gets it as hidden / heads.
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)
MODELS = [
    (
        "llama-gqa",
        "Llama",
        dict(
            COMMON,
            intermediate_size=256,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            # head_dim 64: wavelengths 2π·10000^(i/32) run from 6.3 to ~47000, so with an
            # original context of 64 the kept (< 16), blended and stretched (> 64) bands all occur.
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    (
        "qwen2-bias-tied",
        "Qwen2",
        dict(
            {k: v for k, v in COMMON.items() if k != "head_dim"},
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=192,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            use_sliding_window=False,
        ),
    ),
    (
        "mistral",
        "Mistral",
        dict(
            COMMON,
            intermediate_size=192,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            sliding_window=4096,
        ),
    ),
]


def model_classes(family):
    import transformers

    return getattr(transformers, f"{family}Config"), getattr(transformers, f"{family}ForCausalLM")


def head_dim(cfg_kwargs):
    return cfg_kwargs.get("head_dim") or cfg_kwargs["hidden_size"] // cfg_kwargs["num_attention_heads"]


def expected_inv_freq(cfg_kwargs):
    """HF's inverse rotary frequencies for the config (llama3 scaling included), to check that
    the installed transformers applied the scaling the config asks for."""
    d = head_dim(cfg_kwargs)
    theta = cfg_kwargs["rope_theta"]
    base = [1.0 / theta ** (2 * i / d) for i in range(d // 2)]
    rs = cfg_kwargs.get("rope_scaling")
    if not rs:
        return base
    old, lo, hi, factor = (
        rs["original_max_position_embeddings"],
        rs["low_freq_factor"],
        rs["high_freq_factor"],
        rs["factor"],
    )
    out = []
    for f in base:
        wl = 2 * math.pi / f
        if wl < old / hi:
            out.append(f)
        elif wl > old / lo:
            out.append(f / factor)
        else:
            s = (old / wl - lo) / (hi - lo)
            out.append((1 - s) * f / factor + s * f)
    return out


def randomize(model, cfg_kwargs, seed, level):
    """Overwrite every parameter: unit-scale activations, norms near 1, biases of a few tenths,
    and the separation term described in the module docstring (strength grows with `level`)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h = cfg_kwargs["hidden_size"]
    tied = cfg_kwargs["tie_word_embeddings"]
    # Norm of the successor term in a head row (random rows have norm ~1); for the tied model,
    # the embedding scale, which sets how much the current token's own logit stands out.
    # Levels from a numpy dry run of this recipe: the first passes MARGIN for most seeds while
    # the greedy paths still visit ~70 distinct tokens (untied) or a handful (tied).
    successor = [1.0, 1.25, 1.5, 2.0, 2.5][level]
    emb_scale = [0.35, 0.5, 0.7, 1.0, 1.5][level] if tied else 1.0

    def randn(shape):
        return torch.randn(shape, generator=g, dtype=torch.float32)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * randn(p.shape))
            elif name.endswith(".bias"):
                p.copy_(0.3 * randn(p.shape))
            elif "embed_tokens" in name:
                p.copy_(emb_scale * randn(p.shape))
            elif name == "lm_head.weight":
                pass  # set below from the embeddings
            else:
                gain = 1.5 if ("q_proj" in name or "k_proj" in name) else 1.0
                p.copy_(gain * randn(p.shape) / math.sqrt(p.shape[1]))
        if not tied:
            emb = model.model.embed_tokens.weight
            perm = torch.randperm(emb.shape[0], generator=g)
            head = randn(model.lm_head.weight.shape) / math.sqrt(h)
            # Row perm[t] leans toward embedding t: token t favours perm[t] next.
            head[perm] += successor * emb / emb.norm(dim=1, keepdim=True)
            model.lm_head.weight.copy_(head)


def load_fp32(cls, path):
    """The saved fp16 checkpoint as an fp32 model (eager attention: the plain maths)."""
    import torch
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    model = cls.from_pretrained(path, attn_implementation="eager", **{dtype_kw: torch.float32})
    if next(model.parameters()).dtype != torch.float32:
        raise SystemExit(f"{path}: expected an fp32 model")
    return model.eval()


def greedy_path(model, ids):
    """HF's 32 greedy tokens and the logits that chose each (row 0: the last prompt position;
    row i: after i generated tokens), and the smallest top-2 gap over max|logit| on the path."""
    import torch

    x = torch.tensor([ids])
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=STEPS,
            eos_token_id=None,
            pad_token_id=0,
        )
        new = out[0, len(ids) :].tolist()
        if len(new) != STEPS:
            raise SystemExit(f"generate gave {len(new)} tokens, expected {STEPS}")
        # One forward over prompt + generated gives every step's logits at once.
        full = model(torch.tensor([ids + new])).logits[0].float()
    rows = full[len(ids) - 1 : len(ids) - 1 + STEPS]
    if rows.argmax(dim=1).tolist() != new:
        raise SystemExit("generate and the forward pass disagree on the greedy path")
    top2 = rows.topk(2, dim=1).values
    gap = ((top2[:, 0] - top2[:, 1]) / rows.abs().max(dim=1).values).min().item()
    return new, rows, gap


def compact(v):
    """fp32 logits to 6 significant digits: 5e-6 relative, far below the tolerance."""
    return [float(f"{x:.6g}") for x in v]


def make_one(out_dir, index, name, family, cfg_kwargs, prompt_ids):
    import torch

    cfg_cls, model_cls = model_classes(family)
    d = out_dir / name
    attempts = 0
    for level in range(5):
        for k in range(SEEDS_PER_LEVEL):
            seed = 1000 * (index + 1) + 100 * level + k
            attempts += 1
            torch.manual_seed(seed)
            cfg = cfg_cls(**cfg_kwargs)
            model = model_cls(cfg).float()
            q = model.model.layers[0].self_attn.q_proj.weight.shape[0]
            if q != cfg_kwargs["num_attention_heads"] * head_dim(cfg_kwargs):
                raise SystemExit(
                    f"{name}: this transformers ignores head_dim (q_proj has {q} rows); "
                    "use transformers >= 4.46"
                )
            randomize(model, cfg_kwargs, seed, level)
            if d.exists():
                shutil.rmtree(d)
            model.half().save_pretrained(d, safe_serialization=True)
            fp16 = {n: t.float() for n, t in model.state_dict().items()}
            ref = load_fp32(model_cls, d)
            got = ref.state_dict()
            if set(got) != set(fp16):
                raise SystemExit(f"{name}: tensors differ after loading: {set(got) ^ set(fp16)}")
            for n, t in got.items():
                if not torch.equal(t, fp16[n]):
                    raise SystemExit(f"{name}: {n} differs after the fp16 round trip")
            want = expected_inv_freq(cfg_kwargs)
            ropes = [m.inv_freq.tolist() for m in ref.modules() if hasattr(m, "inv_freq")]
            if not ropes:
                raise SystemExit(f"{name}: no rotary embedding module found")
            for inv in ropes:
                if len(inv) != len(want) or max(abs(a - b) / b for a, b in zip(inv, want)) > 1e-5:
                    raise SystemExit(
                        f"{name}: this transformers computes other rotary frequencies than the "
                        f"config asks for (rope_scaling ignored?): {inv} vs {want}"
                    )
            paths = [greedy_path(ref, ids) for ids in prompt_ids]
            gap = min(p[2] for p in paths)
            print(f"{name}: seed {seed} level {level}: smallest top-2 gap {gap:.4f} of max|logit|")
            if gap >= MARGIN:
                return d, seed, level, attempts, paths
    raise SystemExit(f"{name}: no seed gave top-2 gaps of {MARGIN} in {attempts} attempts")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tests/fixtures/hf", help="output directory")
    args = ap.parse_args()

    import safetensors
    import tokenizers
    import torch
    import transformers

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    prompt_ids = [tok.encode(p).ids for p in PROMPTS]
    for index, (name, family, cfg_kwargs) in enumerate(MODELS):
        d, seed, level, attempts, paths = make_one(out_dir, index, name, family, cfg_kwargs, prompt_ids)
        tok.save(str(d / "tokenizer.json"))
        expected = {
            "generator": {
                "script": "scripts/make_hf_fixtures.py",
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__,
                "safetensors": safetensors.__version__,
                "seed": seed,
                "level": level,
                "attempts": attempts,
            },
            "architecture": f"{family}ForCausalLM",
            "steps": STEPS,
            "margin": MARGIN,
            "note": "HF fp32 (eager attention) on the fp16 weights of model.safetensors. "
            "logits[0]: the last prompt position; logits[i]: after i greedy tokens "
            "(logits[i] chose greedy[i]). EOS ignored. min_gap: smallest top-2 gap over "
            "max|logit| on the path.",
            "prompts": [
                {
                    "text": text,
                    "ids": ids,
                    "greedy": new,
                    "min_gap": round(gap, 6),
                    "logits": [compact(r.tolist()) for r in rows],
                }
                for text, ids, (new, rows, gap) in zip(PROMPTS, prompt_ids, paths)
            ],
        }
        with open(d / "expected.json", "w") as f:
            json.dump(expected, f, separators=(",", ":"))
            f.write("\n")
        size = sum(p.stat().st_size for p in d.iterdir())
        print(f"{d}: {size / 1e6:.2f} MB")
    total = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    print(f"{out_dir}: {total / 1e6:.2f} MB in all")
    if total > 4e6:
        sys.exit(f"fixtures are {total / 1e6:.2f} MB: keep them well under 5 MB")


if __name__ == "__main__":
    main()
