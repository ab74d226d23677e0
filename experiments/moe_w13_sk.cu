// Source variant of kernels/moe_marlin.cu's moe_w13 for experiments/scripts/moe_marlin_variants.py
// (variant `sk`): stream-K. The text replaces moe_w13 (its declaration up to the w2 section).
// The (block, gate/up pair) units' 32-row K stages, units x H/32 of them, are dealt out in equal
// contiguous ranges of S stages, one a warp (S = ceil(stages / warps), at least
// ceil((H/32) / (max_segs - 1)) so a unit meets at most max_segs warps), instead of whole
// (unit, K split) items over rounds: no warp streams a second round while most wait. A unit cut
// into segments writes each segment's fp32 partials to `part[segment]`; the last of its segments
// to finish (an atomic ticket counting to the unit's segment count) sums them in segment order.
extern "C" __global__ void __launch_bounds__(THREADS)
moe_w13(const unsigned short* x,                                  // bf16 [T, H]
        const unsigned* w, const unsigned short* s,               // Marlin [E, H/16, 4I], scales [E, H/G, 2I]
        const int* sorted, const int* block_expert, const int* block_rows, const int* n_blocks,
        int max_segs, int rows_max, float* part,                  // fp32 [max_segs, rows_max, 2I]
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
    const int warps = gridDim.x * WARPS, me = blockIdx.x * WARPS + warp;
    const long total = (long)*n_blocks * P * NST;
    const long S = max((total + warps - 1) / warps, (long)((NST + max_segs - 2) / (max_segs - 1)));
    long at = me * S;
    const long end = min(total, at + S);
    while (at < end) {
        const int u = (int)(at / NST), st0 = (int)(at % NST), st1 = (int)min((long)NST, st0 + (end - at));
        at += st1 - st0;
        const int first = (int)((long)u * NST / S), seg = me - first;
        const int nseg = (int)(((long)u * NST + NST - 1) / S) - first + 1;
        const int p = u % P, blk = u / P;
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
        stream_valid<H, 2 * I, 2>(acc, ring, w, s, e, p, P, st0, st1, xrow, xval, ngv, pol);
        if (nseg == 1) {
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
        float* mine = part + (long)seg * rows_max * (2 * I);
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
            int* tk = tickets + u;
            last = atomicAdd(tk, 1) == nseg - 1;
            if (last) *tk = 0;
        }
        if (!__shfl_sync(0xffffffffu, last, 0)) continue;
        __threadfence();
        for (int r = 0; r < rows; r++) {                    // a column pair a lane, 8 segments' loads in flight
            const long o = (long)(blk * CH + r) * (2 * I) + p * 64 + 2 * lane;
            float2 gs = make_float2(0.f, 0.f), us = gs;
#pragma unroll 8
            for (int q = 0; q < nseg; q++) {
                const float2 gq = ld_f32x2(part + (long)q * rows_max * (2 * I) + o);
                const float2 uq = ld_f32x2(part + (long)q * rows_max * (2 * I) + o + I);
                gs.x += gq.x; gs.y += gq.y; us.x += uq.x; us.y += uq.y;
            }
            *(unsigned*)(act + (long)(blk * CH + r) * I + p * 64 + 2 * lane) = bf16x2(silu_mul(gs.x, us.x), silu_mul(gs.y, us.y));
        }
    }
}

