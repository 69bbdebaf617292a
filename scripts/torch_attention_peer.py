#!/usr/bin/env python3
"""Peer measurement on the GPU machine: torch scaled_dot_product_attention timed the way
`fdpp bench attention` times (CUDA events, back-to-back runs after a warm-up, inputs rotated over
enough copies that K/V are not served from L2, median), printing CSV rows with the columns of
fdpp's attention report (variant `sdpa`). Run it in the same device session as fdpp and pass its
output to `fdpp bench attention --peer FILE`: the rows join fdpp's table and chart, with a
`vs sdpa` column.

decode:  q [B, H, 1, D] against a contiguous K/V cache [B, G, L, D] (no mask);
prefill: q [B, H, L, D], k/v [B, G, L, D], is_causal=True (a prompt from an empty cache).
G < H uses SDPA's enable_gqa (torch >= 2.5); older torch repeats K/V to H heads and says so in
the `scheme` column (it then reads G/H more bytes than the counted minimum).

Peer rows: fdpp_version holds `torch-<version>`, git_commit `cuda-<version>`, page_size 0
(contiguous cache); splits, rows, recomputed, recompute_rate, nmse and the ratios stay empty
(fdpp fills the ratios). Byte and FLOP counts follow fdpp's formulas (ops/attention.rs).

usage: scripts/torch_attention_peer.py [--phase decode|prefill] [--batch 1,8,64]
         [--kv-len 1024,4096,16384] [--heads 32] [--kv-heads 32] [--head-dim 128]
         [--dtype f16|bf16] [--reps 30] [--warmup 5] [--peak-tflops 790] [--copy-gbps G]
         [--sdpa-backend default|flash|cudnn|efficient] [--out FILE]

--sdpa-backend pins torch's SDPA to one implementation (torch.nn.attention.sdpa_kernel); the
rows keep the variant `sdpa` (fdpp's `vs sdpa` column takes the fastest peer row of a shape)
and name the backend in `scheme`, so that runs of several backends can share one --peer file.
A shape the pinned backend cannot run is skipped with the reason on stderr.
"""
import argparse
import csv
import math
import statistics
import sys

import contextlib

import torch
import torch.nn.functional as F

# The columns of fdpp's attention CSV, in order (tests/bench_attention.rs checks this list
# against `fdpp bench attention --format csv`).
COLUMNS = [
    "fdpp_version", "git_commit", "device", "backend", "phase", "dtype", "heads", "kv_heads",
    "head_dim", "page_size", "batch", "kv_len", "variant", "scheme", "splits", "samples",
    "median_us", "min_us", "max_us", "bytes", "flops", "tbps", "tflops", "roofline_pct",
    "roofline", "rows", "recomputed", "recompute_rate", "nmse", "speedup_vs_sync",
    "speedup_vs_sdpa", "append_us",
]

# fdpp's input scale: q, k uniform in [-2.1, 2.1) keep q.k/sqrt(d) around +-1.5 (bench/attention.rs).
QK_SCALE = 2.1
MAX_COPIES = 8


def ints(s):
    return [int(v) for v in s.split(",") if v.strip()]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def copy_gbps(dev, reps=10):
    """Device copy bandwidth counting read + write bytes (fdpp's Backend::copy_gbps)."""
    n = 1 << 30  # 1 Gi fp16 elements: 2 GiB each way
    src = torch.ones(n, dtype=torch.float16, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    ev[0].record()
    for i in range(reps):
        dst.copy_(src)
        ev[i + 1].record()
    torch.cuda.synchronize()
    ms = statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(reps))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def has_enable_gqa():
    q = torch.zeros(1, 2, 1, 8, device="cuda", dtype=torch.float16)
    k = torch.zeros(1, 1, 4, 8, device="cuda", dtype=torch.float16)
    try:
        F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
        return True
    except TypeError:
        return False


def pinned_backend(name):
    """A context that pins SDPA to one backend, or does nothing for `default`."""
    if name == "default":
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }[name]
    return lambda: sdpa_kernel(which)


