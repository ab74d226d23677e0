// Helpers of the probes' CUDA sources only (experiments/*.cu; experiments/cuda.py compiles them
// with kernels/ on the include path and this file's path as PROBE_COMMON): a wait that gives up,
// shared-memory acquire loads, mbarriers and bulk copies, a bf16 x fp32 dot of 8.
#pragma once
#include "common.cuh"

template <class F>
__device__ __forceinline__ bool wait_until(F ready, int* err) {   // false: gave up after ~1 s, *err set
    const long long t0 = clock64();
    while (!ready())
        if (clock64() - t0 > 2000000000ll) { atomicExch(err, 1); return false; }
    return true;
}
__device__ __forceinline__ int ld_acquire_cta(const int* p) {   // shared memory
    int v;
    asm volatile("ld.acquire.cta.shared::cta.s32 %0, [%1];" : "=r"(v) : "r"(smem_addr(p)) : "memory");
    return v;
}
// mbarriers (shared::cta addresses) and bulk copies global -> shared that complete on one
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ bool mbar_done(unsigned bar, unsigned parity) {   // the phase of this parity is over
    unsigned done;
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done != 0;
}
__device__ __forceinline__ bool mbar_wait(unsigned bar, unsigned parity, int* err) {   // false: gave up
    return wait_until([&] { return mbar_done(bar, parity); }, err);
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("{ .reg .b64 s; mbarrier.arrive.shared::cta.b64 s, [%0]; }" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ float dot8(uint4 w, float4 a, float4 b) {   // 8 bf16 weights . 8 fp32 x
    return bf16_lo(w.x) * a.x + bf16_hi(w.x) * a.y + bf16_lo(w.y) * a.z + bf16_hi(w.y) * a.w
         + bf16_lo(w.z) * b.x + bf16_hi(w.z) * b.y + bf16_lo(w.w) * b.z + bf16_hi(w.w) * b.w;
}
