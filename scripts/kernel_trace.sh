#!/usr/bin/env bash
# Run a command under the CUPTI kernel timeline (scripts/kernel_trace.c), on a GPU machine:
#   scripts/kernel_trace.sh OUT.csv command args...
# Then, anywhere: python3 scripts/kernel_trace_summary.py OUT.csv (decode steps), or with
# --prefill LAYERS (the last prefill, layer by layer). FDPP_TRACE_API=1 adds every CUDA driver API
# call (rows api_<function>, device 65535): the host's side of the same timeline.
set -euo pipefail
out=$1
shift
CUDA=${CUDA_HOME:-/usr/local/cuda}
CUPTI=$CUDA/extras/CUPTI
[ -d "$CUPTI/include" ] || CUPTI=$CUDA
newest() { grep -o "CUpti_Activity$1[0-9]\\+" "$CUPTI/include/cupti_activity.h" | sort -V | tail -1; }
krec=$(newest Kernel)
mrec=$(newest Memcpy)
srec=$(newest Memset)
lib=${TMPDIR:-/tmp}/libfdpp_kernel_trace.so
gcc -O2 -shared -fPIC -DKREC="$krec" -DMREC="$mrec" -DSREC="$srec" -I"$CUDA/include" -I"$CUPTI/include" "$(dirname "$0")/kernel_trace.c" \
    -L"$CUPTI/lib64" -lcupti -o "$lib"
CUDA_INJECTION64_PATH=$lib LD_LIBRARY_PATH="$CUPTI/lib64:${LD_LIBRARY_PATH:-}" FDPP_TRACE_OUT=$out "$@"
