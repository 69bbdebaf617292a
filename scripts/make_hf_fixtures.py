#!/usr/bin/env python3
"""Make the HF-transformers correctness fixtures of tests/engine_hf.rs (issue #5, item 9).

Writes, under --out (default tests/fixtures/hf), one directory per model:

    llama-gqa/        LlamaForCausalLM, GQA (4 query heads, 2 KV heads), llama3 rope_scaling
    qwen2-bias-tied/  Qwen2ForCausalLM, q/k/v bias, tie_word_embeddings
    mistral/          MistralForCausalLM, GQA
    opt/              OPTForCausalLM: pre-LayerNorm with biases, learned positions (offset 2),
                      ReLU, biases on every projection, tied LM head, word_embed_proj_dim (64)
                      different from hidden_size (128): project_in / project_out
    qwen2-gqa6/       Qwen2ForCausalLM with 6 query heads on 1 KV head (GQA ratio 6)
    chatglm2/         ChatGLM2 (ChatGLMModel config and weight names). transformers has no
                      ChatGLM class (THUDM ships it as remote code, which this script does not
                      download or run): its forward is written below, in torch, from the
                      published architecture (class GlmReference)

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

The fixtures made after the first three also record HF's top-2 gap over max|logit| at every
greedy step ("gaps"), so that a test can tell a divergence at a near-tie from a bug; when no seed
reaches MARGIN for them, the seed with the largest smallest gap is kept and says so.

Usage: python3 scripts/make_hf_fixtures.py [--out tests/fixtures/hf] [--only opt,qwen2-gqa6,chatglm2]
"""

import argparse
import traceback
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
    (
        "opt",
        "OPT",
        dict(
            vocab_size=VOCAB,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            ffn_dim=256,
            # Narrower than hidden_size: OPT-350m's project_in / project_out path.
            word_embed_proj_dim=64,
            # Kept small: the learned position table has max_position_embeddings + 2 rows.
            max_position_embeddings=256,
            do_layer_norm_before=True,
            activation_function="relu",
            enable_bias=True,
            layer_norm_elementwise_affine=True,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
    ),
    (
        "qwen2-gqa6",
        "Qwen2",
        dict(
            COMMON,
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=1,
            head_dim=64,
            intermediate_size=128,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            use_sliding_window=False,
        ),
    ),
    (
        "chatglm2",
        "ChatGLM",
        # The fields of THUDM/chatglm2-6b's config.json, at a tiny size; kv_channels 64 on a
        # hidden size of 128 with 4 heads (projection 256), as Llama-3.x configs may.
        dict(
            architectures=["ChatGLMModel"],
            model_type="chatglm",
            padded_vocab_size=VOCAB,
            vocab_size=VOCAB,
            hidden_size=128,
            num_layers=2,
            num_attention_heads=4,
            multi_query_attention=True,
            multi_query_group_num=2,
            kv_channels=64,
            ffn_hidden_size=128,
            seq_length=512,
            layernorm_epsilon=1e-5,
            rmsnorm=True,
            post_layer_norm=True,
            apply_residual_connection_post_layernorm=False,
            add_bias_linear=False,
            add_qkv_bias=True,
            original_rope=True,
            rope_ratio=2.0,
            fp32_residual_connection=False,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            torch_dtype="float16",
        ),
    ),
]

# The fixtures whose expected.json carries per-step gaps (see the module docstring).
FIRST_WITH_GAPS = 3


def model_classes(family):
    import transformers

    return getattr(transformers, f"{family}Config"), getattr(transformers, f"{family}ForCausalLM")


def head_dim(cfg_kwargs):
    return (
        cfg_kwargs.get("head_dim")
        or cfg_kwargs.get("kv_channels")
        or cfg_kwargs["hidden_size"] // cfg_kwargs["num_attention_heads"]
    )


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


