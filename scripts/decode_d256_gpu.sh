#!/usr/bin/env bash
# Issue #19, head_dim 256 on the tensor-core decode pass (session 13): what CI cannot run.
#
#   a. Correctness: `fdpp check --backend cuda --op attention` (the full list: every ratio of the
#      tensor-core pass at d64/d128/d256, odd kv_lens, ragged batches, forced recomputes, long
#      contexts), then the d256 cases again with `decode_tc=1` (ratio 1 on the tensor-core pass
#      too), with `decode_tc=0` (the CUDA-core pass) and with fresh inputs (another seed).
#      Outputs are poisoned with a guard behind them.
#   b. compute-sanitizer memcheck, racecheck and synccheck on small reference-checked bench calls
#      that run the d256 tensor-core entries: the latency path (batch 1-3, short splits, async),
#      the bandwidth path at 4 and 8 heads per block, ratio 5 (a partial chunk of the team), both
#      paths forced for sync; memcheck also on `check --quick --case d256`.
#   c. Speed: `bench attention --phase decode` 32/8 at d256 and d128, batch 1,4,16 x kv_len
#      4096,32768 (d128 also 131072: issue #19's 2.9 TB/s at batch 1), sync and async, against
#      torch SDPA (default and cuDNN backends, the faster is the bar) in the same call; in the same
#      call, for the A/B: the CUDA-core pass (`decode_tc=0`, session 12's d256 kernels) and the
#      tensor-core pass's staged form (FDPP_DECODE_TC_STAGES=2 and 3: K/V through shared memory by
#      cp.async); 16/4 d256 (session 12's shape) and bf16.
#   The staged form is also checked: `check --op attention` and the sanitizers with
#   FDPP_DECODE_TC_STAGES=3 (and check with 2).
#
# Usage: FDPP=path/to/fdpp scripts/decode_d256_gpu.sh [OUT_DIR]
#   OUT_DIR defaults to $OUT (the device tool's output folder), else /tmp/decode_d256.
#   STEPS=check,san,bench (default: all three) picks sections; PYTHON=python3 runs the peer.
#   The device tool stops a command at 10 minutes: run the sections as three calls
#   (STEPS=check, STEPS=san, STEPS=bench), each about 5-10 minutes, on the same warm machine.
#   Exit status 1 when a check, a sanitizer run or a bench variant's reference check fails.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FDPP="${FDPP:-$ROOT/target/release/fdpp}"
OUT="${1:-${OUT:-/tmp/decode_d256}}"
PY="${PYTHON:-python3}"
STEPS="${STEPS:-check,san,bench}"
mkdir -p "$OUT"
cd "$ROOT"
fail=0
has() { [[ ",$STEPS," == *",$1,"* ]]; }
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }

stamp "== machine"
nvidia-smi -L || true
"$FDPP" --version || { echo "no fdpp at $FDPP"; exit 2; }

if has check; then
    stamp "== (a) check --op attention (full list, decode_tc=auto)"
    if ! timeout 900 "$FDPP" check --backend cuda --op attention --format csv >"$OUT/check-attention.csv" \
        2>"$OUT/check-attention.err"; then
        echo "check --op attention: FAILED"; fail=1
    fi
    tail -n 3 "$OUT/check-attention.err"
    stamp "== (a) the d256 cases with decode_tc=1 (ratio 1 on the tensor-core pass too)"
    if ! timeout 600 "$FDPP" check --backend cuda --op attention --case d256 --set decode_tc=1 --format csv \
        >"$OUT/check-d256-tc1.csv" 2>"$OUT/check-d256-tc1.err"; then
        echo "check --case d256 decode_tc=1: FAILED"; fail=1
    fi
    tail -n 3 "$OUT/check-d256-tc1.err"
    stamp "== (a) the d256 cases with decode_tc=0 (the CUDA-core pass, which auto no longer takes for GQA)"
    if ! timeout 600 "$FDPP" check --backend cuda --op attention --case d256 --set decode_tc=0 --format csv \
        >"$OUT/check-d256-tc0.csv" 2>"$OUT/check-d256-tc0.err"; then
        echo "check --case d256 decode_tc=0: FAILED"; fail=1
    fi
    tail -n 3 "$OUT/check-d256-tc0.err"
    SEED2=$(( (RANDOM << 15) | RANDOM ))
    stamp "== (a) the d256 cases with fresh inputs (seed $SEED2)"
    if ! timeout 600 "$FDPP" check --backend cuda --op attention --case d256 --seed "$SEED2" --set decode_tc=1 --format csv \
        >"$OUT/check-d256-seed$SEED2.csv" 2>"$OUT/check-d256-seed.err"; then
        echo "check --case d256 --seed $SEED2: FAILED"; fail=1
    fi
    tail -n 3 "$OUT/check-d256-seed.err"
    for st in 3 2; do
        stamp "== (a) check --op attention with FDPP_DECODE_TC_STAGES=$st (the staged form)"
        if ! FDPP_DECODE_TC_STAGES=$st timeout 900 "$FDPP" check --backend cuda --op attention --format csv \
            >"$OUT/check-attention-stages$st.csv" 2>"$OUT/check-attention-stages$st.err"; then
            echo "check --op attention FDPP_DECODE_TC_STAGES=$st: FAILED"; fail=1
        fi
        tail -n 3 "$OUT/check-attention-stages$st.err"
    done
