// The routed experts of one decode token (kernels/moe_decode.py): its n <= 8 assignments
// (distinct experts), INT4 Marlin weights, one launch.
//
// Program pid has up to two roles; the grid is the larger of the two role counts, one program
// an SM, every program resident at once (the host checks the SM count: programs wait for each
// other below):
//   w13 (pid < KS x P13 x n): unit (j, p) = assignment j's gate columns 64p.. and up columns
//       I + 64p.. (Marlin blocks p and P13 + p), K split s = pid % KS. Each warp streams its
//       share of the split, a scale group (G rows) a stage, through a private ring of STAGES13
//       stages (cp.async, evict-first; each lane reads back only its own words, the scale
//       vectors after a __syncwarp); the warps' sums meet in shared memory (warp order), go to
//       `part`, and the program counts itself done.
//   w2 (pid < H / 64): the 64 output columns of Marlin block pid for every assignment. Its
//       words and scales are issued into shared memory at the start, beside the w13 role's
//       ring; once every w13 program is done (a counter polled by one thread) it sums the
//       splits of every unit in split order into the act rows, SiLU(gate) * up * top-k weight
//       (fp16, in shared memory), warp j multiplies assignment j, and out bf16 [H] gets the sum
//       over the assignments in their order, or (out null) y fp32 [n, H] each row. The last w2
//       program to finish resets the counters.
//
// Marlin words (DESIGN §4): lane 4g + t of a warp takes the 16-byte vector lane of each
// 64-column Marlin block of a k-tile row; its word `tile` holds K rows 16kt + 2t, +1, +8, +9 of
// columns 16 tile + g and + 8; a scale row holds, in its 16-byte vector 8 nb + g, the pairs
// (column 64 nb + 16 tile + g, + 8) for tiles 0..3. Products on the tensor cores: each word is
// the fp16 A operand of an mma.m16n8k16 (`dequant_f16`) and x (or the act row) every column of
// B, so lane 4g + t's c0 / c2 are columns g / g + 8 of the tile whatever t; each scale group's
// fp32 sums are scaled in fp32. Deterministic: fixed summation orders, no float atomics.
//
// Compile-time: H (hidden), I (the expert's intermediate dims on this rank), G (group size),
// KS (w13's K splits a unit).
#include "common.cuh"

#define WARPS 8
#define THREADS (WARPS * 32)
#define MAXN WARPS                         // assignments: one a w2 warp
#define P13 (I / 64)                       // column pairs of w13 (gate block p, up block P13 + p)
#define GK (G / 16)                        // k tiles a scale group (a ring stage)
#define STAGES13 (G <= 64 ? 4 : 2)
#define STAGE13_U4 (GK * 2 * 32 + 16)      // a stage: per lane a gate and an up word vector a k tile; 16 scale vectors
#define RING_U4 (WARPS * STAGES13 * STAGE13_U4)
#define NGRP (H / G)
#define PER ((NGRP + KS - 1) / KS)         // scale groups a w13 program
#define KTI (I / 16)                       // k tiles of w2
#define GI (I / G)                         // scale groups of w2
#define W2_U4 (MAXN * (KTI * 32 + GI * 8)) // w2 words and scales of 8 assignments' 64 columns

struct Shared {
    float red[WARPS][128], part[128];
    unsigned acts[MAXN][I / 2];            // act rows, fp16 pairs
    float rows[MAXN][64];                  // the w2 role's columns of each row
};

// the w13 role: this program's split of unit (j, p) -> sh.part (gate 0..63, up 64..127)
__device__ __forceinline__ void w13_split(uint4* ring, unsigned* xs, Shared& sh, const unsigned short* x, int x_bf16,
                                          long e, int p, int sp, const unsigned* w, const unsigned short* s)
{
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    constexpr int PER_W = (PER + WARPS - 1) / WARPS;
    const int b0 = sp * PER, b1 = min(NGRP, b0 + PER);            // the program's scale groups
    const int g0 = b0 + warp * PER_W, g1 = min(b1, g0 + PER_W);    // the warp's
    uint4* wring = ring + warp * STAGES13 * STAGE13_U4;
    const unsigned long long pol = evict_first();
    const unsigned* wl = w + e * (H / 16) * (4 * I) + 4 * lane;
    const unsigned short* sl = s + e * NGRP * (2 * I) + (lane < 8 ? p : P13 + p) * 64 + 8 * (lane % 8);
    auto issue = [&](int grp) {                                   // group grp into its ring stage
        uint4* st = wring + (grp - g0) % STAGES13 * STAGE13_U4;
#pragma unroll
        for (int kk = 0; kk < GK; kk++) {
            const unsigned* row = wl + (long)(grp * GK + kk) * (4 * I);
            cp16_ef(smem_addr(st + (kk * 2) * 32 + lane), row + p * 128, pol);
            cp16_ef(smem_addr(st + (kk * 2 + 1) * 32 + lane), row + (P13 + p) * 128, pol);
        }
        if (lane < 16) cp16_ef(smem_addr(st + GK * 64 + lane), sl + (long)grp * (2 * I), pol);
    };
#pragma unroll
    for (int i = 0; i < STAGES13 - 1; i++) {
        if (g0 + i < g1) issue(g0 + i);
        cp_commit();
    }
    const unsigned* xp = reinterpret_cast<const unsigned*>(x) + b0 * (G / 2);
    for (int i = threadIdx.x; i < (b1 - b0) * (G / 2); i += THREADS) {
        unsigned v = xp[i];
        if (x_bf16) {
            unsigned hv;
            asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(hv) : "f"(bf16_hi(v)), "f"(bf16_lo(v)));
            v = hv;
        }
        xs[i] = v;
    }
    __syncthreads();
    float acc[16];                                                // [gate|up][tile][column g | g + 8]