# Names of the token embedding and of an untied LM head, per family.
EMBED_NAMES = ("embed_tokens.weight", "word_embeddings.weight")
HEAD_NAMES = ("lm_head.weight", "transformer.output_layer.weight")


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

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * randn(p.shape))
            elif name.endswith(".bias"):
                p.copy_(0.3 * randn(p.shape))
            elif name.endswith(EMBED_NAMES):
                p.copy_(emb_scale * randn(p.shape))
            elif name.endswith("embed_positions.weight"):
                # OPT's learned positions: a few tenths, next to unit-size token embeddings.
                p.copy_(0.3 * randn(p.shape))
            elif name in HEAD_NAMES or name.endswith(("project_in.weight", "project_out.weight")):
                pass  # set below
            else:
                gain = 1.5 if ("q_proj" in name or "k_proj" in name) else 1.0
                p.copy_(gain * randn(p.shape) / math.sqrt(p.shape[1]))
        proj_in = next((p for n, p in params.items() if n.endswith("project_in.weight")), None)
        if proj_in is not None:
            # OPT's project_in [hidden, proj] with orthonormal columns and project_out its
            # transpose: the tied head then sees the embedding it came from (the tied
            # separation above), which random projections would scramble.
            q, _ = torch.linalg.qr(randn(proj_in.shape))
            proj_in.copy_(q)
            proj_out = next(p for n, p in params.items() if n.endswith("project_out.weight"))
            proj_out.copy_(q.t())
        if not tied:
            emb = next(p for n, p in params.items() if n.endswith(EMBED_NAMES))
            head = next(p for n, p in params.items() if n in HEAD_NAMES)
            perm = torch.randperm(emb.shape[0], generator=g)
            new = randn(head.shape) / math.sqrt(h)
            # Row perm[t] leans toward embedding t: token t favours perm[t] next.
            new[perm] += successor * emb / emb.norm(dim=1, keepdim=True)
            head.copy_(new)


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


