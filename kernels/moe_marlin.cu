// W4A16 MoE on Marlin-packed INT4 experts, weights as the mma's A operand (kernels/moe_marlin.py).
//
// Three launches a layer, no host syncs:
//   moe_plan  one program: counts each expert's (token, slot) assignments, pads each expert to
//             blocks of CH = 8 NG rows and writes the sorted assignments, each block's expert
//             and row count, and the number of blocks (read by the GEMMs, never by the host);
//   moe_w13   x [T, H] -> act [rows, I] (sorted rows): SiLU(gate) * up;
//   moe_w2    act -> out [T, H] bf16: each row times its top-k weight, summed over the k slots.
// Work items: w13 (block, gate/up block pair p, K split s), w2 (block, W2B consecutive
// 64-column Marlin blocks p). Every warp of the grid takes items i = warp, warp + warps, ... (a
// persistent loop over a count read from memory) and streams its weights through a private
// ring of STAGES stages in shared memory (cp.async, evict-first). A stage holds each lane's
// own 16-byte words, the item's scales (one copy: lane 8j + g' copies block j's vector g') and
// the B rows (lane 4g + t copies 16-byte chunk t of token g's 32 K values, swizzled; ldmatrix
// reads them back as B fragments), so one __syncwarp a stage orders the lanes' copies and reads.
//
// Marlin word [kt, nb*128 + lane*4 + tile], lane = 4g + t, holds the nibbles (k, n) of the
// 16x16 tile (16kt, 64nb + 16tile): 0 (2t, g) 1 (2t+8, g) 2 (2t, g+8) 3 (2t+8, g+8)
// 4 (2t+1, g) 5 (2t+9, g) 6 (2t+1, g+8) 7 (2t+9, g+8). With the tile transposed as an
// m16n8k16 A operand (rows n, columns k), lane (g, t) needs a0a1 = (n g, k 2t..2t+1) =
// nibbles 0,4; a2a3 = (g+8, 2t..) = 2,6; a4a5 = (g, 2t+8..) = 1,5; a6a7 = (g+8, 2t+8..) = 3,7.
// LOP3 with 0x43004300 turns nibbles (i, i+4) (bits 4i and 16+4i after a shift) into the
// bf16 pair 128 + q, and one bf16x2 subtract of 136 gives q - 8 exactly. The B operand is 8
// tokens (rows of x, or of act for w2): lane (g, t) holds token g's k pairs 2t and 2t+8. The
// fp32 product of one scale group (32 K rows = one stage) is scaled per row n in fp32.
//
// PDL (kernels/pdl.py): each kernel takes a mode `pdl` and enters (waits for the kernel before)
// before it reads anything a kernel wrote; the host launches it with the PDL attribute when > 0.
//
// Determinism: a K split writes fp32 partials and the last of an item's splits to finish (an
// atomic ticket) sums them in split order; w2's k slots (weighted rows rounded to bf16, half
// the scratch traffic of fp32) are summed in fp32 by the last of a token's k items in slot
// order. Tickets are reset by their last user, so buffers stay zero.
//
// Compile-time: NG (8-token groups an item), STAGES, WARPS (a program), G (group size), K
// dims H (hidden), I (intermediate), TOPK, W2B (w2's Marlin blocks an item).
#include "common.cuh"

#define CH (8 * NG)
#define THREADS (WARPS * 32)
#define WVEC(NBLK) (64 * (NBLK))                           // 16-byte vectors a stage: words, 2 k-tiles x 32 lanes a block
#define SVEC(NBLK) (8 * (NBLK))                            // scales, 64 bf16 a block
#define XVEC(NBLK, ng) (WVEC(NBLK) + SVEC(NBLK) + 32 * (ng))  // B rows of 8-token group ng, 8 tokens x 4 chunks
#define STAGE_V(NBLK) XVEC(NBLK, NG)
#define MAXE 1024

