#!/usr/bin/env bash
# Tensor parallelism on a 2-GPU machine (issue #22): what CI cannot run.
#
#   1. `fdpp devices`: NCCL found, its version (NCCL_NVLS_ENABLE=0 is forced by fdpp itself).
#   2. Correctness: greedy tokens of `generate --tp 2` against `--tp 1` on CUDA, on the HF
#      fixtures (real small checkpoints: GQA with KV heads split, one KV head replicated,
#      biases, fused QKV/gate-up). Random weights cannot be compared: with --tp each rank draws
#      its own shard.
#   3. Speed: `bench e2e --tp 1` and `--tp 2` on Llama-2-13B with random fp16 weights, batch 1
#      and 32 (TP 2 vs TP 1, issue #22's performance list).
#   4. The opt-in fast paths at --tp 2: `--set tp_graphs=1` (the all-reduces captured in the
#      decode graph), `--set tp_fused=1` (the fused decode layer, the residual all-reduced), and
#      both: tokens against --tp 1 on llama-gqa, then the 13B bench with both.
#
# Usage: scripts/tp_gpu_check.sh [OUT_DIR]   (FDPP=path/to/fdpp, default target/release/fdpp;
# FDPP_NCCL_LIB=/path/libnccl.so.2 when NCCL is not on the loader's path or in pip's
# site-packages/nvidia/nccl/lib). Exit status 1 when any fixture's tokens differ.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FDPP="${FDPP:-$ROOT/target/release/fdpp}"
OUT="${1:-${OUT:-/tmp/tp_gpu_check}}"
mkdir -p "$OUT"
cd "$ROOT"

echo "== machine"
nvidia-smi -L || true
nvidia-smi topo -m 2>/dev/null | head -n 6 || true
echo "== fdpp devices"
"$FDPP" devices | tee "$OUT/devices.txt"
grep -q '^nccl: available' "$OUT/devices.txt" || echo "WARNING: NCCL not found; set FDPP_NCCL_LIB"

echo "== greedy tokens, --tp 2 vs --tp 1 (CUDA, HF fixtures)"
fail=0
IDS="1,15,27,99,3,8,42,7"
for fx in llama-gqa mistral qwen2-gqa6 qwen2-bias-tied chatglm2 opt; do
    for tp in 1 2; do
        if ! timeout "${GEN_TIMEOUT:-180}" "$FDPP" generate --model "tests/fixtures/hf/$fx" --backend cuda --token-ids "$IDS" \
            --max-tokens 24 --ignore-eos --json --tp "$tp" >"$OUT/gen-$fx-tp$tp.json" 2>"$OUT/gen-$fx-tp$tp.err"; then
            echo "$fx --tp $tp: FAILED (see $OUT/gen-$fx-tp$tp.err)"; tail -n 3 "$OUT/gen-$fx-tp$tp.err"; fail=1
        fi
    done
    python3 - "$OUT/gen-$fx-tp1.json" "$OUT/gen-$fx-tp2.json" "$fx" <<'PY' || fail=1
import json, sys
try:
    # raw_decode: NCCL_DEBUG=WARN makes NCCL print its version line on stdout after the JSON.
    a, b = (json.JSONDecoder().raw_decode(open(p).read())[0]["seqs"][0]["tokens"] for p in sys.argv[1:3])
except Exception as e:
    print(f"{sys.argv[3]}: no result ({e})"); sys.exit(1)
same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
if same is None and len(a) == len(b):
    print(f"{sys.argv[3]}: {len(a)} greedy tokens identical")
else:
    print(f"{sys.argv[3]}: DIFFER at step {same}: tp1 {a} tp2 {b}"); sys.exit(1)
PY
done

echo "== bench e2e llama2-13b random fp16, batch 1 and 32, --tp 1 vs --tp 2"
for tp in 1 2; do
    timeout "${BENCH_TIMEOUT:-240}" "$FDPP" bench e2e --model llama2-13b --random-weights --backend cuda --batch 1,32 --tp "$tp" \
        --out "$OUT/bench" 2>"$OUT/bench-tp$tp.err" | tee "$OUT/bench-tp$tp.md" || { echo "bench --tp $tp FAILED"; tail -n 5 "$OUT/bench-tp$tp.err"; }
done
echo "== --tp 2 with the opt-in fast paths: tokens against --tp 1 (llama-gqa), then the bench"
# tp_graphs=1: the decode graph captures the all-reduces; tp_fused=1: the fused decode layer
# (the residual all-reduced). Without a profile CUDA's built-in rule runs gemv at decode M, which
# is what the fused layer needs.
for sets in "tp_graphs=1" "tp_fused=1" "tp_graphs=1 tp_fused=1"; do
    tag="${sets// /_}"; tag="${tag//=/}"
    args=(); for kv in $sets; do args+=(--set "$kv"); done
    if timeout "${GEN_TIMEOUT:-180}" "$FDPP" generate --model tests/fixtures/hf/llama-gqa --backend cuda --token-ids "$IDS" \
        --max-tokens 24 --ignore-eos --json --tp 2 "${args[@]}" >"$OUT/gen-$tag.json" 2>"$OUT/gen-$tag.err"; then
        python3 -c 'import json,sys; ld=lambda p: json.JSONDecoder().raw_decode(open(p).read())[0]; a,b=(ld(p)["seqs"][0]["tokens"] for p in sys.argv[1:3]); g=ld(sys.argv[2]).get("decode_graphs"); print(sys.argv[3]+":", "tokens identical" if a==b else f"DIFFER tp1 {a} vs {b}", "| decode graphs", g)' \
            "$OUT/gen-llama-gqa-tp1.json" "$OUT/gen-$tag.json" "$sets" || fail=1
    else
        echo "$sets: FAILED"; tail -n 5 "$OUT/gen-$tag.err"; fail=1
    fi
done
timeout "${BENCH_TIMEOUT:-240}" "$FDPP" bench e2e --model llama2-13b --random-weights --backend cuda --batch 1,32 --tp 2 \
    --set tp_graphs=1 --set tp_fused=1 --out "$OUT/bench-fast" 2>"$OUT/bench-fast-tp2.err" \
    | tee "$OUT/bench-fast-tp2.md" || { echo "bench tp_graphs=1 tp_fused=1 FAILED"; tail -n 5 "$OUT/bench-fast-tp2.err"; }
echo "results in $OUT"
exit "$fail"
