// W4A16 MoE for many tokens an expert (kernels/moe_wide.py): tokens as the mma's 16-row A
// operand (ldmatrix from shared memory), the Marlin words as its 8-column B operand, so one
// dequantized word feeds 2 MT mma.m16n8k16 (MT 16-token tiles) instead of moe_marlin's 2.
//
// Three launches after moe_marlin's planning (moe_plan with blocks of CH = 16 MT rows):
//   wide_w13  x [T, H] -> act [rows, I] bf16 (sorted rows): SiLU(gate) * up;
//   wide_w2   act -> ypart [T*k, H] bf16: each row times its top-k weight;
//   wide_ksum ypart -> out [T, H] bf16: each token's k rows summed in slot order.
// A program of WARPS warps takes items i = program, program + grid, ...: w13 (block, chunk of
// 32 WARPS gate and as many up columns; warp w the 16-column tiles 2(w%2), 2(w%2)+1 of gate
// Marlin block w/2 of the chunk and the same of up), w2 (block, chunk of 64 WARPS output
// columns; warp w Marlin block w, 4 tiles). The program streams one 32-row K stage at a time
// of its block's rows (16 MT x 32 bf16, swizzled so ldmatrix meets no bank conflict), the
// item's words and scales through a ring of STAGES stages (cp.async, all threads copy, one
// __syncthreads a stage); the ring runs on across the program's items.
//
// Marlin word of lane 4g + t holds the nibbles (k, n) of a 16x16 tile: 0 (2t, g) 1 (2t+8, g)
// 2 (2t, g+8) 3 (2t+8, g+8) 4 (2t+1, g) 5 (2t+9, g) 6 (2t+1, g+8) 7 (2t+9, g+8), so the nibble
// pairs (0, 4), (1, 5) are the B fragment (b0b1, b2b3) of the n8 tile of columns 0-7 and
// (2, 6), (3, 7) that of columns 8-15. LOP3 (0x43004300) and one bf16x2 subtract give q - 8
// exactly, one bf16x2 multiply by the column's scale (rounded to bf16 once) the weight.
//
// Determinism: no K split, no atomics; the weighted rows (bf16) are summed in fp32 in slot
// order. The k sum is its own launch: fused into w2's epilogue (the last of a token's k items
// summing, by an atomic ticket) it cost 5-25 % more at T = 1024-4096 (docs/notes/moe.md).
//
// Compile-time: MT (16-row tiles a block), STAGES, WARPS, MINB (programs an SM the registers
// are capped for), G (group), H, I, TOPK.
#include "common.cuh"

#define CH (16 * MT)
#define THREADS (WARPS * 32)
#define NB WARPS                  // Marlin blocks an item: w13 WARPS/2 gate + WARPS/2 up (half each), w2 WARPS
#define XV (CH * 4)               // 16-byte vectors a stage: x rows (CH x 32 bf16)
#define XI ((XV + THREADS - 1) / THREADS)  // x vectors a thread
#define WV (NB * 64)              // words: NB blocks x 2 k-tiles x 32 lanes
#define SV (NB * 8)               // scales: NB blocks x 64 bf16
#define STAGE_V (XV + WV + SV)

static_assert(SV <= THREADS && WV % THREADS == 0, "one scale vector a thread at most, whole word vectors a thread");
static_assert(MT == 1 || MT == 2 || MT == 4, "MT is 1, 2 or 4");
static_assert(WARPS == 4 || WARPS == 8, "WARPS is 4 or 8");

