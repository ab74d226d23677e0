// The routed experts' gate/up projection and act of one decode token (kernels/moe_w13.py):
// act[j] = SiLU(x w_gate[ids[j]]) * (x w_up[ids[j]]) * tw[j] for its n assignments j, INT4
// Marlin weights, fp16 act rows out (what kernels/moe_w2.cu reads).
//
// Program (part hf, split r, assignment j) multiplies its share of K (whole scale groups,
// GT / S of them rounded down or up) of the part's CB gate and CB up Marlin blocks of 64
// columns (gate block hf CB + b pairs with up block I / 64 + hf CB + b: the same act dims).
// The expert ids come from the router, the kernel just before, so nothing can be loaded
// before the PDL wait; after it a program reads its expert id and issues all its words
// (k tiles x NB blocks of 512 bytes, ~126 KB at K2.6 TP-8) and scales into shared memory
// with cp.async at once, in NCH chunks of CH k tiles, and multiplies each chunk as it lands
// (the Triton GEMV has a few pipeline stages in flight). Warp w takes block w % NB of every
// (k tile, block) unit: lane 4g + t multiplies its word quad by the x pairs of its K rows
// (word_dot), scaled per group in fp32. The program stores its fp32 column sums; the last of
// the S programs of (hf, j) to arrive (a ticket, as kernels/ticket.py) adds them, split by
// split, and writes the part's act.
//
// Marlin words and scales as kernels/moe_w2.cu says (DESIGN §4).
//
// Compile-time: H (hidden, w13's K), I (intermediate dims on this rank), G (group size), CB
// (gate blocks a program), S (K splits), NCH (chunks of k tiles), PPS (programs an SM: the
// launch bound, which caps the registers).
#include "common.cuh"

#define THREADS 512
#define WARPS (THREADS / 32)
#define NB (2 * CB)            // Marlin blocks a program: CB gate, CB up
#define GT (H / G)             // scale groups of K: split r takes the groups [r GT / S, (r + 1) GT / S)
#define GR ((GT + S - 1) / S)  // a program's scale groups, at most
#define KT (GR * G / 16)       // its k tiles, at most
#define CH ((KT + NCH - 1) / NCH)     // k tiles a chunk
static_assert(H % G == 0 && G % 16 == 0 && GT >= S && NCH <= 8, "K rows must split into groups and chunks");
static_assert(WARPS % NB == 0 && NB * 64 <= THREADS, "thread mappings");

