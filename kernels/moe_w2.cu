// The routed experts' down projection of one decode token (kernels/moe_w2.py): y[j] = act[j]
// w2[ids[j]] for its n <= 8 assignments j, INT4 Marlin weights, fp32 rows out. With the shared
// expert (IS > 0) the kernel writes the token's whole MoE output instead, bf16
// y = sum_j act[j] w2[ids[j]] + sact wsd^T (sact the shared expert's act, wsd its down
// projection), and the launch that did the shared down projection and the sum over j goes.
//
// Program b owns the 64 output columns of Marlin block b for every assignment. The expert ids
// come from the router, two launches back, and the w13 GEMV between waits for the router
// before it lets this kernel in (kernels/pdl.py's rules), so they are final before this
// kernel's wait: the program issues its
// words (n x I/16 k-tile rows of 512 bytes) and scales into shared memory with cp.async
// *before* griddepcontrol.wait, while w13 still runs, and so its 64 rows of wsd (static); after
// it only the act rows (w13's output) and sact are loaded. Warp j then takes assignment j: lane
// 4g + t multiplies its word quad of each k tile by the act pairs of its k rows (packed fp16, as
// kernels/moe_gemv.py explains), scaled per group in fp32, summed over the k tiles and over the
// lanes t. With IS, warp w also takes the wsd rows w, w + 8, .. of the program (a 16-byte
// vector a lane, fp32 sums), and thread c < 64 adds column c's n + 1 sums in fp32.
//
// Marlin words (DESIGN §4): word [kt, nb*128 + (4g + t)*4 + tile] holds the K rows 16kt + 2t,
// +1 (nibbles 0, 4 and 1, 5 at +8, +9) of columns 64nb + 16tile + g (nibbles 0, 1, 4, 5) and
// + 8 (nibbles 2, 3, 6, 7); the scale row of a group holds, in its 16-byte vector g, the pairs
// (column 16 tile + g, column 16 tile + g + 8) for tiles 0..3.
//
// Compile-time: I (the expert's intermediate dims on this rank, a multiple of 32), G (group
// size), IS (the shared expert's intermediate dims on this rank, a multiple of 8; 0: none).
#include "common.cuh"

#define THREADS 256
#define WARPS (THREADS / 32)
#define MAXN WARPS             // assignments: one a warp
#define KTI (I / 16)           // k tiles of an expert's w2
#define GI (I / G)             // scale groups
#define SV (IS / 8)            // 16-byte vectors of a wsd row

extern "C" __global__ void __launch_bounds__(THREADS, 1)
moe_w2(const unsigned short* act, const int* ids, int n,     // act fp16 [n, I]; expert ids [n]
       const unsigned* w2, const unsigned short* s2,            // Marlin [E, I/16, 2H] words, [E, I/G, H] bf16 scales
       const unsigned short* sact, const unsigned short* wsd,   // IS: shared act bf16 [IS], down bf16 [H, IS]
       void* y, int h, int pdl)                                 // y fp32 [n, H]; IS: bf16 [H]
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
#if IS
    uint4* down = scales + MAXN * GI * 8;                        // [64][SV]: wsd rows 64b..64b + 63
    __shared__ uint4 sacts[SV];                                  // sact, bf16
    __shared__ float sums[MAXN + 1][64];                         // column sums: the assignments', the shared
    for (int i = t; i < 64 * SV; i += THREADS)
        cp_async16(smem_addr(down + i), wsd + ((long)b * 64 + i / SV) * IS + i % SV * 8);
#endif
    asm volatile("cp.async.commit_group;");
    if (pdl) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;");
    }
    for (int i = t; i < n * I / 8; i += THREADS) reinterpret_cast<uint4*>(acts)[i] = ld_v4(act + i * 8);   // w13 wrote them
#if IS
    for (int i = t; i < SV; i += THREADS) sacts[i] = ld_v4(sact + i * 8);   // the shared gate/up kernel wrote it
#endif
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
#if IS
    for (int c = warp; c < 64; c += WARPS) {                     // the shared down projection of column 64b + c
        float v = 0.f;
        for (int i = lane; i < SV; i += 32) {
            const uint4 w = down[c * SV + i], a = sacts[i];
            const unsigned wq[4] = {w.x, w.y, w.z, w.w}, aq[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int p = 0; p < 4; p++)
                v = fmaf(bf16_lo(wq[p]), bf16_lo(aq[p]), fmaf(bf16_hi(wq[p]), bf16_hi(aq[p]), v));
        }
        v = warp_sum(v);
        if (lane == 0) sums[MAXN][c] = v;
    }
#endif
    const int g = lane / 4, q = lane % 4;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (warp < n) {
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
    }
#if IS
    if (warp < n && q == 0)
#pragma unroll
        for (int i = 0; i < 8; i++) sums[warp][16 * (i / 2) + g + 8 * (i % 2)] = acc[i];
    __syncthreads();
    if (t < 64) {
        float v = sums[MAXN][t];
        for (int j = 0; j < n; j++) v += sums[j][t];
        static_cast<unsigned short*>(y)[b * 64 + t] = to_bf16(v);
    }
#else
    if (warp < n && q == 0)
#pragma unroll
        for (int i = 0; i < 8; i++) static_cast<float*>(y)[(long)warp * h + b * 64 + 16 * (i / 2) + g + 8 * (i % 2)] = acc[i];
#endif
}