__device__ __forceinline__ void mma_bf16(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// word q of a 16x16 tile, scale pair sc (columns g, g + 8) -> B fragments b[0..1] (columns 0-7), b[2..3] (8-15)
__device__ __forceinline__ void dequant_b(unsigned q, unsigned sc, unsigned b[4]) {
    const unsigned slo = __byte_perm(sc, 0, 0x1010), shi = __byte_perm(sc, 0, 0x3232);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const unsigned s = q >> (4 * i);
        asm("lop3.b32 %0, %1, 0x000f000f, 0x43004300, 0xea;" : "=r"(b[i]) : "r"(s));
        asm("sub.rn.bf16x2 %0, %1, %2;" : "=r"(b[i]) : "r"(b[i]), "r"(0x43084308u));
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(b[i]) : "r"(b[i]), "r"(i < 2 ? slo : shi), "r"(0x80008000u));
    }
}

__device__ __forceinline__ void zero(float (&acc)[MT][4][2][4]) {
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int f = 0; f < 4; f++)
#pragma unroll
            for (int n = 0; n < 2; n++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[m][f][n][i] = 0.f;
}

// the warp's products of one stage over the first MV 16-row tiles
template <bool W13, int MV>
__device__ __forceinline__ void stage_mma(float (&acc)[MT][4][2][4], const uint4* slot, int warp, int lane) {
    const int g = lane / 4, mi = lane / 8, rr = lane % 8 + 8 * (mi % 2);
    const unsigned xs = smem_addr(slot);
    const uint4* ws = slot + XV;
    const uint4* ss = slot + XV + WV;
    unsigned sc[4];                                         // the warp's 4 tiles' scale pairs
    if constexpr (W13) {
        const int h = warp % 2;
        const uint2 sg = ((const uint2*)(ss + (warp / 2) * 8 + g))[h], su = ((const uint2*)(ss + (NB / 2 + warp / 2) * 8 + g))[h];
        sc[0] = sg.x; sc[1] = sg.y; sc[2] = su.x; sc[3] = su.y;
    } else {
        const uint4 s4 = ss[warp * 8 + g];
        sc[0] = s4.x; sc[1] = s4.y; sc[2] = s4.z; sc[3] = s4.w;
    }
#pragma unroll
    for (int kt = 0; kt < 2; kt++) {
        unsigned a[MV][4];
#pragma unroll
        for (int m = 0; m < MV; m++) ldsm4(a[m], xs + xoff(16 * m + rr, 2 * kt + mi / 2));
        unsigned q[4];
        if constexpr (W13) {
            const int h = warp % 2;
            const uint2 qg = ((const uint2*)(ws + (warp / 2) * 64 + kt * 32 + lane))[h];
            const uint2 qu = ((const uint2*)(ws + (NB / 2 + warp / 2) * 64 + kt * 32 + lane))[h];
            q[0] = qg.x; q[1] = qg.y; q[2] = qu.x; q[3] = qu.y;
        } else {
            const uint4 q4 = ws[warp * 64 + kt * 32 + lane];
            q[0] = q4.x; q[1] = q4.y; q[2] = q4.z; q[3] = q4.w;
        }
#pragma unroll
        for (int f = 0; f < 4; f++) {
            unsigned b[4];
            dequant_b(q[f], sc[f], b);
#pragma unroll
            for (int m = 0; m < MV; m++) {
                mma_bf16(acc[m][f][0], a[m], b[0], b[1]);
                mma_bf16(acc[m][f][1], a[m], b[2], b[3]);
            }
        }
    }
}

