// CPU emulation of the CUDA features kernels/*.cu use, so that the kernels'
// own source can run (slowly) on a machine without a GPU. It stands in for
// <cuda_fp16.h> when emu.cpp includes a .cu file (include path: kernels/emu
// first). It checks logic — indexing, layouts, reductions, the host code's
// arguments — not speed, memory coalescing or the GPU's memory model.
//
// Execution model (emu.cpp): a CTA's threads are fibers (ucontext) run one at
// a time on the calling OS thread; __syncthreads and warp shuffles switch
// fibers until every live thread of the block (or lane of the warp) arrives.
// CTAs run one after another, so `__shared__` variables are thread_local
// statics, shared by a CTA's fibers and private to each OS thread; dynamic
// shared memory (DYNAMIC_SHARED in the kernels) is allocated per launch and
// ends at a guard page.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ thread_local

struct dim3 {
    unsigned x, y, z;
};

namespace emu {
dim3 thread_idx();
extern thread_local dim3 block_idx, block_dim, grid_dim;
void sync_threads();
void* dynamic_shared();
float shfl_xor(unsigned mask, float x, int lane_mask);
void trace_load(const void* p, unsigned long bytes);
}  // namespace emu

// gload() in the .cu reports each K/V load here (see trace_load in emu.cpp).
#define TRACE_LOAD(p, bytes) ::emu::trace_load((p), (bytes))

// `extern __shared__ T name[]` in CUDA: the launch's dynamic shared memory.
#define DYNAMIC_SHARED(type, name) type* name = static_cast<type*>(::emu::dynamic_shared())

#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::block_idx)
#define blockDim (::emu::block_dim)
#define gridDim (::emu::grid_dim)

inline void __syncthreads() { emu::sync_threads(); }
inline float __shfl_xor_sync(unsigned mask, float x, int lane_mask) { return emu::shfl_xor(mask, x, lane_mask); }

// Half precision: IEEE binary16 bits; conversions round to nearest even, as
// the GPU's __float2half does (GCC's _Float16).
struct __half {
    uint16_t bits;
};
struct __half2 {
    __half x, y;
};
struct float2 {
    float x, y;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(16) float4 {
    float x, y, z, w;
};

inline float __half2float(__half h) {
    _Float16 f;
    std::memcpy(&f, &h.bits, 2);
    return (float)f;
}
inline __half __float2half(float x) {
    _Float16 f = (_Float16)x;
    __half h;
    std::memcpy(&h.bits, &f, 2);
    return h;
}
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline float __expf(float x) { return std::exp(x); }
// Multiply and add, each rounded once (never fused: emu.cpp is built with
// -ffp-contract=off).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
