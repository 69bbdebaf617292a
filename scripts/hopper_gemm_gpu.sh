#!/usr/bin/env bash
# The Hopper GEMM experiment (scripts/hopper_gemm.cu) on a lent H100/H200, in one device call
# from the repository root: build, the odd sizes under compute-sanitizer (memcheck, racecheck,
# synccheck), then the Llama shapes timed against cuBLAS at each M given (default 1024 4096).
# Six files land in $OUT (or /tmp/hg-out): build.log, san.log, errs.log, long-prefill-check.md and
# the two tables, printed last.
# Each step runs under `timeout` (the worst case adds up to ~18 minutes, past a device call's 10:
# leave FDPP and LT unset, or split the steps, when the call is tight).
#   FDPP=.carry/fdpp also runs fdpp's long prefill check cases (issue #20's 4097/16384 tokens);
#   SAN=0 skips the sanitizer build and runs (the first look at a new build: ~1 minute less);
#   TIMED=0 stops after the checks and the sanitizer (the tables take ~2 minutes per M);
#   LT=1 also times cuBLASLt's other algorithms at the first M (scripts/cublaslt_algos.cu).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/hg-out}"
mkdir -p "$out"
ms=("$@")
[ ${#ms[@]} -gt 0 ] || ms=(1024 4096)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv | tee "$out/build.log"
bin=/tmp/hopper_gemm
build() {
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -I kernels_cuda "$@" \
    scripts/hopper_gemm.cu -lcublas
}
# The sanitizer's build waits ~9 minutes before its watchdog traps (instrumented kernels are slow).
san_on="${SAN:-1}"
san_build=
if [ "$san_on" != 0 ]; then
  build -DHG_WATCHDOG_CYCLES='(1ll<<40)' -o "$bin-san" >/tmp/build-san.log 2>&1 &
  san_build=$!
fi
# The timed build has no watchdog: its clock reads made nvcc spill the rotary and GLU 128 × 256
# tiles (kernels_cuda/gemm_hopper.cu, wait_or_trap), which the engine's build does not.
build -DHG_WATCHDOG_CYCLES=0 -o "$bin-fast" >/tmp/build-fast.log 2>&1 &
fast=$!
if ! build -o "$bin" >>"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  exit 1
fi
wait $fast || { echo "timed build FAILED"; tail -20 /tmp/build-fast.log; exit 1; }
# By pid: `$!` is now the timed build's.
[ -z "$san_build" ] || wait "$san_build" || { echo "sanitizer build FAILED"; tail -20 /tmp/build-san.log; }
grep -E 'spill|registers' "$out/build.log" | sort | uniq -c | head
# Unclustered variants first: a fault in the cluster variants must not hide their results.
timeout 60 "$bin" --check-only --no-cluster 2>&1 | tail -3
timeout 60 "$bin" --check-only --cluster-only 2>&1 | tail -3
san="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
# The three tools run side by side (the instrumentation is host-bound; 16 cores).
if [ "$san_on" != 0 ]; then
  for tool in memcheck racecheck synccheck; do
    timeout 420 "$san" --tool "$tool" "$bin-san" --check-only >"/tmp/san-$tool.log" 2>&1 &
  done
  wait
  for tool in memcheck racecheck synccheck; do
    echo "compute-sanitizer $tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "/tmp/san-$tool.log" | tail -1) ($(grep -c '| ok |' "/tmp/san-$tool.log") checks ok)"
    { echo "== $tool"; cat "/tmp/san-$tool.log"; } >>"$out/san.log"
  done
fi
if [ -n "${FDPP:-}" ]; then
  timeout 200 "$FDPP" check --backend cuda --op attention --case "new=[4097]" --case "new=[16384]" \
    --case "new=[4096,1,4097]" --case "new=[1025,97]" --case "new=[2049]" >"$out/long-prefill-check.md" 2>&1
  echo "fdpp long prefill check: rc $? ($(tail -1 "$out/long-prefill-check.md"))"
fi
if [ -n "${LT:-}" ]; then
  # cuBLASLt's other algorithms at the same shapes, in the same call: the peer above is
  # cublasGemmEx's default, which the best of them beat by 0-6 % in session 26.
  nvcc -O2 -arch=sm_90a scripts/cublaslt_algos.cu -lcublasLt -lcublas -o /tmp/lt >>"$out/build.log" 2>&1 &&
    timeout 150 /tmp/lt "${ms[0]}" 5 >>"$out/errs.log" 2>&1
  echo "cublaslt_algos: rc $? (its table is at the end of errs.log)"
fi
[ "${TIMED:-1}" = 0 ] && exit 0
timeout 180 "$bin-fast" --no-cluster "${ms[@]}" 2>>"$out/errs.log" | tee "$out/hopper_gemm.md"
timeout 180 "$bin-fast" --cluster-only "${ms[@]}" 2>>"$out/errs.log" | tee "$out/hopper_gemm_cluster.md"
grep -v "^checking" "$out/errs.log" | tail -30
