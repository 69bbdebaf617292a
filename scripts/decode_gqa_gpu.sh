#!/usr/bin/env bash
# Issue #19: grouped-query decode against torch SDPA (default and cuDNN backends; the faster is
# the bar) and against the card's read ceiling at each point's own bytes, all in one call.
#
#   bench: `bench attention --phase decode` d128 f16 for each shape of SHAPES at BATCH x LENS,
#          sync and async, for $FDPP and (if present) $BASE, with both SDPA peers' rows.
#   read:  scripts/read_bw.cu's `sizes` mode at the K+V bytes of every point (a plain read of
#          exactly those bytes, launch by launch as the bench times a decode call).
#   check: `fdpp check --backend cuda --op attention` (CHECK_CASE: only those cases; SEED: inputs).
#   san:   compute-sanitizer memcheck, racecheck, synccheck on small reference-checked bench
#          calls that split a row more than 64 ways (the combine's old limit) and on the
#          latency path, and on splits of 512+ keys (the async kernel's prefetch before its wait).
#
# Usage: FDPP=.carry/fdpp BASE=.carry/fdpp-base scripts/decode_gqa_gpu.sh [OUT_DIR]
#   STEPS (default bench,read), SHAPES ("32/8 32/4"), BATCH (1,4,16,64), LENS (4096,32768,131072),
#   CFGS (default "new base"): new = $FDPP, base = $BASE, NAME=K=V = $FDPP with `--set K=V`.
#   Exit status 1 when a check, a sanitizer run or a bench variant's reference check fails.
set -uo pipefail
ROOT="${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
FDPP="${FDPP:-$ROOT/.carry/fdpp}"
BASE="${BASE:-}"
OUT="${1:-${OUT:-/tmp/decode_gqa}}"
PY="${PYTHON:-python3}"
STEPS="${STEPS:-bench,read}"
SHAPES="${SHAPES:-32/8 32/4}"
BATCH="${BATCH:-1,4,16,64}"
LENS="${LENS:-4096,32768,131072}"
mkdir -p "$OUT"
cd "$ROOT"
export PATH=/usr/local/cuda/bin:$PATH
fail=0
has() { [[ ",$STEPS," == *",$1,"* ]]; }
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
stamp "== machine"; nvidia-smi -L || true

if has read; then
    nvcc -O3 -arch=sm_90a scripts/read_bw.cu -o /tmp/read_bw >"$OUT/read_bw-build.log" 2>&1 &
    nvcc_pid=$!
fi
CFGS="${CFGS:-new base}"
bins=(); cfgs=(); sets=()
for c in $CFGS; do
    case $c in
        base) [[ -n "$BASE" && -x "$BASE" ]] || continue; bins+=("$BASE"); sets+=("") ;;
        *=*) bins+=("$FDPP"); sets+=("${c#*=}"); c=${c%%=*} ;;
        *) bins+=("$FDPP"); sets+=("") ;;
    esac
    cfgs+=("$c")
done
# Configuration i's binary with its arguments.
run_cfg() {
    local i=$1; shift
    timeout 300 "${bins[$i]}" "$@" ${sets[$i]:+--set "${sets[$i]}"}
}

if has bench; then
    # Warm the kernel caches (NVRTC) of the modules used, in parallel.
    warm=()
    for i in "${!bins[@]}"; do
        for shape in $SHAPES; do
            run_cfg "$i" bench attention --backend cuda --phase decode --heads "${shape%/*}" --kv-heads "${shape#*/}" \
                --batch 1 --kv-len 64 --variant sync,async --reps 1 --warmup 0 >/dev/null 2>&1 &
            warm+=($!)
        done
    done
    wait "${warm[@]}"
    stamp "caches warm"
    for shape in $SHAPES; do
        h=${shape%/*}; g=${shape#*/}; tag="g$g"
        : >"$OUT/peer-$tag.csv"
        for be in default cudnn; do
            if timeout 300 "$PY" scripts/torch_attention_peer.py --phase decode --heads "$h" --kv-heads "$g" \
                --head-dim 128 --dtype f16 --batch "$BATCH" --kv-len "$LENS" --sdpa-backend "$be" \
                --out "$OUT/peer-$tag-$be.csv" 2>"$OUT/peer-$tag-$be.err"; then
                if [[ -s "$OUT/peer-$tag.csv" ]]; then tail -n +2 "$OUT/peer-$tag-$be.csv" >>"$OUT/peer-$tag.csv"
                else cat "$OUT/peer-$tag-$be.csv" >>"$OUT/peer-$tag.csv"; fi
            else echo "peer $tag $be FAILED"; tail -n 3 "$OUT/peer-$tag-$be.err"; fi
        done
        stamp "peers $shape done"
        peer=(--format csv); [[ -s "$OUT/peer-$tag.csv" ]] && peer+=(--peer "$OUT/peer-$tag.csv")
        for i in "${!bins[@]}"; do
            cfg=${cfgs[$i]}
            stamp "== bench $shape $cfg"
            run_cfg "$i" bench attention --backend cuda --phase decode --heads "$h" --kv-heads "$g" \
                --head-dim 128 --batch "$BATCH" --kv-len "$LENS" --variant sync,async "${peer[@]}" \
                --out "$OUT/bench-$tag-$cfg" >"$OUT/bench-$tag-$cfg.csv" 2>"$OUT/bench-$tag-$cfg.err" \
                || { echo "bench $tag $cfg FAILED"; tail -n 5 "$OUT/bench-$tag-$cfg.err"; fail=1; }
            if grep -q "not timed" "$OUT/bench-$tag-$cfg.err"; then
                echo "bench $tag $cfg: a variant failed its reference check"; fail=1
            fi
        done
    done