template <bool W13>
__device__ __forceinline__ void wide(const unsigned short* xin,                 // w13: x [T, H]; w2: act [rows, I]
                                     const unsigned* w, const unsigned short* s,
                                     const int* sorted, const int* block_expert, const int* block_rows, const int* n_blocks,
                                     const float* topk_w,
                                     unsigned short* out,                    // w13: act; w2: ypart [T*k, H]
                                     int pdl)
{
    constexpr int K = W13 ? H : I, N = W13 ? 2 * I : H, NST = K / 32;
    constexpr int CHUNKS = W13 ? I / (32 * WARPS) : H / (64 * WARPS);
    extern __shared__ uint4 smem[];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    // Marlin block of item block j (0..NB-1) in chunk c
    auto nb_of = [](int j, int c) { return W13 ? (j < NB / 2 ? c * NB / 2 + j : I / 64 + c * NB / 2 + j - NB / 2) : c * NB + j; };
    pdl_enter(pdl);
    const int total = *n_blocks * CHUNKS;
    const int q_end = total > (int)blockIdx.x ? (total - 1 - (int)blockIdx.x) / (int)gridDim.x * NST + NST : 0;

    const uint4* xsrc[XI];                                  // issue state: this thread's sources of the item
    const uint4* wsrc[WV / THREADS];
    const uint4* ssrc = nullptr;
    auto issue = [&](int q) {
        if (q < q_end) {
            const int st = q % NST;
            if (st == 0) {
                const int item = blockIdx.x + q / NST * gridDim.x, c = item % CHUNKS, blk = item / CHUNKS;
                const int e = block_expert[blk], rows = block_rows[blk];
#pragma unroll
                for (int i = 0; i < XI; i++) {
                    const int v = tid + i * THREADS;
                    xsrc[i] = nullptr;
                    if (v < XV && v / 4 < rows) {
                        const long row = W13 ? sorted[blk * CH + v / 4] / TOPK : (long)blk * CH + v / 4;
                        xsrc[i] = (const uint4*)(xin + row * K) + v % 4;
                    }
                }
                const uint4* we = (const uint4*)(w + (long)e * (K / 16) * (2 * N));
#pragma unroll
                for (int i = 0; i < WV / THREADS; i++) {
                    const int v = tid + i * THREADS, j = v / 64;
                    wsrc[i] = we + (v / 32 % 2) * (N / 2) + nb_of(j, c) * 32 + v % 32;
                }
                if (tid < SV) ssrc = (const uint4*)(s + (long)e * (K / G) * N + nb_of(tid / 8, c) * 64) + tid % 8;
            }
            uint4* slot = smem + (q % STAGES) * STAGE_V;
#pragma unroll
            for (int i = 0; i < XI; i++) {
                const int v = tid + i * THREADS;
                if (v < XV) cp16z(smem_addr(slot) + xoff(v / 4, v % 4), xsrc[i] ? xsrc[i] + 4 * st : (const uint4*)xin, xsrc[i] != nullptr);
            }
#pragma unroll
            for (int i = 0; i < WV / THREADS; i++) cp_async16(smem_addr(slot + XV + tid + i * THREADS), wsrc[i] + (long)st * N);
            if (tid < SV) cp_async16(smem_addr(slot + XV + WV + tid), ssrc + (long)(st * 32 / G) * (N / 8));
        }
        cp_commit();
    };

    float acc[MT][4][2][4];
    zero(acc);
#pragma unroll
    for (int i = 0; i < STAGES - 1; i++) issue(i);
    int c = 0, blk = 0, rows = 0, mv = 0;
    for (int q = 0; q < q_end; q++) {
        const int st = q % NST;
        if (st == 0) {
            const int item = blockIdx.x + q / NST * gridDim.x;
            c = item % CHUNKS; blk = item / CHUNKS; rows = block_rows[blk]; mv = (rows + 15) / 16;
        }
        cp_wait<STAGES - 2>();
        __syncthreads();                                    // stage q arrived; stage q - 1's slot is free
        issue(q + STAGES - 1);
        const uint4* slot = smem + (q % STAGES) * STAGE_V;
        if constexpr (MT >= 2) {
            if (mv == 1) stage_mma<W13, 1>(acc, slot, warp, lane);
            else if constexpr (MT == 4) {
                if (mv == 2) stage_mma<W13, 2>(acc, slot, warp, lane);
                else if (mv == 3) stage_mma<W13, 3>(acc, slot, warp, lane);
                else stage_mma<W13, 4>(acc, slot, warp, lane);
            } else stage_mma<W13, MT>(acc, slot, warp, lane);
        } else stage_mma<W13, 1>(acc, slot, warp, lane);
        if (st != NST - 1) continue;

        // ---- the item's epilogue: w13 writes SiLU(gate) * up, w2 each row times its top-k weight
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const int r = 16 * m + g + 8 * hf;
                if (r >= rows) continue;
                if constexpr (W13) {
                    unsigned short* dst = out + (long)(blk * CH + r) * I + (c * NB / 2 + warp / 2) * 64 + 32 * (warp % 2) + 2 * t;
#pragma unroll
                    for (int tt = 0; tt < 2; tt++)
#pragma unroll
                        for (int n = 0; n < 2; n++) {
                            const float* gt = acc[m][tt][n];
                            const float* up = acc[m][2 + tt][n];
                            *(unsigned*)(dst + 16 * tt + 8 * n) =
                                bf16x2(silu_mul(gt[2 * hf], up[2 * hf]), silu_mul(gt[2 * hf + 1], up[2 * hf + 1]));
                        }
                } else {
                    const int asg = sorted[blk * CH + r];
                    const float wt = topk_w[asg];
                    unsigned short* dst = out + (long)asg * H + (c * NB + warp) * 64 + 2 * t;
#pragma unroll
                    for (int f = 0; f < 4; f++)
#pragma unroll
                        for (int n = 0; n < 2; n++)
                            *(unsigned*)(dst + 16 * f + 8 * n) = bf16x2(acc[m][f][n][2 * hf] * wt, acc[m][f][n][2 * hf + 1] * wt);
                }
            }
        zero(acc);
    }
    cp_wait<0>();
}

