#!/usr/bin/env bash
# Tensor parallelism on a multi-GPU machine (issue #22): what CI cannot run.
#
#   1. `fdpp devices`: NCCL found, its version, the peer-access matrix (NCCL_NVLS_ENABLE=0 is
#      forced by fdpp itself).
#   2. Correctness: greedy tokens of `generate --tp $TP` against `--tp 1` on CUDA, on the HF
#      fixtures (real small checkpoints: GQA with KV heads split or replicated, biases, a tied
#      head, fused QKV/gate-up; the LM head split by vocabulary, the default). A fixture whose
#      heads $TP does not divide is reported as refused. Random weights cannot be compared: with
#      --tp each rank draws its own shard.
#   3. A rank made to fail mid-run (`--set tp_fail_at=1:40`): every rank must stop with its
#      error, well inside the timeout (no rank left waiting in NCCL).
#   4. The default fast paths turned off at --tp $TP: `--set tp_graphs=0` (the all-reduces run
#      eagerly, no decode graph), `--set tp_fused=0` (the unfused decode layer), both, and
#      `tp_vocab=0` (the head replicated): tokens against --tp 1 on llama-gqa. (Step 2 runs the
#      defaults: graphs with the collectives captured, the fused layer, the vocabulary split.)
#   5. Speed: `bench e2e` on $BENCH_MODEL (default llama2-13b) with random fp16 weights, batch 1
#      and 32, at --tp 1 (unless BENCH_TP1=0: a model one GPU cannot hold) and --tp $TP, then
#      --tp $TP with tp_graphs=0 tp_fused=0 (eager). Each bench's exit status and seconds are printed.
#      BENCH=0 skips the benches. TUNE=1 first runs `fdpp tune --model $BENCH_MODEL --tp $TP`
#      (the per-rank shapes, one GPU) and adds a bench at --tp $TP with that profile.
#
# Usage: TP=2 scripts/tp_gpu_check.sh [OUT_DIR]   (FDPP=path/to/fdpp, default
# target/release/fdpp; FDPP_NCCL_LIB=/path/libnccl.so.2 when NCCL is not on the loader's path or
# in pip's site-packages/nvidia/nccl/lib). Exit status 1 when any fixture's tokens differ or a
# step that must work fails.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FDPP="${FDPP:-$ROOT/target/release/fdpp}"
OUT="${1:-${OUT:-/tmp/tp_gpu_check}}"
TP="${TP:-2}"
BENCH_MODEL="${BENCH_MODEL:-llama2-13b}"
mkdir -p "$OUT"
cd "$ROOT"

echo "== machine"
nvidia-smi -L || true
nvidia-smi topo -m 2>/dev/null | head -n 8 || true
echo "== fdpp devices"
"$FDPP" devices | tee "$OUT/devices.txt"
grep -q '^nccl: available' "$OUT/devices.txt" || echo "WARNING: NCCL not found; set FDPP_NCCL_LIB"

fail=0
IDS="1,15,27,99,3,8,42,7"
# tokens FILE_A FILE_B LABEL: compare the first sequence's greedy tokens of two --json runs.
tokens() {
    python3 - "$1" "$2" "$3" <<'PY'
import json, sys
# raw_decode: NCCL_DEBUG=WARN makes NCCL print its version line on stdout after the JSON.
ld = lambda p: json.JSONDecoder().raw_decode(open(p).read())[0]
try:
    a, b = (ld(p)["seqs"][0]["tokens"] for p in sys.argv[1:3])
    graphs = ld(sys.argv[2]).get("decode_graphs")
except Exception as e:
    print(f"{sys.argv[3]}: no result ({e})"); sys.exit(1)
same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
if same is None and len(a) == len(b):
    print(f"{sys.argv[3]}: {len(a)} greedy tokens identical | decode graphs {graphs}")
else:
    print(f"{sys.argv[3]}: DIFFER at step {same}: tp1 {a} vs {b}"); sys.exit(1)
PY
}
gen() { # gen FIXTURE TP TAG [--set k=v ...]
    local fx=$1 tp=$2 tag=$3; shift 3
    timeout "${GEN_TIMEOUT:-180}" "$FDPP" generate --model "tests/fixtures/hf/$fx" --backend cuda --token-ids "$IDS" \
        --max-tokens 24 --ignore-eos --json --tp "$tp" "$@" >"$OUT/gen-$tag.json" 2>"$OUT/gen-$tag.err"
}