def counts(phase, b, length, h, g, d, es):
    """(least bytes, FLOPs) as fdpp counts them."""
    if phase == "decode":
        byts = (2 * b * length * g * d + 2 * b * h * d) * es
        flops = 4.0 * h * d * b * length
    else:
        t = b * length
        byts = (2 * t * h * d + 2 * t * g * d) * es
        flops = 4.0 * h * d * b * (length * length / 2.0)
    return float(byts), flops


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phase", choices=["decode", "prefill"], default="decode")
    ap.add_argument("--batch", default=None, help="default: 1,8,64 (decode), 1 (prefill)")
    ap.add_argument("--kv-len", default="1024,4096,16384")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=["f16", "bf16"], default="f16")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--copy-gbps", type=float, default=None, help="skip measuring the copy bandwidth")
    ap.add_argument("--sdpa-backend", choices=["default", "flash", "cudnn", "efficient"], default="default")
    ap.add_argument("--out", default=None, help="CSV file (default stdout)")
    a = ap.parse_args()
    if a.heads % a.kv_heads != 0:
        sys.exit(f"--heads {a.heads} is not a multiple of --kv-heads {a.kv_heads}")
    batches = ints(a.batch) if a.batch else ([1, 8, 64] if a.phase == "decode" else [1])
    lens = ints(a.kv_len)
    if not batches or not lens or min(batches + lens) < 1 or a.reps < 1:
        sys.exit("--batch and --kv-len need positive values, --reps at least 1")

    dev = torch.device("cuda")
    dt = torch.float16 if a.dtype == "f16" else torch.bfloat16
    es = 2
    props = torch.cuda.get_device_properties(dev)
    l2 = props.L2_cache_size
    name = torch.cuda.get_device_name(dev)
    log(f"device {name}, torch {torch.__version__}, CUDA {torch.version.cuda}, L2 {l2 >> 20} MiB")
    gbps = a.copy_gbps if a.copy_gbps else copy_gbps(dev)
    log(f"copy bandwidth {gbps:.0f} GB/s (read + write)")
    h, g, d = a.heads, a.kv_heads, a.head_dim
    gqa = g != h
    native_gqa = gqa and has_enable_gqa()
    scheme = "sdpa" if not gqa else ("sdpa(enable_gqa)" if native_gqa else "sdpa(kv repeated to all heads)")
    pinned = pinned_backend(a.sdpa_backend)
    if a.sdpa_backend != "default":
        scheme += f"/{a.sdpa_backend}"

    out = open(a.out, "w", newline="") if a.out else sys.stdout
    w = csv.DictWriter(out, fieldnames=COLUMNS)
    w.writeheader()
    for b in batches:
        for length in lens:
            q_len = 1 if a.phase == "decode" else length
            # Without enable_gqa the K/V are stored repeated (outside the timed calls).
            g_stored = h if gqa and not native_gqa else g
            set_bytes = (b * h * q_len * d + 2 * b * g_stored * length * d) * es
            out_bytes = b * h * q_len * d * es
            free, _ = torch.cuda.mem_get_info(dev)
            usable = int(0.9 * free) - out_bytes
            if set_bytes > usable:
                log(f"skipped b={b} len={length}: needs {set_bytes + out_bytes} bytes, {free} free")
                continue
            copies = max(1, min(MAX_COPIES, math.ceil(3 * l2 / set_bytes), usable // set_bytes))
            sets = []
            for _ in range(copies):
                q = torch.empty(b, h, q_len, d, dtype=dt, device=dev).uniform_(-QK_SCALE, QK_SCALE)
                k = torch.empty(b, g, length, d, dtype=dt, device=dev).uniform_(-QK_SCALE, QK_SCALE)
                v = torch.empty(b, g, length, d, dtype=dt, device=dev).uniform_(-1.0, 1.0)
                if g_stored != g:
                    k = k.repeat_interleave(h // g, dim=1)
                    v = v.repeat_interleave(h // g, dim=1)
                sets.append((q, k, v))
            causal = a.phase == "prefill"

            def call(i):
                q, k, v = sets[i % copies]
                if native_gqa:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            try:
                with pinned():
                    for i in range(a.warmup):
                        call(i)
                    ev = [torch.cuda.Event(enable_timing=True) for _ in range(a.reps + 1)]
                    ev[0].record()
                    for i in range(a.reps):
                        call(i)
                        ev[i + 1].record()
                    torch.cuda.synchronize()
            except RuntimeError as e:
                log(f"skipped b={b} len={length}: the {a.sdpa_backend} backend refused it ({e})")
                continue
            t = [ev[i].elapsed_time(ev[i + 1]) * 1e3 for i in range(a.reps)]
            med = statistics.median(t)
            byts, flops = counts(a.phase, b, length, h, g, d, es)
            tbps = byts / (med * 1e-6) / 1e12
            tflops = flops / (med * 1e-6) / 1e12
            if a.phase == "decode":
                pct, roof = 100.0 * tbps * 1e3 / gbps, f"copy {gbps:.0f} GB/s measured"
            else:
                pct, roof = 100.0 * tflops / a.peak_tflops, f"{a.peak_tflops:g} TFLOP/s nominal"
            w.writerow({
                "fdpp_version": f"torch-{torch.__version__}",
                "git_commit": f"cuda-{torch.version.cuda}",
                "device": name,
                "backend": "torch",
                "phase": a.phase,
                "dtype": a.dtype,
                "heads": h,
                "kv_heads": g,
                "head_dim": d,
                "page_size": 0,
                "batch": b,
                "kv_len": length,
                "variant": "sdpa",
                "scheme": scheme,
                "samples": a.reps,
                "median_us": f"{med:.3f}",
                "min_us": f"{min(t):.3f}",
                "max_us": f"{max(t):.3f}",
                "bytes": byts,
                "flops": flops,
                "tbps": f"{tbps:.6g}",
                "tflops": f"{tflops:.6g}",
                "roofline_pct": f"{pct:.4g}",
                "roofline": roof,
            })
            out.flush()
            del sets
            torch.cuda.empty_cache()
    if a.out:
        out.close()


if __name__ == "__main__":
    main()
