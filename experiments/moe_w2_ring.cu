// Source variant of kernels/moe_marlin.cu's moe_w2 for experiments/scripts/moe_marlin_variants.py
// (variants xring*, ksum*): the text replaces moe_w2 from its declaration to the end of the file,
// after `#define XR_AT` and `#define KSUM_APART`. The ring runs on across a warp's items: after an
// item's stage loop the next item's first STAGES - 1 stages are issued (XR_AT 0: before the
// epilogue's stores, 1: after its fence, 2: after the whole epilogue, the product's order), so
// their fill overlaps the epilogue. KSUM_APART: the epilogue only writes the weighted rows;
// `marlin_ksum` (a launch of its own) sums a token's k rows in slot order.
struct W2Src { const unsigned* wl; const unsigned short* sl; const unsigned short* xrow[NG]; bool xval[NG]; int ngv; };

__device__ __forceinline__ W2Src w2_src(int item, int total, const unsigned* w, const unsigned short* s,
                                        const unsigned short* act, const int* block_expert, const int* block_rows)
{
    constexpr int P = H / (64 * W2B);
    const int lane = threadIdx.x % 32, g = lane / 4;
    const bool ok = item < total;
    const int p = ok ? item % P : 0, blk = ok ? item / P : 0;
    const int e = ok ? block_expert[blk] : 0, rows = ok ? block_rows[blk] : 0;
    W2Src d;
    d.ngv = (rows + 7) / 8;
    d.wl = w + (long)e * (I / 16) * (2 * H) + lane * 4 + W2B * p * 128;
    d.sl = s + (long)e * (I / G) * H + (W2B * p + min(lane / 8, W2B - 1)) * 64 + lane % 8 * 8;
#pragma unroll
    for (int ng = 0; ng < NG; ng++) {
        const int r = ng * 8 + g;
        d.xval[ng] = r < rows;
        d.xrow[ng] = act + (d.xval[ng] ? (long)(blk * CH + r) * I : 0);
    }
    return d;
}

__device__ __forceinline__ void w2_issue(unsigned slot, const W2Src& d, int st, unsigned long long pol)
{
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    if (d.ngv > 0 && st < I / 32) {
        const int kt = 2 * st;
#pragma unroll
        for (int j = 0; j < W2B; j++) {
            const unsigned* src = d.wl + (long)kt * (2 * H) + j * 128;
            cp16_ef(slot + (64 * j + lane) * 16, src, pol);
            cp16_ef(slot + (64 * j + 32 + lane) * 16, src + 2 * H, pol);
        }
        if (lane < SVEC(W2B)) cp_async16(slot + (WVEC(W2B) + lane) * 16, d.sl + (long)(kt * 16 / G) * H);
#pragma unroll
        for (int ng = 0; ng < NG; ng++)
            if (ng < d.ngv) cp16z(slot + XVEC(W2B, ng) * 16 + xoff(g, t), d.xrow[ng] + 32 * st + 8 * t, d.xval[ng]);
    }
    cp_commit();
}

template <int NV>
__device__ __forceinline__ void w2_stages(float (&acc)[W2B][4][NG][4], const uint4* ring, unsigned base, int slot0,
                                          const W2Src& d, unsigned long long pol)
{
    const int lane = threadIdx.x % 32, g = lane / 4;
    const unsigned xget = xoff(lane % 8, lane / 8);
    constexpr int NST = I / 32;
    for (int st = 0; st < NST; st++) {
        cp_wait<STAGES - 2>();
        __syncwarp();
        w2_issue(base + (slot0 + st + STAGES - 1) % STAGES * (STAGE_V(W2B) * 16), d, st + STAGES - 1, pol);
        const int at = (slot0 + st) % STAGES;
        const unsigned slot = base + at * (STAGE_V(W2B) * 16);
        const uint4* vec = ring + at * STAGE_V(W2B);
        unsigned xv[NV][4];
        float c0[NV][4];
#pragma unroll
        for (int ng = 0; ng < NV; ng++) {
            ldsm4(xv[ng], slot + XVEC(W2B, ng) * 16 + xget);
#pragma unroll
            for (int i = 0; i < 4; i++) c0[ng][i] = 0.f;
        }
#pragma unroll
        for (int j = 0; j < W2B; j++) {
            const uint4 w0 = vec[64 * j + lane], w1 = vec[64 * j + 32 + lane], sc = vec[WVEC(W2B) + 8 * j + g];
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
                    float* dd = acc[j][tile][ng];
                    dd[0] = fmaf(c[0], slo, dd[0]);
                    dd[1] = fmaf(c[1], slo, dd[1]);
                    dd[2] = fmaf(c[2], shi, dd[2]);
                    dd[3] = fmaf(c[3], shi, dd[3]);
                }
            }
        }
    }
}

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
    const unsigned base = smem_addr(ring);
    const unsigned long long pol = evict_first();
    constexpr int P = H / (64 * W2B), NST = I / 32;
    pdl_enter(pdl);
    const int total = *n_blocks * P, stride = gridDim.x * WARPS;
    int item = blockIdx.x * WARPS + warp, slot0 = 0;
    W2Src cur = w2_src(item, total, w, s, act, block_expert, block_rows);
#pragma unroll
    for (int i = 0; i < STAGES - 1; i++) w2_issue(base + i * (STAGE_V(W2B) * 16), cur, i, pol);
    for (; item < total; item += stride) {
        const int p = item % P, blk = item / P, rows = block_rows[blk];
        float acc[W2B][4][NG][4];
        zero<W2B>(acc);
        if constexpr (NG > 1) {
            if (cur.ngv == 1) w2_stages<1>(acc, ring, base, slot0, cur, pol);
            else w2_stages<NG>(acc, ring, base, slot0, cur, pol);
        } else {
            w2_stages<1>(acc, ring, base, slot0, cur, pol);
        }
        __syncwarp();                                       // every lane done with the ring before the next item's copies
        slot0 = (slot0 + NST) % STAGES;
        cur = w2_src(item + stride, total, w, s, act, block_expert, block_rows);
#if XR_AT == 0
#pragma unroll
        for (int i = 0; i < STAGES - 1; i++) w2_issue(base + (slot0 + i) % STAGES * (STAGE_V(W2B) * 16), cur, i, pol);
#endif
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
#if !KSUM_APART
        __threadfence();
#endif
#if XR_AT == 1
#pragma unroll
        for (int i = 0; i < STAGES - 1; i++) w2_issue(base + (slot0 + i) % STAGES * (STAGE_V(W2B) * 16), cur, i, pol);
#endif
#if !KSUM_APART
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
#endif
#if XR_AT == 2
#pragma unroll
        for (int i = 0; i < STAGES - 1; i++) w2_issue(base + (slot0 + i) % STAGES * (STAGE_V(W2B) * 16), cur, i, pol);
#endif
    }
    cp_wait<0>();
}

extern "C" __global__ void __launch_bounds__(256)
marlin_ksum(const unsigned short* ypart, unsigned short* out, int tokens, int pdl)   // ypart bf16 [T*k, H] -> out [T, H]
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
        for (int q = 0; q < 4; q++) {
            sum[2 * q] += bf16_lo(u[q]);
            sum[2 * q + 1] += bf16_hi(u[q]);
        }
    }
    *(uint4*)(out + (long)tok * H + col) =
        make_uint4(bf16x2(sum[0], sum[1]), bf16x2(sum[2], sum[3]), bf16x2(sum[4], sum[5]), bf16x2(sum[6], sum[7]));
}