def glm_reference_class():
    """ChatGLM2/3's forward in torch, written for this script from the published architecture
    (the ChatGLM2-6B release: GLM blocks with pre-RMSNorm, multi-query attention over
    `multi_query_group_num` KV groups with a bias on the fused query_key_value projection only,
    rotary embedding on the first half of each head's `kv_channels` in interleaved pairs
    (2i, 2i+1) with base 10000 * rope_ratio, SwiGLU on the fused dense_h_to_4h output (first half
    the gate), a final RMSNorm and an untied output layer). Parameter names are those of the
    released checkpoints. Plain fp32 maths, no cache: every call runs the whole sequence."""
    import torch
    from torch import nn

    class RmsNorm(nn.Module):
        def __init__(self, h, eps):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(h))
            self.eps = eps

        def forward(self, x):
            var = x.pow(2).mean(-1, keepdim=True)
            return self.weight * (x * torch.rsqrt(var + self.eps))

    class GlmReference(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.c = c
            h, heads, groups, d = (
                c["hidden_size"],
                c["num_attention_heads"],
                c["multi_query_group_num"],
                c["kv_channels"],
            )
            ffn, vocab, eps = c["ffn_hidden_size"], c["padded_vocab_size"], c["layernorm_epsilon"]
            t = nn.Module()
            t.embedding = nn.Module()
            t.embedding.word_embeddings = nn.Embedding(vocab, h)
            t.encoder = nn.Module()
            layers = nn.ModuleList()
            for _ in range(c["num_layers"]):
                blk = nn.Module()
                blk.input_layernorm = RmsNorm(h, eps)
                blk.self_attention = nn.Module()
                blk.self_attention.query_key_value = nn.Linear(
                    h, (heads + 2 * groups) * d, bias=c["add_qkv_bias"]
                )
                blk.self_attention.dense = nn.Linear(heads * d, h, bias=c["add_bias_linear"])
                blk.post_attention_layernorm = RmsNorm(h, eps)
                blk.mlp = nn.Module()
                blk.mlp.dense_h_to_4h = nn.Linear(h, 2 * ffn, bias=c["add_bias_linear"])
                blk.mlp.dense_4h_to_h = nn.Linear(ffn, h, bias=c["add_bias_linear"])
                layers.append(blk)
            t.encoder.layers = layers
            t.encoder.final_layernorm = RmsNorm(h, eps)
            t.output_layer = nn.Linear(h, vocab, bias=False)
            self.transformer = t

        def rotary(self, x, cos, sin):
            """x [T, n, d]: the first 2·len(inv_freq) elements rotated in pairs (2i, 2i+1)."""
            t_len, n, _ = x.shape
            pairs = cos.shape[1]
            rot, rest = x[..., : 2 * pairs], x[..., 2 * pairs :]
            r = rot.reshape(t_len, n, pairs, 2)
            a, b = r[..., 0], r[..., 1]
            c, s = cos[:, None, :], sin[:, None, :]
            out = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(2)
            return torch.cat([out, rest], dim=-1)

        def forward(self, ids):
            """Logits [T, vocab] of the token list `ids` (positions 0..T-1)."""
            c, t = self.c, self.transformer
            heads, groups, d = c["num_attention_heads"], c["multi_query_group_num"], c["kv_channels"]
            n = len(ids)
            x = t.embedding.word_embeddings(torch.tensor(ids))
            rotary_dim = d // 2
            base = 10000.0 * c.get("rope_ratio", 1.0)
            inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
            angle = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)
            cos, sin = angle.cos(), angle.sin()
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            for blk in t.encoder.layers:
                y = blk.input_layernorm(x)
                qkv = blk.self_attention.query_key_value(y)
                q, k, v = qkv.split([heads * d, groups * d, groups * d], dim=-1)
                q = self.rotary(q.reshape(n, heads, d), cos, sin)
                k = self.rotary(k.reshape(n, groups, d), cos, sin)
                v = v.reshape(n, groups, d)
                # Query head j reads KV group j // (heads / groups).
                k = k.repeat_interleave(heads // groups, dim=1)
                v = v.repeat_interleave(heads // groups, dim=1)
                scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
                scores = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
                o = torch.einsum("hqk,khd->qhd", scores, v).reshape(n, heads * d)
                x = x + blk.self_attention.dense(o)
                y = blk.post_attention_layernorm(x)
                gate, up = blk.mlp.dense_h_to_4h(y).chunk(2, dim=-1)
                x = x + blk.mlp.dense_4h_to_h(torch.nn.functional.silu(gate) * up)
            return t.output_layer(t.encoder.final_layernorm(x))

    return GlmReference


class Family:
    """How one family's model is built, saved, reloaded in fp32 and run."""

    def __init__(self, family, cfg_kwargs):
        self.family = family
        self.cfg_kwargs = cfg_kwargs
        self.glm = family == "ChatGLM"

    def build(self):
        if self.glm:
            return glm_reference_class()(self.cfg_kwargs).float()
        cfg_cls, model_cls = model_classes(self.family)
        return model_cls(cfg_cls(**self.cfg_kwargs)).float()

    def save(self, model, d):
        if not self.glm:
            model.half().save_pretrained(d, safe_serialization=True)
            return
        import safetensors.torch

        d.mkdir(parents=True)
        tensors = {n: t.detach().half().contiguous() for n, t in model.state_dict().items()}
        safetensors.torch.save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        model.half()
        with open(d / "config.json", "w") as f:
            json.dump(self.cfg_kwargs, f, indent=2)
            f.write("\n")
        gen = {k: self.cfg_kwargs[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        with open(d / "generation_config.json", "w") as f:
            json.dump(gen, f, indent=2)
            f.write("\n")

    def load_fp32(self, d):
        if not self.glm:
            return load_fp32(model_classes(self.family)[1], d)
        import safetensors.torch

        model = glm_reference_class()(self.cfg_kwargs).float()
        state = {n: t.float() for n, t in safetensors.torch.load_file(str(d / "model.safetensors")).items()}
        model.load_state_dict(state, strict=True)
        return model.eval()

    def check_structure(self, name, ref):
        """The installed transformers built what the config says (head_dim, rotary)."""
        c = self.cfg_kwargs
        if self.glm:
            return
        if self.family == "OPT":
            dec = ref.model.decoder
            if dec.project_in is None or dec.project_out is None:
                raise SystemExit(f"{name}: OPT built without project_in/project_out")
            rows = dec.embed_positions.weight.shape[0]
            if rows != c["max_position_embeddings"] + 2:
                raise SystemExit(f"{name}: OPT position table has {rows} rows")
            return
        q = ref.model.layers[0].self_attn.q_proj.weight.shape[0]
        if q != c["num_attention_heads"] * head_dim(c):
            raise SystemExit(
                f"{name}: this transformers ignores head_dim (q_proj has {q} rows); use transformers >= 4.46"
            )
        want = expected_inv_freq(c)
        ropes = [m.inv_freq.tolist() for m in ref.modules() if hasattr(m, "inv_freq")]
        if not ropes:
            raise SystemExit(f"{name}: no rotary embedding module found")
        for inv in ropes:
            if len(inv) != len(want) or max(abs(a - b) / b for a, b in zip(inv, want)) > 1e-5:
                raise SystemExit(
                    f"{name}: this transformers computes other rotary frequencies than the "
                    f"config asks for (rope_scaling ignored?): {inv} vs {want}"
                )

    def greedy_path(self, model, ids):
        """The 32 greedy tokens and the logits that chose each (row 0: the last prompt
        position; row i: after i generated tokens), and each step's top-2 gap over max|logit|."""
        import torch

        with torch.no_grad():
            if self.glm:
                new = []
                for _ in range(STEPS):
                    new.append(int(model(ids + new)[-1].argmax()))
                full = model(ids + new).float()
            else:
                x = torch.tensor([ids])
                model.generation_config.eos_token_id = None
                out = model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    do_sample=False,
                    max_new_tokens=STEPS,
                    eos_token_id=None,
                    pad_token_id=0,
                )
                new = out[0, len(ids) :].tolist()
                # One forward over prompt + generated gives every step's logits at once.
                full = model(torch.tensor([ids + new])).logits[0].float()
        if len(new) != STEPS:
            raise SystemExit(f"generate gave {len(new)} tokens, expected {STEPS}")
        rows = full[len(ids) - 1 : len(ids) - 1 + STEPS]
        if rows.argmax(dim=1).tolist() != new:
            raise SystemExit("generate and the forward pass disagree on the greedy path")
        top2 = rows.topk(2, dim=1).values
        gaps = ((top2[:, 0] - top2[:, 1]) / rows.abs().max(dim=1).values).tolist()
        return new, rows, gaps


def compact(v):
    """fp32 logits to 6 significant digits: 5e-6 relative, far below the tolerance."""
    return [float(f"{x:.6g}") for x in v]


def make_one(out_dir, index, name, family, cfg_kwargs, prompt_ids):
    """The first seed whose greedy paths keep MARGIN; for the fixtures that record per-step gaps,
    the best seed tried when none does (the test then allows divergence at those near-ties)."""
    import torch

    fam = Family(family, cfg_kwargs)
    d = out_dir / name
    attempts = 0
    best = None
    for level in range(5):
        for k in range(SEEDS_PER_LEVEL):
            seed = 1000 * (index + 1) + 100 * level + k
            attempts += 1
            torch.manual_seed(seed)
            model = fam.build()
            randomize(model, cfg_kwargs, seed, level)
            if d.exists():
                shutil.rmtree(d)
            fp16 = {n: t.half().float() for n, t in model.state_dict().items()}
            fam.save(model, d)
            ref = fam.load_fp32(d)
            got = ref.state_dict()
            if set(got) != set(fp16):
                raise SystemExit(f"{name}: tensors differ after loading: {set(got) ^ set(fp16)}")
            for n, t in got.items():
                if not torch.equal(t, fp16[n]):
                    raise SystemExit(f"{name}: {n} differs after the fp16 round trip")
            fam.check_structure(name, ref)
            paths = [fam.greedy_path(ref, ids) for ids in prompt_ids]
            gap = min(min(p[2]) for p in paths)
            print(f"{name}: seed {seed} level {level}: smallest top-2 gap {gap:.4f} of max|logit|", flush=True)
            if gap >= MARGIN:
                return d, seed, level, attempts, paths
            if best is None or gap > best[0]:
                best = (gap, seed, level)
    if index < FIRST_WITH_GAPS or best is None:
        raise SystemExit(f"{name}: no seed gave top-2 gaps of {MARGIN} in {attempts} attempts")
    gap, seed, level = best
    print(f"{name}: no seed reached {MARGIN}; keeping seed {seed} (smallest gap {gap:.4f})", flush=True)
    torch.manual_seed(seed)
    model = fam.build()
    randomize(model, cfg_kwargs, seed, level)
    shutil.rmtree(d)
    fam.save(model, d)
    ref = fam.load_fp32(d)
    return d, seed, level, attempts, [fam.greedy_path(ref, ids) for ids in prompt_ids]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tests/fixtures/hf", help="output directory")
    names = [m[0] for m in MODELS]
    ap.add_argument(
        "--only",
        default=None,
        help=f"comma-separated fixtures to make (default all): {','.join(names)}",
    )
    args = ap.parse_args()
    only = names if args.only is None else args.only.split(",")
    unknown = [n for n in only if n not in names]
    if unknown:
        sys.exit(f"--only: unknown fixtures {unknown}; known: {names}")

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
    failed = []
    for index, (name, family, cfg_kwargs) in enumerate(MODELS):
        if name not in only:
            continue
        try:
            d, seed, level, attempts, paths = make_one(out_dir, index, name, family, cfg_kwargs, prompt_ids)
        except (Exception, SystemExit) as e:  # one family's failure must not lose the others
            traceback.print_exc()
            failed.append(f"{name}: {e}")
            continue
        tok.save(str(d / "tokenizer.json"))
        with_gaps = index >= FIRST_WITH_GAPS
        generator = {
            "script": "scripts/make_hf_fixtures.py",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "safetensors": safetensors.__version__,
            "seed": seed,
            "level": level,
            "attempts": attempts,
        }
        if family == "ChatGLM":
            generator["reference"] = (
                "GlmReference in this script (transformers has no ChatGLM class): fp32 torch, "
                "written from the published ChatGLM2 architecture"
            )
        expected = {
            "generator": generator,
            "architecture": cfg_kwargs.get("architectures", [f"{family}ForCausalLM"])[0],
            "steps": STEPS,
            "margin": MARGIN,
            "note": "HF fp32 (eager attention) on the fp16 weights of model.safetensors. "
            "logits[0]: the last prompt position; logits[i]: after i greedy tokens "
            "(logits[i] chose greedy[i]). EOS ignored. min_gap: smallest top-2 gap over "
            "max|logit| on the path" + ("; gaps: that gap at every step." if with_gaps else "."),
            "prompts": [],
        }
        for text, ids, (new, rows, gaps) in zip(PROMPTS, prompt_ids, paths):
            case = {"text": text, "ids": ids, "greedy": new, "min_gap": round(min(gaps), 6)}
            if with_gaps:
                case["gaps"] = [round(g, 6) for g in gaps]
            case["logits"] = [compact(r.tolist()) for r in rows]
            expected["prompts"].append(case)
        with open(d / "expected.json", "w") as f:
            json.dump(expected, f, separators=(",", ":"))
            f.write("\n")
        size = sum(p.stat().st_size for p in d.iterdir())
        print(f"{d}: {size / 1e6:.2f} MB", flush=True)
        if size > 1.2e6:
            failed.append(f"{name}: {size / 1e6:.2f} MB; keep each fixture near 1 MB")
    total = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    print(f"{out_dir}: {total / 1e6:.2f} MB in all")
    if failed:
        sys.exit("failed:\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