fi

if has read; then
    wait "$nvcc_pid" || { echo "read_bw build FAILED"; tail -n 20 "$OUT/read_bw-build.log"; }
    if [[ -x /tmp/read_bw ]]; then
        # K + V bytes of each point: batch · kv_len · kv_heads · 128 dims · 2 bytes · 2.
        sizes=$("$PY" - "$SHAPES" "$BATCH" "$LENS" <<'PY'
import sys
shapes, batch, lens = sys.argv[1].split(), sys.argv[2].split(","), sys.argv[3].split(",")
s = sorted({int(b) * int(l) * int(sh.split("/")[1]) * 512 for sh in shapes for b in batch for l in lens})
print(",".join(str(x) for x in s if x <= 9 << 30))
PY
)
        stamp "== read ceilings at $sizes"
        timeout 300 /tmp/read_bw sizes "$sizes" >"$OUT/read-sizes.csv" 2>"$OUT/read-sizes.err" \
            || { echo "read_bw sizes FAILED"; tail -n 5 "$OUT/read-sizes.err"; }
        cat "$OUT/read-sizes.csv"
    fi
fi

if has bench; then
    "$PY" - "$OUT" "${cfgs[*]}" $SHAPES <<'PY' | tee "$OUT/summary.md"
import csv, sys
out, cfgs, shapes = sys.argv[1], sys.argv[2].split(), sys.argv[3:]
def rows(p):
    try: return list(csv.DictReader(l for l in open(p) if not l.startswith("#")))
    except OSError: return []
ceil = {int(r["bytes"]): float(r["ceiling_tbs"]) for r in rows(f"{out}/read-sizes.csv")}
for shape in shapes:
    g = int(shape.split("/")[1]); tag = f"g{g}"
    runs = {c: rows(f"{out}/bench-{tag}-{c}.csv") for c in cfgs}
    ref = runs[cfgs[0]]
    if not ref: print(f"{shape}: no rows"); continue
    print(f"\n{shape} d128 f16 ({ref[0].get('device','')}): TB/s sync/async, SDPA = the faster backend, "
          "ceiling = plain read of the point's K+V bytes\n")
    print("| batch · kv | " + " | ".join(cfgs) + " | SDPA | ceiling | 1.05·SDPA | "
          + " | ".join(f"{c}/SDPA" for c in cfgs) + " |")
    print("|---" * (2 * len(cfgs) + 4) + "|")
    for b, l in sorted({(int(r["batch"]), int(r["kv_len"])) for r in ref}):
        def tb(rs, v):
            x = [float(r["tbps"]) for r in rs if (int(r["batch"]), int(r["kv_len"])) == (b, l) and r["variant"] == v]
            return max(x) if x else float("nan")
        sd = tb(ref, "sdpa"); c = ceil.get(b * l * g * 512, float("nan"))
        cells = [f"{tb(runs[k], 'sync'):.2f}/{tb(runs[k], 'async'):.2f}" for k in cfgs]
        ratios = [f"{max(tb(runs[k], 'sync'), tb(runs[k], 'async')) / sd:.3f}x" for k in cfgs]
        flag = " (unreachable)" if 1.05 * sd > c else ""
        print(f"| {b} · {l} | " + " | ".join(cells) + f" | {sd:.2f} | {c:.3f} | {1.05 * sd:.2f}{flag} | "
              + " | ".join(ratios) + " |")
PY
fi

if has check; then
    # The full list takes more than 4 minutes on the H100 machine's CPU reference (long contexts).
    stamp "== check --op attention --case ${CHECK_CASE:-(all)}"
    timeout "${CHECK_TIMEOUT:-500}" "$FDPP" check --backend cuda --op attention ${CHECK_CASE:+--case "$CHECK_CASE"} \
        ${SEED:+--seed "$SEED"} --format csv >"$OUT/check-attention.csv" 2>"$OUT/check-attention.err" \
        || { echo "check --op attention FAILED"; fail=1; }
    tail -n 2 "$OUT/check-attention.err"
fi

if has san; then
    SAN="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
    runs=(
        "g2x256|--heads 16 --kv-heads 2 --batch 1 --kv-len 20011"
        "g4x132|--heads 32 --kv-heads 4 --batch 1 --kv-len 9001"
        "g3d64|--heads 9 --kv-heads 3 --batch 1 --kv-len 12001 --head-dim 64"
        "lat|--heads 32 --kv-heads 4 --batch 1 --kv-len 8191"
        "pf|--heads 32 --kv-heads 8 --batch 1 --kv-len 33001"
    )
    for tool in memcheck racecheck synccheck; do
        for r in "${runs[@]}"; do
            IFS='|' read -r name args <<<"$r"
            stamp "== $tool $name"
            # shellcheck disable=SC2086
            timeout 200 "$SAN" --tool "$tool" --error-exitcode 9 "$FDPP" bench attention --backend cuda \
                --phase decode $args --variant sync,async --reps 1 --warmup 0 --format csv \
                --out "$OUT/san-$tool-$name" >"$OUT/san-$tool-$name.csv" 2>"$OUT/san-$tool-$name.err" \
                || { echo "$tool $name FAILED"; fail=1; }
            # The sanitizer's summary goes to stdout (the csv file), fdpp's messages to stderr.
            grep -hE "ERROR SUMMARY|RACECHECK SUMMARY|not timed" "$OUT/san-$tool-$name.csv" \
                "$OUT/san-$tool-$name.err" | head -n 3
        done
    done
fi
stamp "done (fail=$fail)"
exit "$fail"