// nibbles of q as the four bf16x2 A registers (q - 8 each)
__device__ __forceinline__ void dequant(unsigned q, unsigned a[4]) {
    unsigned p[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const unsigned s = q >> (4 * i);
        asm("lop3.b32 %0, %1, 0x000f000f, 0x43004300, 0xea;" : "=r"(p[i]) : "r"(s));
        asm("sub.rn.bf16x2 %0, %1, %2;" : "=r"(p[i]) : "r"(p[i]), "r"(0x43084308u));
    }
    a[0] = p[0]; a[1] = p[2]; a[2] = p[1]; a[3] = p[3];
}
__device__ __forceinline__ void mma(float d[4], const unsigned a[4], unsigned b0, unsigned b1, const float c[4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%10, %11, %12, %13};"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1),
                   "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// ------------------------------------------------------------------------------------ planning

extern "C" __global__ void __launch_bounds__(1024, 1)
moe_plan(const int* ids, int n, int n_experts, int* sorted, int* block_expert, int* block_rows, int* n_blocks, int pdl)
{
    __shared__ int cnt[MAXE], start[MAXE], wsum[32];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    pdl_enter(pdl);
    for (int e = tid; e < n_experts; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) atomicAdd(&cnt[ids[i]], 1);
    __syncthreads();
    const int c = tid < n_experts ? cnt[tid] : 0, nb = (c + CH - 1) / CH;
    int inc = nb;                                           // inclusive scan of blocks over experts
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
        const int v = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += v;
    }
    if (lane == 31) wsum[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        int v = lane < blockDim.x / 32 ? wsum[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o *= 2) {
            const int u = __shfl_up_sync(0xffffffffu, v, o);
            if (lane >= o) v += u;
        }
        wsum[lane] = v;
    }
    __syncthreads();
    const int excl = inc - nb + (warp ? wsum[warp - 1] : 0);
    if (tid < n_experts) {
        start[tid] = excl * CH;
        for (int b = 0; b < nb; b++) {
            block_expert[excl + b] = tid;
            block_rows[excl + b] = min(CH, c - b * CH);
        }
        cnt[tid] = 0;                                       // now the fill cursor
    }
    if (tid == blockDim.x - 1) *n_blocks = excl + nb;
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) {
        const int e = ids[i];
        sorted[start[e] + atomicAdd(&cnt[e], 1)] = i;
    }
}

// ------------------------------------------------------------------------------------ streaming

