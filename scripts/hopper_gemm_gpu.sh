#!/usr/bin/env bash
# The Hopper GEMM experiment (scripts/hopper_gemm.cu) on a lent H100/H200, in one device call
# from the repository root: build, the odd sizes under compute-sanitizer (memcheck, racecheck,
# synccheck), then the Llama shapes timed against cuBLAS at each M given (default 1024 4096).
# Logs land in $OUT (or /tmp/hg-out); the table is printed last.
#   FDPP=.carry/fdpp also runs fdpp's long prefill check cases (issue #20's 4097/16384 tokens).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/hg-out}"
mkdir -p "$out"
ms=("$@")
[ ${#ms[@]} -gt 0 ] || ms=(1024 4096)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv | tee "$out/gpu.txt"
bin=/tmp/hopper_gemm
if ! nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -I kernels_cuda \
    scripts/hopper_gemm.cu -o "$bin" -lcublas >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  exit 1
fi
grep -E 'spill|registers' "$out/build.log" | sort | uniq -c | head
for tool in memcheck racecheck synccheck; do
  timeout 300 compute-sanitizer --tool "$tool" "$bin" --check-only >"$out/san-$tool.log" 2>&1
  echo "compute-sanitizer $tool: rc $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/san-$tool.log" | tail -1))"
done
if [ -n "${FDPP:-}" ]; then
  timeout 600 "$FDPP" check --backend cuda --op attention --case "new=[4097]" --case "new=[16384]" \
    --case "new=[4096,1,4097]" --case "new=[1025,97]" --case "new=[2049]" >"$out/long-prefill-check.md" 2>&1
  echo "fdpp long prefill check: rc $? ($(tail -1 "$out/long-prefill-check.md"))"
fi
timeout 400 "$bin" "${ms[@]}" 2>&1 | tee "$out/hopper_gemm.md"
