// What both attention kernels need beyond common.cuh (still header-free for NVRTC).
#pragma once

// +inf as a constant expression (no math.h under NVRTC without headers).
#define FDPP_INF __int_as_float(0x7f800000)

// Finite: neither inf nor NaN (NaN compares false).
__device__ __forceinline__ bool finite(float x) { return fabsf(x) < FDPP_INF; }
