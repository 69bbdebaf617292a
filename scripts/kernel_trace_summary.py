#!/usr/bin/env python3
"""Summarise a kernel timeline from scripts/kernel_trace.sh: where a decode step's time goes.

Kernels are ordered by start. A kernel's share of the step is how far it moves the completion
front: end_i - max(end of every earlier kernel), or 0 when it ends inside an earlier one. Under
programmatic dependent launch a kernel starts before its predecessor ends, so durations overlap
and do not add up; these shares do (plus the idle gaps, where nothing runs).

Steps are cut at the kernel named by --step-end (default: the greedy argmax), and the summary
covers the last --steps of them (the decode steps; the prefill comes first). A multi-GPU trace
(tensor parallelism) is summarised for one device (--device, default the lowest id).

--prefill N summarises the last prefill instead, layer by layer: its last N kernels named
*--attn* (default attn_prefill, one per layer) cut it into layers, each from the kernel after
one attention to the next attention (so the kernels of a layer print in launch order: O, FFN1,
FFN2, the next QKV, the attention), with each position's mean share and duration over the N - 1
whole layers, and the copies and memsets in the burst (each one between two chained kernels
ends their overlap). With --start US it also lists what ran in the US microseconds before the
prefill's first layer's first kernel: the device's copies, memsets and kernels, and, in a trace
taken with FDPP_TRACE_API=1, the host's driver API calls (device 65535): where the start of a
time to first token goes.
"""
import argparse
import csv
import collections
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--step-end", default="argmax", help="substring of the kernel that ends a step")
    ap.add_argument("--steps", type=int, default=16, help="summarise the last N steps")
    ap.add_argument("--device", type=int, help="the GPU to summarise (default: the lowest id in the trace)")
    ap.add_argument("--prefill", type=int, metavar="N", help="summarise the last prefill of N layers instead")
    ap.add_argument("--attn", default="attn_prefill", help="substring of the prefill's attention kernel (--prefill)")
    ap.add_argument("--start", type=float, metavar="US",
                    help="with --prefill: list the US microseconds before its first kernel, host API calls included")
    a = ap.parse_args()
    with open(a.csv) as f:
        rows = list(csv.DictReader(f))
    api = [(int(r["start_ns"]), int(r["end_ns"]), r["name"][:48]) for r in rows if int(r.get("device") or 0) == API_DEVICE]
    rows = [r for r in rows if int(r.get("device") or 0) != API_DEVICE]
    # Traces written before the device column have none: one GPU.
    devs = sorted({int(r.get("device") or 0) for r in rows})
    dev = a.device if a.device is not None else (devs[0] if devs else 0)
    if len(devs) > 1:
        print(f"devices in the trace: {devs}; summarising device {dev}")
    ks = [(int(r["start_ns"]), int(r["end_ns"]), r["name"][:48]) for r in rows if int(r.get("device") or 0) == dev]
    ks.sort()
    if not ks:
        sys.exit(f"{a.csv}: no kernels recorded")
    if a.prefill:
        prefill_layers(a, ks, api)
        return
    ends = [i for i, k in enumerate(ks) if a.step_end in k[2]]
    if len(ends) < 2:
        sys.exit(f"{a.csv}: fewer than two kernels named *{a.step_end}*: no whole step to summarise")
    ends = ends[-(a.steps + 1):]
    share = collections.defaultdict(float)
    dur = collections.defaultdict(float)
    count = collections.Counter()
    idle = 0.0
    total = 0.0
    for s0, s1 in zip(ends, ends[1:]):
        front = ks[s0][1]
        total += ks[s1][1] - front
        for st, en, name in ks[s0 + 1:s1 + 1]:
            if st > front:
                idle += st - front
                front = st
            share[name] += max(0, en - front)
            front = max(front, en)
            dur[name] += en - st
            count[name] += 1
    n = len(ends) - 1
    print(f"{n} steps, {total / n / 1e3:.1f} us per step; idle (nothing running) {idle / n / 1e3:.1f} us per step")
    print(f"| kernel | launches per step | share of the step (us) | mean duration (us) |")
    print("|---|---|---|---|")
    for name in sorted(share, key=lambda k: -share[k]):
        c = count[name]
        print(f"| {name} | {c / n:.0f} | {share[name] / n / 1e3:.1f} | {dur[name] / c / 1e3:.2f} |")


def prefill_layers(a, rows, api):
    """Per-layer shares of the last prefill (see --prefill), and with --start what preceded it."""
    mem = [r for r in rows if r[2].startswith(("memcpy_", "memset_"))]
    ks = [r for r in rows if not r[2].startswith(("memcpy_", "memset_"))]
    att = [i for i, k in enumerate(ks) if a.attn in k[2]]
    if len(att) < max(a.prefill, 2):
        sys.exit(f"{a.csv}: {len(att)} kernels named *{a.attn}*, fewer than --prefill {a.prefill}")
    att = att[-a.prefill:]
    span = att[1] - att[0]
    if any(j - i != span for i, j in zip(att, att[1:])):
        sys.exit(f"{a.csv}: the last {a.prefill} attention launches are not spaced evenly: is --prefill more "
                 "than the model's layers (the window then reaches into an earlier prefill)?")
    share = [0.0] * span
    idle = [0.0] * span
    dur = [0.0] * span
    names = [ks[att[0] + 1 + p][2] for p in range(span)]
    for i in att[:-1]:
        front = ks[i][1]
        for p in range(span):
            st, en, _ = ks[i + 1 + p]
            # How far it moves the completion front, the idle gap before it included.
            share[p] += max(0, en - front)
            idle[p] += max(0, st - front)
            front = max(front, en)
            dur[p] += en - st
    n = len(att) - 1
    total = (ks[att[-1]][1] - ks[att[0]][1]) / n
    b0, b1 = ks[att[0]][0], ks[att[-1]][1]
    inside = [m for m in mem if b0 <= m[0] <= b1]
    print(f"{n} whole layers, {total / 1e3:.1f} us per layer; {len(inside)} copies or memsets in the burst"
          + (f" ({', '.join(sorted({m[2] for m in inside}))})" if inside else ""))
    print("| position | kernel | share of the layer (us) | of it idle before the kernel | mean duration (us) |")
    print("|---|---|---|---|---|")
    for p in range(span):
        print(f"| {p + 1} | {names[p]} | {share[p] / n / 1e3:.1f} | {idle[p] / n / 1e3:.1f} | {dur[p] / n / 1e3:.1f} |")
    if a.start:
        # The window's first attention belongs to layer 0 when --prefill is the model's layer
        # count; the layer's first kernel is the one launched right before it (its QKV GEMM).
        first = ks[att[0] - 1] if att[0] > 0 else ks[att[0]]
        t1 = first[0]
        t0 = t1 - int(a.start * 1e3)
        seen = sorted([(st, en, nm, "device") for st, en, nm in rows if t0 <= st <= t1]
                      + [(st, en, nm, "host") for st, en, nm in api if t0 <= st <= t1])
        print(f"\nthe {a.start:g} us before the prefill's first kernel ({first[2]}), us before it:")
        print("| side | starts | takes (us) | what |")
        print("|---|---|---|---|")
        for st, en, nm, side in seen:
            print(f"| {side} | -{(t1 - st) / 1e3:.1f} | {(en - st) / 1e3:.1f} | {nm} |")
        if not api:
            print("(no host API calls in the trace: take it with FDPP_TRACE_API=1)")


# scripts/kernel_trace.c writes driver API calls (FDPP_TRACE_API=1) as rows of this device.
API_DEVICE = 65535


if __name__ == "__main__":
    main()