#pragma unroll
    for (int i = 0; i < 16; i++) acc[i] = 0.f;
    for (int grp = g0; grp < g1; grp++) {
        if (grp + STAGES13 - 1 < g1) issue(grp + STAGES13 - 1);
        cp_commit();
        cp_wait<STAGES13 - 1>();
        __syncwarp();
        const uint4* st = wring + (grp - g0) % STAGES13 * STAGE13_U4;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float c[4][4] = {};
#pragma unroll
            for (int kk = 0; kk < GK; kk++) {
                const int kx = (grp - b0) * (G / 2) + kk * 8 + t;
                const uint4 wv = st[(kk * 2 + h) * 32 + lane];
                const unsigned wq[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
                for (int tile = 0; tile < 4; tile++) {
                    unsigned a[4];
                    dequant_f16(wq[tile], a);
                    mma_f16(c[tile], a, xs[kx], xs[kx + 4]);
                }
            }
            const uint4 sv = st[GK * 64 + h * 8 + g];
            const unsigned sq[4] = {sv.x, sv.y, sv.z, sv.w};
#pragma unroll
            for (int tile = 0; tile < 4; tile++) {
                acc[h * 8 + 2 * tile] = fmaf(c[tile][0], bf16_lo(sq[tile]), acc[h * 8 + 2 * tile]);
                acc[h * 8 + 2 * tile + 1] = fmaf(c[tile][2], bf16_hi(sq[tile]), acc[h * 8 + 2 * tile + 1]);
            }
        }
        __syncwarp();                                             // the stage is read before it is refilled
    }
    if (t == 0)                                                   // every column of B is x: lanes t hold the same sums
#pragma unroll
        for (int i = 0; i < 16; i++) sh.red[warp][64 * (i / 8) + 16 * (i % 8 / 2) + g + 8 * (i % 2)] = acc[i];
    __syncthreads();
    if (threadIdx.x < 128) {
        float v = 0.f;
        for (int q = 0; q < WARPS; q++) v += sh.red[q][threadIdx.x];
        sh.part[threadIdx.x] = v;
    }
}