echo "== greedy tokens, --tp $TP vs --tp 1 (CUDA, HF fixtures)"
for fx in llama-gqa mistral qwen2-gqa6 qwen2-bias-tied chatglm2 opt; do
    if ! gen "$fx" 1 "$fx-tp1"; then
        echo "$fx --tp 1: FAILED"; tail -n 3 "$OUT/gen-$fx-tp1.err"; fail=1; continue
    fi
    if ! gen "$fx" "$TP" "$fx-tp$TP"; then
        if grep -q -- "--tp $TP" "$OUT/gen-$fx-tp$TP.err"; then
            echo "$fx --tp $TP: refused ($(grep -m1 -o 'error:.*' "$OUT/gen-$fx-tp$TP.err" | cut -c1-140))"
        else
            echo "$fx --tp $TP: FAILED"; tail -n 3 "$OUT/gen-$fx-tp$TP.err"; fail=1
        fi
        continue
    fi
    tokens "$OUT/gen-$fx-tp1.json" "$OUT/gen-$fx-tp$TP.json" "$fx --tp $TP" || fail=1
done

echo "== a rank that fails mid-run (tp_fail_at=1:40): every rank stops with its error"
t0=$(date +%s.%N)
gen llama-gqa "$TP" fail --set tp_fail_at=1:40
rc=$?
dt=$(python3 -c "import time; print(f'{time.time() - $t0:.1f}')")
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && grep -q "injected failure" "$OUT/gen-fail.err"; then
    echo "stopped with exit $rc after $dt s: $(grep -m1 -o 'error:.*' "$OUT/gen-fail.err" | cut -c1-200)"
else
    echo "FAILED: exit $rc after $dt s"; tail -n 5 "$OUT/gen-fail.err"; fail=1
fi

echo "== --tp $TP switches: tokens against --tp 1 (llama-gqa)"
for sets in "tp_graphs=0" "tp_fused=0" "tp_graphs=0 tp_fused=0" "tp_vocab=0"; do
    tag="${sets// /_}"; tag="${tag//=/}"
    args=(); for kv in $sets; do args+=(--set "$kv"); done
    if gen llama-gqa "$TP" "$tag" "${args[@]}"; then
        tokens "$OUT/gen-llama-gqa-tp1.json" "$OUT/gen-$tag.json" "$sets" || fail=1
    else
        echo "$sets: FAILED"; tail -n 5 "$OUT/gen-$tag.err"; fail=1
    fi
done

bench() { # bench TAG TP [--set k=v ...]
    local tag=$1 tp=$2; shift 2
    local t0 rc
    t0=$(date +%s)
    timeout "${BENCH_TIMEOUT:-300}" "$FDPP" bench e2e --model "$BENCH_MODEL" --random-weights --backend cuda --batch 1,32 \
        --tp "$tp" "$@" --out "$OUT/bench-$tag" 2>"$OUT/bench-$tag.err" >"$OUT/bench-$tag.md"
    rc=$?
    echo "-- $BENCH_MODEL --tp $tp $* : exit $rc after $(( $(date +%s) - t0 )) s"
    cat "$OUT/bench-$tag.md"
    if [ "$rc" -ne 0 ]; then tail -n 8 "$OUT/bench-$tag.err"; fail=1; fi
}
if [ "${BENCH:-1}" = 1 ]; then
    echo "== bench e2e $BENCH_MODEL random fp16, batch 1 and 32"
    [ "${BENCH_TP1:-1}" = 1 ] && bench tp1 1
    bench "tp$TP" "$TP"
    bench "tp$TP-eager" "$TP" --set tp_graphs=0 --set tp_fused=0
    if [ "${TUNE:-0}" = 1 ]; then
        t0=$(date +%s)
        timeout "${TUNE_TIMEOUT:-400}" "$FDPP" tune --model "$BENCH_MODEL" --tp "$TP" --backend cuda \
            --out "$OUT/$BENCH_MODEL-tp$TP.json" >"$OUT/tune.log" 2>&1
        rc=$?
        echo "-- tune --tp $TP: exit $rc after $(( $(date +%s) - t0 )) s"; tail -n 6 "$OUT/tune.log"
        if [ "$rc" -eq 0 ]; then
            bench "tp$TP-profile" "$TP" --profile "$OUT/$BENCH_MODEL-tp$TP.json"
        else
            fail=1
        fi
    fi
fi
echo "results in $OUT"
exit "$fail"