extern "C" __global__ void __launch_bounds__(THREADS, MINB)
wide_w13(const unsigned short* x, const unsigned* w, const unsigned short* s,   // x bf16 [T, H]; Marlin [E, H/16, 4I], [E, H/G, 2I]
         const int* sorted, const int* block_expert, const int* block_rows, const int* n_blocks,
         unsigned short* act,                                                     // bf16 [rows, I]
         int pdl)
{
    wide<true>(x, w, s, sorted, block_expert, block_rows, n_blocks, nullptr, act, pdl);
}

extern "C" __global__ void __launch_bounds__(THREADS, MINB)
wide_w2(const unsigned short* act, const unsigned* w, const unsigned short* s,  // act bf16 [rows, I]; Marlin [E, I/16, 2H], [E, I/G, H]
        const int* sorted, const int* block_expert, const int* block_rows, const int* n_blocks,
        const float* topk_w,                                                      // fp32 [T*k]
        unsigned short* ypart,                                                    // bf16 [T*k, H]: each slot's weighted row
        int pdl)
{
    wide<false>(act, w, s, sorted, block_expert, block_rows, n_blocks, topk_w, ypart, pdl);
}

// the sum over the k slots after wide_w2: 8 columns a thread, H / 8 threads a token, fp32 in slot order
extern "C" __global__ void __launch_bounds__(256)
wide_ksum(const unsigned short* ypart, unsigned short* out, int tokens, int pdl)   // ypart bf16 [T*k, H] -> out [T, H]
{
    pdl_enter(pdl);
    const long i = (long)blockIdx.x * 256 + threadIdx.x;
    if (i >= (long)tokens * (H / 8)) return;
    const int tok = (int)(i / (H / 8)), col = (int)(i % (H / 8)) * 8;
    uint4 v[TOPK];
#pragma unroll
    for (int j = 0; j < TOPK; j++) v[j] = ld_v4(ypart + (long)(tok * TOPK + j) * H + col);
    float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < TOPK; j++) {
        const unsigned u[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
        for (int p = 0; p < 4; p++) {
            sum[2 * p] += bf16_lo(u[p]);
            sum[2 * p + 1] += bf16_hi(u[p]);
        }
    }
    *(uint4*)(out + (long)tok * H + col) =
        make_uint4(bf16x2(sum[0], sum[1]), bf16x2(sum[2], sum[3]), bf16x2(sum[4], sum[5]), bf16x2(sum[6], sum[7]));
}