fi

if has san; then
    SAN="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
    if [[ ! -x "$SAN" ]]; then
        echo "compute-sanitizer not found: section (b) not run"; fail=1
    else
        # name | env | bench arguments (decode_tc=auto keeps d256 off the tensor-core pass until
        # this run has checked it, so the d256 runs ask for it). --reps 1 --warmup 0: the
        # variants are checked against the reference (nmse column) before the single timed run.
        runs=(
            "lat16x2|FDPP_DECODE_PATH= FDPP_DECODE_TC=1|--heads 16 --kv-heads 2 --batch 1,3 --kv-len 97,1001 --head-dim 256"
            "bw32x8|FDPP_DECODE_PATH= FDPP_DECODE_TC=1|--heads 32 --kv-heads 8 --batch 4 --kv-len 3001 --head-dim 256"
            "r5|FDPP_DECODE_PATH= FDPP_DECODE_TC=1|--heads 40 --kv-heads 8 --batch 16 --kv-len 257 --head-dim 256"
            "lat32x4|FDPP_DECODE_PATH=latency FDPP_DECODE_TC=1|--heads 32 --kv-heads 4 --batch 2 --kv-len 333 --head-dim 256"
            "bw16x2|FDPP_DECODE_PATH=bandwidth FDPP_DECODE_TC=1|--heads 16 --kv-heads 2 --batch 1 --kv-len 97 --head-dim 256"
            "st3d256|FDPP_DECODE_TC_STAGES=3 FDPP_DECODE_TC=1|--heads 32 --kv-heads 4 --batch 3 --kv-len 1001 --head-dim 256"
            "st3d128|FDPP_DECODE_TC_STAGES=3|--heads 32 --kv-heads 8 --batch 4 --kv-len 2049 --head-dim 128"
            "st2d64|FDPP_DECODE_TC_STAGES=2|--heads 40 --kv-heads 8 --batch 2 --kv-len 777 --head-dim 64"
        )
        for tool in memcheck racecheck synccheck; do
            for r in "${runs[@]}"; do
                IFS='|' read -r name envs args <<<"$r"
                stamp "== (b) $tool $name ($envs $args)"
                # shellcheck disable=SC2086
                if ! env $envs timeout 600 "$SAN" --tool "$tool" --error-exitcode 9 "$FDPP" bench attention \
                    --backend cuda --phase decode $args --variant sync,async --reps 1 --warmup 0 \
                    --format csv --out "$OUT/san-$tool-$name" >"$OUT/san-$tool-$name.csv" 2>"$OUT/san-$tool-$name.err"; then
                    echo "$tool $name: FAILED"; fail=1
                fi
                grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Error" "$OUT/san-$tool-$name.err" | head -n 3
                # A variant whose output differs from the reference is reported and not timed.
                if grep -q "not timed" "$OUT/san-$tool-$name.err"; then
                    echo "$tool $name: a variant failed its reference check"; grep -A4 "not timed" "$OUT/san-$tool-$name.err"; fail=1
                fi
            done
        done
        stamp "== (b) memcheck on check --quick --case d256"
        if ! timeout 600 "$SAN" --tool memcheck --error-exitcode 9 "$FDPP" check --backend cuda --op attention --quick \
            --case d256 --set decode_tc=1 --format csv >"$OUT/san-memcheck-check.csv" 2>"$OUT/san-memcheck-check.err"; then
            echo "memcheck check --quick --case d256: FAILED"; fail=1
        fi
        grep -E "ERROR SUMMARY|passed" "$OUT/san-memcheck-check.err" | head -n 3
    fi
fi

