#!/usr/bin/env python3
"""Summarise the Hopper prefill's per-block timeline (`--set hopper_diag=3`).

    FDPP_HOPPER_TRACE_OUT=trace.tsv fdpp bench attention --backend cuda --phase prefill \\
        --set hopper_diag=3 --variant sync --batch 8 --kv-len 1024 --reps 2 --warmup 1
    scripts/prefill_trace.py trace.tsv [--launch N] [--ghz 1.755]

Each line of the file is one consumer warpgroup of one block (prefill_hopper.rs `dump_trace`):
launch, block, SM, warpgroup, key tiles, head, first position, global timer at entry (ns), then
SM clocks from entry: Q in, the first K request (thread 0's at entry, or the producer's), first
K in, walk done, O stored, the producer's walk begun, block entry in, block entry asked for.

Prints, for the chosen launch (default: the last), the medians of each milestone by key-tile
count and warpgroup, and per block (both warpgroups) the share of the SM cycles spent before K of
the first tile is in, in the walk and after it. `--ghz` converts cycles to µs (the SM clock under
load; estimate it from the ratio of a block's cycles to the global-timer gap to the next block
on its SM, which this prints as well).
"""
import argparse
import collections
import statistics as st
import sys

FIELDS = ["launch", "block", "sm", "wg", "tiles", "head", "pos0", "t_global", "q_in", "k_issue",
          "k0_in", "walk_done", "stored", "walk_begun", "entry_in", "entry_asked"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--launch", type=int, default=None, help="launch index (default: the last)")
    ap.add_argument("--ghz", type=float, default=1.755, help="SM clock for µs figures")
    a = ap.parse_args()
    rows = []
    with open(a.trace) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.split("\t")
            if len(parts) != len(FIELDS):
                sys.exit(f"{a.trace}:{n}: {len(parts)} fields, expected {len(FIELDS)} (a trace of another fdpp version?)")
            rows.append(dict(zip(FIELDS, map(int, parts))))
    if not rows:
        sys.exit(f"{a.trace}: no records (was the run made with --set hopper_diag=3 and FDPP_HOPPER_TRACE_OUT?)")
    launch = max(r["launch"] for r in rows) if a.launch is None else a.launch
    rows = [r for r in rows if r["launch"] == launch]
    if not rows:
        sys.exit(f"{a.trace}: no records of launch {launch}")
    print(f"launch {launch}: {len(rows)} records")
    cols = ["entry_asked", "entry_in", "walk_begun", "k_issue", "q_in", "k0_in", "walk_done", "stored"]
    print("| tiles | wg | blocks | " + " | ".join(cols) + " | walk / tile |")
    print("|" + "---|" * (len(cols) + 4))
    by = collections.defaultdict(list)
    for r in rows:
        by[(r["tiles"], r["wg"])].append(r)
    for (t, w), rs in sorted(by.items()):
        med = {c: st.median(r[c] for r in rs) for c in cols}
        per = (med["walk_done"] - med["k0_in"]) / max(t, 1)
        print(f"| {t} | {w} | {len(rs)} | " + " | ".join(f"{med[c]:.0f}" for c in cols) + f" | {per:.0f} |")
    blocks = collections.defaultdict(dict)
    for r in rows:
        blocks[r["block"]][r["wg"]] = r
    pre = walk = post = 0
    for wgs in blocks.values():
        rs = list(wgs.values())
        k0 = min(r["k0_in"] for r in rs)
        done = max(r["walk_done"] for r in rs)
        end = max(r["stored"] for r in rs)
        pre, walk, post = pre + k0, walk + done - k0, post + end - done
    tot = pre + walk + post
    n = len(blocks)
    print(f"\nper block (cycles, mean): before K of the first tile {pre / n:.0f} ({100 * pre / tot:.0f} %), "
          f"walk {walk / n:.0f} ({100 * walk / tot:.0f} %), after the walk {post / n:.0f} ({100 * post / tot:.0f} %); "
          f"{tot / n / a.ghz / 1e3:.2f} µs a block at {a.ghz} GHz")
    # cycles per ns between consecutive blocks of one SM: at most the SM clock (no gap between them)
    per_sm = collections.defaultdict(list)
    for wgs in blocks.values():
        r = wgs.get(0) or next(iter(wgs.values()))
        per_sm[r["sm"]].append((r["t_global"], max(x["stored"] for x in wgs.values())))
    ratios = []
    for bl in per_sm.values():
        bl.sort()
        ratios += [c / (b - a_) for (a_, c), (b, _) in zip(bl, bl[1:]) if b > a_]
    if ratios:
        ratios.sort()
        print(f"block cycles / ns to the next block on its SM: p90 {ratios[9 * len(ratios) // 10]:.3f}, "
              f"max {ratios[-1]:.3f} (the SM clock in GHz is about the upper end)")


if __name__ == "__main__":
    main()
