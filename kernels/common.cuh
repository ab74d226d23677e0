// Helpers shared by the hand-written CUDA kernels (kernels/*.cu; kernels/cuda.py compiles them
// with this directory on the include path).
#pragma once

__device__ __forceinline__ float bf16_lo(unsigned w) { return __uint_as_float(w << 16); }          // bf16 pair -> fp32
__device__ __forceinline__ float bf16_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ unsigned short to_bf16(float f) {   // round to nearest even
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ unsigned bf16x2(float lo, float hi) {   // fp32 pair -> bf16 pair, one instruction
    unsigned p;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(hi), "f"(lo));
    return p;
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
__device__ __forceinline__ float4 ld_f32x4(const float* p) {   // 16 bytes, L2 only
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ int ld_s32(const int* p) {       // L2 only
    int v;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ int ld_acquire(const int* p) {   // a flag another program releases
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
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
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp16z(unsigned dst, const void* src, bool valid) {   // zeros when !valid
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void ldsm4(unsigned a[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr));
}
// byte offset of 16-byte chunk c (0-3) of row r in a tile of 64-byte rows (a stage's 32 bf16 of
// K a token in moe_marlin and moe_wide): chunk c ^ ((r / 2) % 4), so ldmatrix meets no bank conflict
__device__ __forceinline__ int xoff(int r, int c) { return r * 64 + 16 * (c ^ ((r >> 1) & 3)); }
__device__ __forceinline__ unsigned long long evict_first() {   // L2 policy: weights read once
    unsigned long long p;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return p;
}
__device__ __forceinline__ void cp16_ef(unsigned dst, const void* src, unsigned long long pol) {   // cp_async16, evict-first
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "l"(pol) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }
__device__ __forceinline__ float silu_mul(float gte, float up) { return gte / (1.f + __expf(-gte)) * up; }
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
// One Marlin INT4 word of lane 4g + t as the fp16 A operand of an mma.m16n8k16 (its 16x16 tile
// transposed: rows n, columns k): a0a1 = nibbles (0, 4), a2a3 = (2, 6), a4a5 = (1, 5), a6a7 =
// (3, 7), each q - 8 exactly. LOP3 with 0x64006400 makes the nibble pair at bits (0, 16) the
// fp16 pair 1024 + q (one subtract of 1032) and the pair at bits (4, 20) 1024 + 16 q (one fma:
// x 1/16 - 72); a shift by 8 brings nibbles 2, 3, 6, 7 to those places.
__device__ __forceinline__ void dequant_f16(unsigned w, unsigned a[4]) {
    asm("{\n.reg .b32 m, s, c, k, b;\n"
        "mov.b32 m, 0x64006400;\nmov.b32 c, 0x64086408;\nmov.b32 k, 0x2c002c00;\nmov.b32 b, 0xd480d480;\n"
        "shr.u32 s, %4, 8;\n"
        "lop3.b32 %0, %4, 0x000f000f, m, 0xea;\nlop3.b32 %2, %4, 0x00f000f0, m, 0xea;\n"
        "lop3.b32 %1, s, 0x000f000f, m, 0xea;\nlop3.b32 %3, s, 0x00f000f0, m, 0xea;\n"
        "sub.rn.f16x2 %0, %0, c;\nfma.rn.f16x2 %2, %2, k, b;\nsub.rn.f16x2 %1, %1, c;\nfma.rn.f16x2 %3, %3, k, b;\n}"
        : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(w));
}
// c += A (fp16, 16 x 16) B (fp16, 16 x 8), fp32 accumulators
__device__ __forceinline__ void mma_f16(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
