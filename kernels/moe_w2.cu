// The routed experts' down projection of one decode token (kernels/moe_w2.py): y[j] = act[j]
// w2[ids[j]] for its n <= 8 assignments j, INT4 Marlin weights, fp32 rows out.
//
// Program b owns the 64 output columns of Marlin block b for every assignment. The expert ids
// come from the router, two launches back, and the w13 GEMV between waits for the router
// before it lets this kernel in (kernels/pdl.py's rules), so they are final before this
// kernel's wait: the program issues its
// words (n x I/16 k-tile rows of 512 bytes) and scales into shared memory with cp.async
// *before* griddepcontrol.wait, while w13 still runs; after it only the act rows (w13's
// output) are loaded. Warp j then takes assignment j: lane 4g + t multiplies its word quad of
// each k tile by the act pairs of its k rows (packed fp16, as kernels/moe_gemv.py explains),
// scaled per group in fp32, summed over the k tiles and over the lanes t.
//
// Marlin words (DESIGN §4): word [kt, nb*128 + (4g + t)*4 + tile] holds the K rows 16kt + 2t,
// +1 (nibbles 0, 4 and 1, 5 at +8, +9) of columns 64nb + 16tile + g (nibbles 0, 1, 4, 5) and
// + 8 (nibbles 2, 3, 6, 7); the scale row of a group holds, in its 16-byte vector g, the pairs
// (column 16 tile + g, column 16 tile + g + 8) for tiles 0..3.
//
// Compile-time: I (the expert's intermediate dims on this rank, a multiple of 32), G (group size).
#include "common.cuh"

#define THREADS 256
#define MAXN (THREADS / 32)    // assignments: one a warp
#define KTI (I / 16)           // k tiles of an expert's w2
#define GI (I / G)             // scale groups

extern "C" __global__ void __launch_bounds__(THREADS, 1)
moe_w2(const unsigned short* act, const int* ids, int n,     // act fp16 [n, I]; expert ids [n]
       const unsigned* w2, const unsigned short* s2,            // Marlin [E, I/16, 2H] words, [E, I/G, H] bf16 scales
       float* y, int h, int pdl)                                 // y fp32 [n, H]
{
    extern __shared__ uint4 sm[];
    uint4* words = sm;                                           // [n][KTI][32 lanes]
    uint4* scales = sm + MAXN * KTI * 32;                        // [n][GI][8]
    __shared__ unsigned acts[MAXN][I / 2];                       // act rows, fp16 pairs
    const int t = threadIdx.x, warp = t / 32, lane = t % 32, b = blockIdx.x;
    for (int i = t; i < n * KTI * 32; i += THREADS) {
        const int j = i / (KTI * 32), kt = i / 32 % KTI;
        cp_async16(smem_addr(words + i),
                   reinterpret_cast<const unsigned char*>(w2 + ((long)ids[j] * KTI + kt) * (2 * h) + b * 128) + 16 * (i % 32));
    }
    for (int i = t; i < n * GI * 8; i += THREADS) {
        const int j = i / (GI * 8), grp = i / 8 % GI;
        cp_async16(smem_addr(scales + i),
                   reinterpret_cast<const unsigned char*>(s2 + ((long)ids[j] * GI + grp) * h + b * 64) + 16 * (i % 8));
    }
    asm volatile("cp.async.commit_group;");
    if (pdl) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;");
    }
    for (int i = t; i < n * I / 8; i += THREADS) reinterpret_cast<uint4*>(acts)[i] = ld_v4(act + i * 8);   // w13 wrote them
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    if (warp >= n) return;
    const int g = lane / 4, q = lane % 4;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
    for (int kt = 0; kt < KTI; kt++) {
        const uint4 w = words[(warp * KTI + kt) * 32 + lane], s = scales[(warp * GI + kt * 16 / G) * 8 + g];
        const unsigned wq[4] = {w.x, w.y, w.z, w.w}, sq[4] = {s.x, s.y, s.z, s.w};
        const unsigned xa = acts[warp][8 * kt + q], xb = acts[warp][8 * kt + q + 4];
#pragma unroll
        for (int tile = 0; tile < 4; tile++) {
            float lo, hi;
            word_dot(wq[tile], xa, xb, lo, hi);
            acc[2 * tile] = fmaf(lo, bf16_lo(sq[tile]), acc[2 * tile]);
            acc[2 * tile + 1] = fmaf(hi, bf16_hi(sq[tile]), acc[2 * tile + 1]);
        }
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], 1);
        acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], 2);
    }
    if (q == 0)
#pragma unroll
        for (int i = 0; i < 8; i++) y[(long)warp * h + b * 64 + 16 * (i / 2) + g + 8 * (i % 2)] = acc[i];
}