// the w2 role: warp j < n multiplies act row j by expert ids[j]'s 64 columns in `words`
__device__ __forceinline__ void w2_columns(const uint4* words, Shared& sh, int n, int b, float* y, unsigned short* out)
{
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const uint4* scales = words + MAXN * KTI * 32;               // [n][GI][8]
    if (warp < n) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // [tile][column g | g + 8]
        for (int grp = 0; grp < GI; grp++) {
            float c[4][4] = {};
#pragma unroll
            for (int kk = 0; kk < GK; kk++) {
                const int kt = grp * GK + kk;
                const uint4 wv = words[(warp * KTI + kt) * 32 + lane];
                const unsigned wq[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
                for (int tile = 0; tile < 4; tile++) {
                    unsigned a[4];
                    dequant_f16(wq[tile], a);
                    mma_f16(c[tile], a, sh.acts[warp][8 * kt + q], sh.acts[warp][8 * kt + q + 4]);
                }
            }
            const uint4 sv = scales[(warp * GI + grp) * 8 + g];
            const unsigned sq[4] = {sv.x, sv.y, sv.z, sv.w};
#pragma unroll
            for (int tile = 0; tile < 4; tile++) {
                acc[2 * tile] = fmaf(c[tile][0], bf16_lo(sq[tile]), acc[2 * tile]);
                acc[2 * tile + 1] = fmaf(c[tile][2], bf16_hi(sq[tile]), acc[2 * tile + 1]);
            }
        }
        if (q == 0)                                              // every column of B is the act row
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int col = 16 * (i / 2) + g + 8 * (i % 2);
                if (out) sh.rows[warp][col] = acc[i];
                else y[(long)warp * H + b * 64 + col] = acc[i];
            }
    }
    if (!out) return;
    __syncthreads();
    if (threadIdx.x < 32) {                                      // a column pair a lane, rows in order
        float s0 = 0.f, s1 = 0.f;
        for (int j = 0; j < n; j++) {
            s0 += sh.rows[j][2 * threadIdx.x];
            s1 += sh.rows[j][2 * threadIdx.x + 1];
        }
        reinterpret_cast<unsigned*>(out)[b * 32 + threadIdx.x] = bf16x2(s0, s1);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
decode_moe(const unsigned short* x, int x_bf16,                   // [H]: bf16 (x_bf16) or fp16
           const int* ids, const float* topk_w, int n,            // [n] experts, their weights
           const unsigned* w13, const unsigned short* s13,        // Marlin [E, H/16, 4I], scales [E, H/G, 2I]
           const unsigned* w2, const unsigned short* s2,          // Marlin [E, I/16, 2H], scales [E, I/G, H]
           float* part,                                           // fp32 [n P13, KS, 128]: w13 splits' sums
           int* counters,                                         // [2], zero: w13 programs done, w2 programs finished
           float* y, unsigned short* out,                         // y fp32 [n, H] (out null) or out bf16 [H]
           int pdl)
{
    extern __shared__ uint4 smem[];
    __shared__ Shared sh;
    uint4* ring = smem;                                           // the w13 role's rings
    uint4* words = smem + RING_U4;                                // the w2 role's words and scales
    unsigned* xs = reinterpret_cast<unsigned*>(words + W2_U4);    // the w13 role's x pairs, fp16
    const int pid = blockIdx.x, units = n * P13;
    const bool has13 = pid < units * KS, has2 = pid < H / 64;
    int* done = counters;
    pdl_enter(pdl);
    if (has2) {
        for (int i = threadIdx.x; i < n * KTI * 32; i += THREADS) {
            const int j = i / (KTI * 32), kt = i / 32 % KTI;
            cp_async16(smem_addr(words + i), w2 + ((long)ids[j] * KTI + kt) * (2 * H) + pid * 128 + 4 * (i % 32));
        }
        for (int i = threadIdx.x; i < n * GI * 8; i += THREADS) {
            const int j = i / (GI * 8), grp = i / 8 % GI;
            cp_async16(smem_addr(words + MAXN * KTI * 32 + i), s2 + ((long)ids[j] * GI + grp) * H + pid * 64 + 8 * (i % 8));
        }
        cp_commit();
    }
    if (has13) {
        const int unit = pid / KS, sp = pid % KS;
        w13_split(ring, xs, sh, x, x_bf16, ids[unit / P13], unit % P13, sp, w13, s13);
        if (threadIdx.x < 128) part[((long)unit * KS + sp) * 128 + threadIdx.x] = sh.part[threadIdx.x];
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(done, 1);
    }
    if (!has2) return;
    if (threadIdx.x == 0)
        while (ld_acquire(done) < units * KS) __nanosleep(64);
    __syncthreads();
    for (int i = threadIdx.x; i < n * I / 4; i += THREADS) {      // 4 act columns a step: sum the splits in order
        const int unit = i / 16, c = 4 * (i % 16), j = unit / P13;
        const float* up = part + (long)unit * KS * 128 + c;
        float4 gs = make_float4(0.f, 0.f, 0.f, 0.f), us = gs;
#pragma unroll
        for (int r = 0; r < KS; r++) {
            const float4 gv = ld_f32x4(up + r * 128), uv = ld_f32x4(up + r * 128 + 64);
            gs.x += gv.x; gs.y += gv.y; gs.z += gv.z; gs.w += gv.w;
            us.x += uv.x; us.y += uv.y; us.z += uv.z; us.w += uv.w;
        }
        const float wt = topk_w[j];
        unsigned* dst = &sh.acts[j][((unit % P13) * 64 + c) / 2];
        dst[0] = (unsigned)to_f16(silu_mul(gs.x, us.x) * wt) | (unsigned)to_f16(silu_mul(gs.y, us.y) * wt) << 16;
        dst[1] = (unsigned)to_f16(silu_mul(gs.z, us.z) * wt) | (unsigned)to_f16(silu_mul(gs.w, us.w) * wt) << 16;
    }
    cp_wait<0>();
    __syncthreads();
    w2_columns(words, sh, n, pid, y, out);
    // counted at the end, off the path from the wait to the output: the last w2 program to count
    // has seen every w13 program done and no program still polls, so it resets the counters
    if (threadIdx.x == 0 && atomicAdd(done + 1, 1) == H / 64 - 1) {
        *done = 0;
        done[1] = 0;
    }
}
