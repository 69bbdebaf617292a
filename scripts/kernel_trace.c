// A kernel timeline for any CUDA program, without Nsight Systems (the lent GPU machines have
// ncu but no nsys): a CUPTI injection library. The driver loads it at cuInit when
// CUDA_INJECTION64_PATH names it; it records every kernel's start and end (graph nodes
// included, so a replayed decode graph shows each layer's kernels) and writes one CSV line per
// kernel to $FDPP_TRACE_OUT (default kernel_trace.csv) when the program exits.
//
// Build and use (scripts/kernel_trace.sh does both on the GPU machine):
//   gcc -O2 -shared -fPIC -I$CUDA/include -I$CUDA/extras/CUPTI/include scripts/kernel_trace.c \
//       -L$CUDA/extras/CUPTI/lib64 -lcupti -o /tmp/libkt.so
//   CUDA_INJECTION64_PATH=/tmp/libkt.so LD_LIBRARY_PATH=$CUDA/extras/CUPTI/lib64 fdpp ...
// KREC, MREC and SREC are the newest CUpti_ActivityKernelN, CUpti_ActivityMemcpyN and
// CUpti_ActivityMemsetN of the installed header (the library writes records in those layouts);
// kernel_trace.sh finds them. Copies and memsets are recorded too (named memcpy_<kind>_<bytes>:
// 1 host to device, 2 device to host, 8 device to device; memset_<bytes>), as either between two
// kernels breaks their overlap. Each record names its device, so
// a multi-GPU run (tensor parallelism) can be cut per GPU.
// With FDPP_TRACE_API=1 every CUDA driver API call is recorded too, as a row named
// api_<function> with device 65535 (the summaries, which take the lowest device id, skip them)
// and CUPTI's correlation id in the node column, on the kernels' clock: where the host spends
// the time between two launches.
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

#if !defined(KREC) || !defined(MREC) || !defined(SREC)
#error "define KREC, MREC and SREC as the newest CUpti_ActivityKernelN, CUpti_ActivityMemcpyN and CUpti_ActivityMemsetN in cupti_activity.h"
#endif

static FILE* out;
static unsigned long long dropped;

static void CUPTIAPI give_buffer(uint8_t** buffer, size_t* size, size_t* max_records) {
    *size = 16u << 20;
    *buffer = (uint8_t*)aligned_alloc(8, *size);
    *max_records = 0;
}

static void CUPTIAPI take_buffer(CUcontext ctx, uint32_t stream, uint8_t* buffer, size_t size, size_t valid) {
    (void)ctx;
    (void)stream;
    (void)size;
    CUpti_Activity* r = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
        if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            const MREC* m = (const MREC*)r;
            if (out)
                fprintf(out, "%llu,%llu,%u,%llu,0,0,0,%u,memcpy_%u_%llu\n", (unsigned long long)m->start,
                        (unsigned long long)m->end, m->graphId, (unsigned long long)m->graphNodeId,
                        m->deviceId, (unsigned)m->copyKind, (unsigned long long)m->bytes);
            continue;
        }
        if (r->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
            const SREC* m = (const SREC*)r;
            if (out)
                fprintf(out, "%llu,%llu,%u,%llu,0,0,0,%u,memset_%llu\n", (unsigned long long)m->start,
                        (unsigned long long)m->end, m->graphId, (unsigned long long)m->graphNodeId,
                        m->deviceId, (unsigned long long)m->bytes);
            continue;
        }
        if (r->kind == CUPTI_ACTIVITY_KIND_DRIVER) {
            const CUpti_ActivityAPI* a = (const CUpti_ActivityAPI*)r;
            const char* name = NULL;
            if (cuptiGetCallbackName(CUPTI_CB_DOMAIN_DRIVER_API, a->cbid, &name) != CUPTI_SUCCESS || !name) name = "unknown";
            if (out)
                fprintf(out, "%llu,%llu,0,%u,0,0,0,65535,api_%s\n", (unsigned long long)a->start,
                        (unsigned long long)a->end, a->correlationId, name);
            continue;
        }
        if (r->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
        const KREC* k = (const KREC*)r;
        if (out)
            fprintf(out, "%llu,%llu,%u,%llu,%u,%u,%u,%u,%s\n", (unsigned long long)k->start,
                    (unsigned long long)k->end, k->graphId, (unsigned long long)k->graphNodeId, k->gridX,
                    k->blockX, k->registersPerThread, k->deviceId, k->name);
    }
    size_t n = 0;
    if (cuptiActivityGetNumDroppedRecords(NULL, 0, &n) == CUPTI_SUCCESS) dropped += n;
    free(buffer);
}

static void finish(void) {
    cuptiActivityFlushAll(1);
    if (out) {
        if (dropped) fprintf(stderr, "kernel_trace: %llu records dropped\n", dropped);
        fclose(out);
        out = NULL;
    }
}

int InitializeInjection(void) {
    const char* path = getenv("FDPP_TRACE_OUT");
    out = fopen(path ? path : "kernel_trace.csv", "w");
    if (!out) return 0;
    fprintf(out, "start_ns,end_ns,graph,node,grid_x,block_x,regs,device,name\n");
    if (cuptiActivityRegisterCallbacks(give_buffer, take_buffer) != CUPTI_SUCCESS) return 0;
    if (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) return 0;
    if (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS) return 0;
    if (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET) != CUPTI_SUCCESS) return 0;
    const char* api = getenv("FDPP_TRACE_API");
    if (api && api[0] == '1' && cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER) != CUPTI_SUCCESS) return 0;
    // Deliver buffers as they fill, not only at exit (the context may be gone by then).
    cuptiActivityFlushPeriod(200);
    atexit(finish);
    return 1;
}
