#!/usr/bin/env bash
# Compile every HIP kernel specialisation with hipcc for the CDNA targets CI covers (gfx90a =
# MI200, gfx940 = MI300 first silicon), with no AMD GPU. Debian's hipcc 5.2.3 (clang 15) is
# enough; installs it when missing. Fails on the first compiler error.
#
# hipcc quirks resolved here:
# - `--offload-arch=<gfx>` must be given: without it hipcc runs rocm_agent_enumerator, which
#   has no GPU to find here and prints a Python traceback.
# - `--genco` (device code only, a clang offload bundle) avoids needing a host link step.
# - Debian installs the device libraries where hipcc finds them (rocm-device-libs, pulled in by
#   hipcc), so no --rocm-path or -nogpulib is needed.
# - ROCm 5.2 cannot target gfx942 or gfx1100 (and its hiprtc aborts on them; see README).
set -euo pipefail
cd "$(dirname "$0")/.."

ARCHS="${HIP_ARCHS:-gfx90a gfx940}"

if ! command -v hipcc >/dev/null 2>&1; then
  echo "hipcc not found: installing Debian's hipcc and libamdhip64-dev"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq hipcc libamdhip64-dev >/dev/null
fi

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
# hipcc leaves one empty directory per compile in the temp dir (named after the source, e.g.
# attn_decode-1a2b3c); keep them inside $OUT so the trap removes them with it.
export TMPDIR="$OUT"

# Every specialisation fdpp compiles at run time (src/backend/rocm/sources.rs): gemv rows
# 1/2/4, flat_gemm B_N 32/64/128/256, the layer ops, split-KV decode attention (head_dim
# 64/128/256 x 1/2/3/4 heads per block) and MFMA prefill attention (head_dim 64/128/256), f16 and
# bf16.
specs=()
for bf in 0 1; do
  for rows in 1 2 4; do specs+=("gemv.hip|-DFDPP_BF16=$bf -DFDPP_ROWS=$rows -DFDPP_INFLIGHT=8"); done
  for bn in 32 64 128 256; do specs+=("flat_gemm.hip|-DFDPP_BF16=$bf -DFDPP_BN=$bn"); done
  specs+=("layer.hip|-DFDPP_BF16=$bf")
  for d in 64 128 256; do
    for hg in 1 2 3 4; do specs+=("attn_decode.hip|-DFDPP_BF16=$bf -DFDPP_D=$d -DFDPP_HG=$hg"); done
    specs+=("attn_prefill.hip|-DFDPP_BF16=$bf -DFDPP_D=$d")
  done
done

n=0
for arch in $ARCHS; do
  for s in "${specs[@]}"; do
    file="${s%%|*}"
    defs="${s#*|}"
    obj="$OUT/${file%.hip}-$arch-$n.hsaco"
    # shellcheck disable=SC2086
    if ! hipcc --offload-arch="$arch" --genco -O3 -std=c++17 -Werror $defs "kernels_hip/$file" -o "$obj"; then
      echo "FAILED: hipcc --offload-arch=$arch $defs kernels_hip/$file" >&2
      exit 1
    fi
    echo "ok  $arch  $file  $defs  ($(stat -c %s "$obj") bytes)"
    n=$((n + 1))
  done
done
echo "hipcc $(hipcc --version 2>/dev/null | grep -m1 -o 'HIP version: [0-9.]*' || true): all $n HIP kernel compiles succeeded"