// acc[j][tile][ng][4] += rows n of Marlin blocks nb0 + j*nb_step (j < NBLK) of expert e over
// stages [st0, st1) (32 K rows each), times the B rows xrow[ng] (bf16, K contiguous), for the
// first NV 8-token groups (the others are neither loaded nor multiplied; NV is a template
// argument so that no mma sits under a branch: a predicated mma.sync costs a WARPSYNC)
template <int KDIM, int NDIM, int NBLK, int NV>
__device__ __forceinline__ void stream(float (&acc)[NBLK][4][NG][4], uint4* ring, const unsigned* w, const unsigned short* s,
                                       int e, int nb0, int nb_step, int st0, int st1,
                                       const unsigned short* const (&xrow)[NG], const bool (&xval)[NG],
                                       unsigned long long pol)
{
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const unsigned* wl = w + (long)e * (KDIM / 16) * (2 * NDIM) + lane * 4;
    const bool copies_scale = lane < SVEC(NBLK);           // lane 8j + g' copies block j's scale vector g'
    const unsigned short* sl = s + (long)e * (KDIM / G) * NDIM + (nb0 + min(lane / 8, NBLK - 1) * nb_step) * 64 + lane % 8 * 8;
    const unsigned base = smem_addr(ring), xput = xoff(g, t), xget = xoff(lane % 8, lane / 8);
    auto issue = [&](int st) {
        const unsigned slot = base + (st % STAGES) * STAGE_V(NBLK) * 16;
        if (st < st1) {
            const int kt = 2 * st;
#pragma unroll
            for (int j = 0; j < NBLK; j++) {
                const unsigned* src = wl + (long)kt * (2 * NDIM) + (nb0 + j * nb_step) * 128;
                cp16_ef(slot + (64 * j + lane) * 16, src, pol);
                cp16_ef(slot + (64 * j + 32 + lane) * 16, src + 2 * NDIM, pol);
            }
            if (copies_scale) cp_async16(slot + (WVEC(NBLK) + lane) * 16, sl + (long)(kt * 16 / G) * NDIM);
#pragma unroll
            for (int ng = 0; ng < NV; ng++)
                cp16z(slot + XVEC(NBLK, ng) * 16 + xput, xrow[ng] + 32 * st + 8 * t, xval[ng]);
        }
        cp_commit();
    };
#pragma unroll
    for (int i = 0; i < STAGES - 1; i++) issue(st0 + i);
    for (int st = st0; st < st1; st++) {
        cp_wait<STAGES - 2>();                              // this lane's copies of stage st have landed,
        __syncwarp();                                       // the other lanes' too, and all read stage st - 1
        issue(st + STAGES - 1);                             // into stage st - 1's slot
        const unsigned slot = base + (st % STAGES) * STAGE_V(NBLK) * 16;
        const uint4* vec = ring + (st % STAGES) * STAGE_V(NBLK);
        unsigned xv[NV][4];                                 // token g's k pairs 2t, 2t+8, 2t+16, 2t+24
        float c0[NV][4];                                    // zero: each group's product starts here
#pragma unroll
        for (int ng = 0; ng < NV; ng++) {
            ldsm4(xv[ng], slot + XVEC(NBLK, ng) * 16 + xget);
#pragma unroll
            for (int i = 0; i < 4; i++) c0[ng][i] = 0.f;
        }
#pragma unroll
        for (int j = 0; j < NBLK; j++) {
            const uint4 w0 = vec[64 * j + lane], w1 = vec[64 * j + 32 + lane], sc = vec[WVEC(NBLK) + 8 * j + g];
            const unsigned wq0[4] = {w0.x, w0.y, w0.z, w0.w}, wq1[4] = {w1.x, w1.y, w1.z, w1.w};
            const unsigned sq[4] = {sc.x, sc.y, sc.z, sc.w};
#pragma unroll
            for (int tile = 0; tile < 4; tile++) {
                unsigned a0[4], a1[4];
                dequant(wq0[tile], a0);
                dequant(wq1[tile], a1);
                const float slo = bf16_lo(sq[tile]), shi = bf16_hi(sq[tile]);
#pragma unroll
                for (int ng = 0; ng < NV; ng++) {
                    float c[4];
                    mma(c, a0, xv[ng][0], xv[ng][1], c0[ng]);
                    mma(c, a1, xv[ng][2], xv[ng][3], c);
                    float* d = acc[j][tile][ng];
                    d[0] = fmaf(c[0], slo, d[0]);
                    d[1] = fmaf(c[1], slo, d[1]);
                    d[2] = fmaf(c[2], shi, d[2]);
                    d[3] = fmaf(c[3], shi, d[3]);
                }
            }
        }
    }
    cp_wait<0>();
    __syncwarp();                                           // every lane done with the ring before the next item's copies
}

// stream over the item's ngv valid groups (warp-uniform): one instantiation per count up to 3, NG above
template <int KDIM, int NDIM, int NBLK>
__device__ __forceinline__ void stream_valid(float (&acc)[NBLK][4][NG][4], uint4* ring, const unsigned* w,
                                             const unsigned short* s, int e, int nb0, int nb_step, int st0, int st1,
                                             const unsigned short* const (&xrow)[NG], const bool (&xval)[NG], int ngv,
                                             unsigned long long pol)
{
    if constexpr (NG > 1) if (ngv == 1) return stream<KDIM, NDIM, NBLK, 1>(acc, ring, w, s, e, nb0, nb_step, st0, st1, xrow, xval, pol);
    if constexpr (NG > 2) if (ngv == 2) return stream<KDIM, NDIM, NBLK, 2>(acc, ring, w, s, e, nb0, nb_step, st0, st1, xrow, xval, pol);
    if constexpr (NG > 3) if (ngv == 3) return stream<KDIM, NDIM, NBLK, 3>(acc, ring, w, s, e, nb0, nb_step, st0, st1, xrow, xval, pol);
    stream<KDIM, NDIM, NBLK, NG>(acc, ring, w, s, e, nb0, nb_step, st0, st1, xrow, xval, pol);
}

