// Helpers shared by the hand-written CUDA kernels (kernels/*.cu; kernels/cuda.py compiles them
// with this directory on the include path).
#pragma once

__device__ __forceinline__ float bf16_lo(unsigned w) { return __uint_as_float(w << 16); }          // bf16 pair -> fp32
__device__ __forceinline__ float bf16_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ unsigned short to_bf16(float f) {   // round to nearest even (finite f)
    const unsigned u = __float_as_uint(f);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ unsigned bf16x2(float lo, float hi) {   // fp32 pair -> bf16 pair (as to_bf16)
    return to_bf16(lo) | (unsigned)to_bf16(hi) << 16;
}
__device__ __forceinline__ unsigned short to_f16(float f) {   // round to nearest even
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float ld_f32(const float* p) {   // L2 only: written by another kernel or program
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ float2 ld_f32x2(const float* p) {   // 8 bytes, L2 only
    float2 v;
    asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ int ld_s32(const int* p) {       // L2 only
    int v;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 ld_v4(const void* p) {     // 16 bytes, L2 only
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ unsigned smem_addr(const void* p) {   // generic -> shared-window address
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {   // 16 bytes global -> shared, L2 only
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src));
}
// kernels/pdl.py's `enter` (rule 1) for a CUDA kernel: mode 1 waits for the kernel before (its
// writes visible), mode 2 then also lets the next kernel's programs launch; 0 does nothing
__device__ __forceinline__ void pdl_enter(int mode) {
    if (mode > 0) asm volatile("griddepcontrol.wait;" ::: "memory");
    if (mode > 1) asm volatile("griddepcontrol.launch_dependents;");
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
template <int NW>
__device__ __forceinline__ float block_sum(float v, float* part) {   // over NW warps; part: NW floats, shared
    v = warp_sum(v);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
    __syncthreads();
    v = 0.f;
#pragma unroll
    for (int w = 0; w < NW; w++) v += part[w];
    return v;
}
// One Marlin INT4 word of lane 4g + t times its activations (packed fp16, as kernels/moe_gemv.py
// explains): the fp16 pairs xa = (x[16kt + 2t], x[.. + 1]) and xb = (x[.. + 8], x[.. + 9])
// -> fp32 (column lo, column lo + 8), still to be scaled by their group's scales.
__device__ __forceinline__ void word_dot(unsigned w, unsigned xa, unsigned xb, float& lo, float& hi) {
    asm("{\n.reg .b32 m, s, c, k, b, p0, p1, p2, p3, l, h;\n.reg .f16 u, v;\n"
        "mov.b32 m, 0x64006400;\nmov.b32 c, 0x64086408;\nmov.b32 k, 0x2c002c00;\nmov.b32 b, 0xd480d480;\n"
        "shr.u32 s, %2, 8;\n"
        "lop3.b32 p0, %2, 0x000f000f, m, 0xea;\nlop3.b32 p1, %2, 0x00f000f0, m, 0xea;\n"
        "lop3.b32 p2, s, 0x000f000f, m, 0xea;\nlop3.b32 p3, s, 0x00f000f0, m, 0xea;\n"
        "sub.rn.f16x2 p0, p0, c;\nfma.rn.f16x2 p1, p1, k, b;\nsub.rn.f16x2 p2, p2, c;\nfma.rn.f16x2 p3, p3, k, b;\n"
        "mul.rn.f16x2 l, p0, %3;\nfma.rn.f16x2 l, p1, %4, l;\nmul.rn.f16x2 h, p2, %3;\nfma.rn.f16x2 h, p3, %4, h;\n"
        "mov.b32 {u, v}, l;\nadd.rn.f16 u, u, v;\ncvt.f32.f16 %0, u;\n"
        "mov.b32 {u, v}, h;\nadd.rn.f16 u, u, v;\ncvt.f32.f16 %1, u;\n}"
        : "=f"(lo), "=f"(hi) : "r"(w), "r"(xa), "r"(xb));
}