# One shape: the SDPA peer (default and cuDNN backends, one --peer file), then fdpp with the
# pass chosen by default (tcauto), with decode_tc=0 (tc0: the CUDA-core pass) and with the staged
# form of the tensor-core pass (st2, st3), all in this call.
bench_shape() { # tag heads kv_heads head_dim dtype batches lens configs
    local tag=$1 h=$2 g=$3 d=$4 dt=$5 bs=$6 ls=$7 configs=$8
    stamp "== (c) $tag: $h/$g d$d $dt batch $bs kv_len $ls"
    : >"$OUT/peer-$tag.csv"
    for be in default cudnn; do
        if timeout 600 "$PY" scripts/torch_attention_peer.py --phase decode --heads "$h" --kv-heads "$g" --head-dim "$d" \
            --dtype "$dt" --batch "$bs" --kv-len "$ls" --sdpa-backend "$be" --out "$OUT/peer-$tag-$be.csv" \
            2>"$OUT/peer-$tag-$be.err"; then
            if [[ -s "$OUT/peer-$tag.csv" ]]; then tail -n +2 "$OUT/peer-$tag-$be.csv" >>"$OUT/peer-$tag.csv"
            else cat "$OUT/peer-$tag-$be.csv" >>"$OUT/peer-$tag.csv"; fi
        else
            echo "peer $tag $be: FAILED"; tail -n 3 "$OUT/peer-$tag-$be.err"
        fi
    done
    local peer=(--format csv); [[ -s "$OUT/peer-$tag.csv" ]] && peer+=(--peer "$OUT/peer-$tag.csv")
    local cfg tc st
    for cfg in $configs; do
        tc=auto; st=0
        case $cfg in tc0) tc=0 ;; tc1) tc=1 ;; st2) st=2 ;; st3) st=3 ;; esac
        # The staged form at d256 needs the tensor-core pass, which auto gives only up to d128.
        [ "$d" -gt 128 ] && [ "$st" != 0 ] && tc=1
        FDPP_DECODE_TC_STAGES=$st timeout 600 "$FDPP" bench attention --backend cuda --phase decode --heads "$h" \
            --kv-heads "$g" --head-dim "$d" --dtype "$dt" --batch "$bs" --kv-len "$ls" --variant sync,async \
            --set "decode_tc=$tc" "${peer[@]}" --out "$OUT/bench-$tag-$cfg" \
            >"$OUT/bench-$tag-$cfg.csv" 2>"$OUT/bench-$tag-$cfg.err" \
            || { echo "bench $tag $cfg: FAILED"; tail -n 3 "$OUT/bench-$tag-$cfg.err"; }
        if grep -q "not timed" "$OUT/bench-$tag-$cfg.err"; then
            echo "bench $tag $cfg: a variant failed its reference check"; grep -A6 "not timed" "$OUT/bench-$tag-$cfg.err"; fail=1
        fi
    done
}

if has bench; then
    # decode_tc=auto keeps d256 on the CUDA-core pass until this run has checked the
    # tensor-core one: the d256 shapes time it with decode_tc=1 (tc1).
    bench_shape d256 32 8 256 f16 1,4,16 4096,32768 "tc1 tc0 st2 st3"
    bench_shape d128 32 8 128 f16 1,4,16 4096,32768,131072 "tcauto tc0 st2 st3"
    bench_shape d256r4 16 4 256 f16 1,16 32768 "tc1 tc0"
    bench_shape d256bf16 32 8 256 bf16 1,16 32768 "tc1 tc0"
    stamp "== (c) summary: TB/s fdpp sync / async (decode_tc=auto), best of decode_tc=0, of 2 and 3 stages, SDPA best"
    "$PY" - "$OUT" d256 d128 d256r4 d256bf16 <<'PY' | tee "$OUT/summary.md"
import csv, os, sys
out = sys.argv[1]
def rows(p):
    try:
        return list(csv.DictReader(open(p)))
    except OSError:
        return []
for tag in sys.argv[2:]:
    runs = {c: rows(f"{out}/bench-{tag}-{c}.csv") for c in ("tcauto", "tc1", "tc0", "st2", "st3")}
    # The tensor-core pass: by default up to d128, asked for (decode_tc=1) at d256.
    auto = runs["tcauto"] or runs["tc1"]
    if not auto:
        print(f"{tag}: no bench rows"); continue
    r0 = auto[0]
    print(f"\n{tag}: {r0['heads']}/{r0['kv_heads']} d{r0['head_dim']} {r0['dtype']} ({r0['device']})\n")
    print("| batch · kv | sync | async | tc0 | st2 | st3 | SDPA | auto / SDPA | tc0 / SDPA | st2 / SDPA | st3 / SDPA |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    keys = sorted({(int(r["batch"]), int(r["kv_len"])) for r in auto})
    for b, l in keys:
        def tb(rs, *vs):
            x = [float(r["tbps"]) for r in rs if (int(r["batch"]), int(r["kv_len"])) == (b, l) and r["variant"] in vs]
            return max(x) if x else float("nan")
        s, a, sd = tb(auto, "sync"), tb(auto, "async"), tb(auto, "sdpa")
        z, s2, s3 = (tb(runs[c], "sync", "async") for c in ("tc0", "st2", "st3"))
        best = max(s, a)
        print(f"| {b} · {l} | {s:.2f} | {a:.2f} | {z:.2f} | {s2:.2f} | {s3:.2f} | {sd:.2f} | {best / sd:.2f}x"
              f" | {z / sd:.2f}x | {s2 / sd:.2f}x | {s3 / sd:.2f}x |")
PY
fi
stamp "results in $OUT"
exit "$fail"