template <int NBLK>
__device__ __forceinline__ void zero(float (&acc)[NBLK][4][NG][4]) {
#pragma unroll
    for (int j = 0; j < NBLK; j++)
#pragma unroll
        for (int f = 0; f < 4; f++)
#pragma unroll
            for (int ng = 0; ng < NG; ng++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[j][f][ng][i] = 0.f;
}


// ------------------------------------------------------------------------------------ w13

extern "C" __global__ void __launch_bounds__(THREADS)
moe_w13(const unsigned short* x,                                  // bf16 [T, H]
        const unsigned* w, const unsigned short* s,               // Marlin [E, H/16, 4I], scales [E, H/G, 2I]
        const int* sorted, const int* block_expert, const int* block_rows, const int* n_blocks,
        int splits, int rows_max, float* part,                    // fp32 [splits, rows_max, 2I] (splits > 1)
        int* tickets,                                             // [blocks, I/64], zero
        unsigned short* act,                                      // bf16 [rows_max, I] (sorted rows)
        int pdl)
{
    extern __shared__ uint4 smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    uint4* ring = smem + warp * STAGES * STAGE_V(2);
    const unsigned long long pol = evict_first();
    constexpr int P = I / 64, NST = H / 32;
    pdl_enter(pdl);
    const int total = *n_blocks * P * splits, per = (NST + splits - 1) / splits;
    for (int item = blockIdx.x * WARPS + warp; item < total; item += gridDim.x * WARPS) {
        const int sp = item % splits, p = item / splits % P, blk = item / (splits * P);
        const int e = block_expert[blk], rows = block_rows[blk], ngv = (rows + 7) / 8;
        const unsigned short* xrow[NG];
        bool xval[NG];
#pragma unroll
        for (int ng = 0; ng < NG; ng++) {
            const int r = ng * 8 + g;
            xval[ng] = r < rows;
            xrow[ng] = x + (xval[ng] ? (long)(sorted[blk * CH + r] / TOPK) * H : 0);
        }
        float acc[2][4][NG][4];
        zero<2>(acc);
        const int st0 = sp * per, st1 = min(NST, st0 + per);
        stream_valid<H, 2 * I, 2>(acc, ring, w, s, e, p, P, st0, st1, xrow, xval, ngv, pol);
        if (splits == 1) {
#pragma unroll
            for (int f = 0; f < 4; f++)
#pragma unroll
                for (int ng = 0; ng < NG; ng++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const int r = ng * 8 + 2 * t + (i & 1), col = p * 64 + 16 * f + g + 8 * (i >> 1);
                        if (r < rows)
                            act[(long)(blk * CH + r) * I + col] = to_bf16(silu_mul(acc[0][f][ng][i], acc[1][f][ng][i]));
                    }
            continue;
        }
        float* mine = part + (long)sp * rows_max * (2 * I);
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int f = 0; f < 4; f++)
#pragma unroll
                for (int ng = 0; ng < NG; ng++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const int r = ng * 8 + 2 * t + (i & 1), col = j * I + p * 64 + 16 * f + g + 8 * (i >> 1);
                        if (r < rows) mine[(long)(blk * CH + r) * (2 * I) + col] = acc[j][f][ng][i];
                    }
        __threadfence();
        __syncwarp();
        int last = 0;
        if (lane == 0) {
            int* tk = tickets + blk * P + p;
            last = atomicAdd(tk, 1) == splits - 1;
            if (last) *tk = 0;
        }
        if (!__shfl_sync(0xffffffffu, last, 0)) continue;
        __threadfence();
        for (int r = 0; r < rows; r++) {                    // a column pair a lane, 8 splits' loads in flight
            const long at = (long)(blk * CH + r) * (2 * I) + p * 64 + 2 * lane;
            float2 gs = make_float2(0.f, 0.f), us = gs;
#pragma unroll 8
            for (int q = 0; q < splits; q++) {
                const float2 gq = ld_f32x2(part + (long)q * rows_max * (2 * I) + at);
                const float2 uq = ld_f32x2(part + (long)q * rows_max * (2 * I) + at + I);
                gs.x += gq.x; gs.y += gq.y; us.x += uq.x; us.y += uq.y;
            }
            *(unsigned*)(act + (long)(blk * CH + r) * I + p * 64 + 2 * lane) = bf16x2(silu_mul(gs.x, us.x), silu_mul(gs.y, us.y));
        }
    }
}

