#!/usr/bin/env python3
"""Peer measurement on the GPU machine: torch's fp16 GEMM (F.linear, i.e. x @ W.T through cuBLAS/
cuBLASLt) on a model's four linear shapes, timed the way fdpp times (CUDA events, back-to-back
runs, weights rotated over enough copies to defeat L2, median). Lets a report compare fdpp's own
cuBLAS call with what a PyTorch user gets, in the same session.

usage: scripts/torch_gemm_peer.py [--shapes qkv:4096:12288,...] [--m 1,2,4,8,16] [--reps 50]
"""
import argparse
import statistics

import torch
import torch.nn.functional as F

LLAMA2_7B = "qkv:4096:12288,o:4096:4096,ffn1:4096:22016,ffn2:11008:4096"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=LLAMA2_7B, help="name:K:N,...")
    ap.add_argument("--m", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    print(f"device {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, L2 {l2 >> 20} MiB")
    print("shape,K,N,M,median_us,min_us,max_us")
    for spec in a.shapes.split(","):
        name, k, n = spec.split(":")
        k, n = int(k), int(n)
        copies = max(1, min(8, -(-3 * l2 // (n * k * 2))))
        ws = [torch.empty(n, k, dtype=torch.float16, device=dev).uniform_(-1, 1) for _ in range(copies)]
        for m in [int(v) for v in a.m.split(",")]:
            xs = [torch.empty(m, k, dtype=torch.float16, device=dev).uniform_(-1, 1) / k**0.5 for _ in range(copies)]
            for i in range(5):
                F.linear(xs[i % copies], ws[i % copies])
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(a.reps + 1)]
            ev[0].record()
            for i in range(a.reps):
                F.linear(xs[i % copies], ws[i % copies])
                ev[i + 1].record()
            torch.cuda.synchronize()
            t = [ev[i].elapsed_time(ev[i + 1]) * 1e3 for i in range(a.reps)]
            print(f"{name},{k},{n},{m},{statistics.median(t):.2f},{min(t):.2f},{max(t):.2f}")


if __name__ == "__main__":
    main()