__device__ __forceinline__ void wait_pending(int n) {   // cp.async groups: all but the newest n complete
    switch (n) {
        case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
        case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
        case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
        case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
        case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
        case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
        case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
        default: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, PPS)
moe_w13(const unsigned short* x,                                 // fp16 [H], the token (the router wrote it)
        const int* ids, const float* tw,                         // expert ids, top-k weights [n] (the router's)
        const unsigned* w13, const unsigned short* s13,          // Marlin [E, H/16, 4I] words, [E, H/G, 2I] bf16 scales
        float* partial, int* count,                              // [n, parts, S, NB * 64] column sums; tickets [n, parts]
        unsigned short* act, int pdl)                            // fp16 [n, I]
{
    extern __shared__ uint4 sm[];
    uint4* words = sm;                                           // [KT][NB][32 lanes]
    uint4* scales = sm + KT * NB * 32;                           // [GR][NB][8]
    float (*red)[64] = reinterpret_cast<float (*)[64]>(sm);      // [WARPS][64], then part [NB * 64]: over
    float* part = red[WARPS];                                    // the words, once they are multiplied
    __shared__ unsigned xs[KT * 8];                              // the program's x rows, fp16 pairs
    __shared__ int last;
    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    const int hf = blockIdx.x / S, r = blockIdx.x % S, j = blockIdx.y, unit = j * (I / 64 / CB) + hf;
    if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
    const long e = ld_s32(ids + j);
    auto block = [&](int b) { return b < CB ? hf * CB + b : I / 64 + hf * CB + b - CB; };   // Marlin block of slot b
    const int g0 = r * GT / S, ng = (r + 1) * GT / S - g0;        // the program's groups
    const int kt0 = g0 * (G / 16), kts = ng * (G / 16);          // and k tiles
    for (int i = t; i < ng * NB * 8; i += THREADS) {             // group 0: the scales
        const int grp = i / (NB * 8), b = i / 8 % NB;
        cp_async16(smem_addr(scales + i), s13 + (e * GT + g0 + grp) * (2 * I) + block(b) * 64 + i % 8 * 8);
    }
    asm volatile("cp.async.commit_group;");
    for (int c = 0; c < NCH; c++) {                              // groups 1..NCH: the words, chunk by chunk
        for (int i = c * CH * NB * 32 + t; i < min(kts, (c + 1) * CH) * NB * 32; i += THREADS) {
            const int kt = i / (NB * 32), b = i / 32 % NB;
            cp_async16(smem_addr(words + i), w13 + (e * (H / 16) + kt0 + kt) * (4 * I) + block(b) * 128 + i % 32 * 4);
        }
        asm volatile("cp.async.commit_group;");
    }
    if (pdl) asm volatile("griddepcontrol.launch_dependents;");  // moe_w2 may load its weights now
    for (int i = t; i < kts * 2; i += THREADS) reinterpret_cast<uint4*>(xs)[i] = ld_v4(x + kt0 * 16 + i * 8);
    const float wj = ld_f32(tw + j);
    const int b = warp % NB, g = lane / 4, q = lane % 4;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int c = 0; c < NCH; c++) {
        wait_pending(NCH - 1 - c);
        __syncthreads();
        for (int u = warp; u < (min(kts, (c + 1) * CH) - c * CH) * NB; u += WARPS) {   // unit (k tile, block b)
            const int kt = c * CH + u / NB;
            const uint4 w = words[(kt * NB + b) * 32 + lane], s = scales[(kt * 16 / G * NB + b) * 8 + g];
            const unsigned wq[4] = {w.x, w.y, w.z, w.w}, sq[4] = {s.x, s.y, s.z, s.w};
            const unsigned xa = xs[8 * kt + q], xb = xs[8 * kt + q + 4];
#pragma unroll
            for (int tile = 0; tile < 4; tile++) {
                float lo, hi;
                word_dot(wq[tile], xa, xb, lo, hi);
                acc[2 * tile] = fmaf(lo, bf16_lo(sq[tile]), acc[2 * tile]);
                acc[2 * tile + 1] = fmaf(hi, bf16_hi(sq[tile]), acc[2 * tile + 1]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], 1);
        acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], 2);
    }
    __syncthreads();                                             // every warp done with the words
    if (q == 0)
#pragma unroll
        for (int i = 0; i < 8; i++) red[warp][16 * (i / 2) + g + 8 * (i % 2)] = acc[i];
    __syncthreads();
    float* mine = partial + ((long)unit * S + r) * (NB * 64);
    if (t < NB * 64) {                                           // the program's column sums, warps in order
        float v = 0.f;
#pragma unroll
        for (int k = 0; k < WARPS / NB; k++) v += red[t / 64 + k * NB][t % 64];
        mine[t] = v;
    }
    __threadfence();
    __syncthreads();                                             // every store of the program issued and fenced
    if (t == 0) {
        int old;
        asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(count + unit) : "memory");
        last = old == S - 1;
        if (last) count[unit] = 0;                               // ready for the next launch
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (t < CB * 64) {                                           // the part's act dims, split by split
        const float* p = partial + (long)unit * S * (NB * 64);
        float gs = 0.f, us = 0.f;
        for (int k = 0; k < S; k++) { gs += ld_f32(p + k * NB * 64 + t); us += ld_f32(p + k * NB * 64 + CB * 64 + t); }
        act[(long)j * I + hf * CB * 64 + t] = to_f16(gs / (1.f + __expf(-gs)) * us * wj);
    }
}