// ------------------------------------------------------------------------------------ w2

extern "C" __global__ void __launch_bounds__(THREADS, NG <= 2 && W2B <= 2 ? 3 : 1)   // 3 programs an SM (<= 168 registers)
moe_w2(const unsigned short* act,                                 // bf16 [rows_max, I] (sorted rows)
       const unsigned* w, const unsigned short* s,                // Marlin [E, I/16, 2H], scales [E, I/G, H]
       const int* sorted, const int* block_expert, const int* block_rows, const int* n_blocks,
       const float* topk_w,                                       // fp32 [T*k]
       unsigned short* ypart,                                     // bf16 [T*k, H]
       int* tickets,                                              // [T, H/(64 W2B)], zero
       unsigned short* out,                                       // bf16 [T, H]
       int pdl)
{
    extern __shared__ uint4 smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    uint4* ring = smem + warp * STAGES * STAGE_V(W2B);
    const unsigned long long pol = evict_first();
    constexpr int P = H / (64 * W2B), NST = I / 32;
    pdl_enter(pdl);
    const int total = *n_blocks * P;
    for (int item = blockIdx.x * WARPS + warp; item < total; item += gridDim.x * WARPS) {
        const int p = item % P, blk = item / P;
        const int e = block_expert[blk], rows = block_rows[blk], ngv = (rows + 7) / 8;
        const unsigned short* xrow[NG];
        bool xval[NG];
#pragma unroll
        for (int ng = 0; ng < NG; ng++) {
            const int r = ng * 8 + g;
            xval[ng] = r < rows;
            xrow[ng] = act + (xval[ng] ? (long)(blk * CH + r) * I : 0);
        }
        float acc[W2B][4][NG][4];
        zero<W2B>(acc);
        stream_valid<I, H, W2B>(acc, ring, w, s, e, W2B * p, 1, 0, NST, xrow, xval, ngv, pol);
        const int my = lane < rows ? sorted[blk * CH + lane] : 0;   // lane r: row r's assignment
#pragma unroll
        for (int ng = 0; ng < NG; ng++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int r = ng * 8 + 2 * t + (i & 1);
                const int asg = __shfl_sync(0xffffffffu, my, r & 31);
                if (r < rows) {
                    const float wt = topk_w[asg];
#pragma unroll
                    for (int j = 0; j < W2B; j++)
#pragma unroll
                        for (int f = 0; f < 4; f++)
                            ypart[(long)asg * H + (W2B * p + j) * 64 + 16 * f + g + 8 * (i >> 1)] = to_bf16(acc[j][f][ng][i] * wt);
                }
            }
        __threadfence();
        __syncwarp();
        int last = 0;
        if (lane < rows) {
            int* tk = tickets + (my / TOPK) * P + p;
            last = atomicAdd(tk, 1) == TOPK - 1;
            if (last) *tk = 0;
        }
        unsigned mask = __ballot_sync(0xffffffffu, last);
        if (mask) __threadfence();
        while (mask) {
            const int r = __ffs(mask) - 1;
            mask &= mask - 1;
            const int tok = __shfl_sync(0xffffffffu, my, r) / TOPK;
#pragma unroll
            for (int c = 2 * lane; c < 64 * W2B; c += 64) {            // a column pair a lane
                float s0 = 0.f, s1 = 0.f;
#pragma unroll
                for (int j = 0; j < TOPK; j++) {
                    const unsigned v = ld_s32((const int*)(ypart + (long)(tok * TOPK + j) * H + p * 64 * W2B + c));
                    s0 += bf16_lo(v);
                    s1 += bf16_hi(v);
                }
                *(unsigned*)(out + (long)tok * H + p * 64 * W2B + c) = bf16x2(s0, s1);
            }
        }
    }
}
