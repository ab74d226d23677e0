// MLA decode attention of one token a stream in one launch (kernels/mla_decode.py): from the
// output of the fused wq_a|wkv_a GEMM to the heads' value projections. It does what were five
// launches: the q / kv norms and the key rope with the cache write (mla_a_post), wq_b with
// its rope, the query absorption q_lat = q_nope W_uk, attention over the latent KV cache with
// the merge of its position chunks, and each head's value projection; at K2.6's head dims.
//
// A cluster of CL programs serves one (stream, head); program c of it owns the c-th chunk of
// the n visible positions, the head's query rows [c QR, c QR + QR), the columns [c LC,
// c LC + LC) of q_lat and the value rows [c VC, c VC + VC). Its steps:
//  1. before the PDL wait (nothing there is written by the kernel before): cp.async of its
//     chunk's cached KV rows (positions below prefix_len, written by earlier steps), its QR
//     rows of wq_b, its LC columns of the head's key rows W_uk [DN, L], its VC value rows
//     W_uv [VC, L], the norm weights;
//  2. after it: the fused GEMM's output row (q latent, kv latent, raw key rope part), its RMS
//     norms; the new token's cache row (kv_norm, rope) into the chunk that holds position
//     prefix_len, and into the cache by the head-0 cluster;
//  3. its QR query rows (wq_b; rope on the rope dims; bf16 as a stored product), exchanged
//     with the cluster through distributed shared memory (cluster barrier 1);
//  4. its q_lat columns (fp32 sums, rounded to bf16), exchanged likewise (barrier 2);
//  5. scores, max and sum over its chunk and its unnormalised output o_c [L] (fp32);
//  6. after barrier 3 each program merges the CL partials (remote shared memory) into the
//     head's output o [L], rounded to bf16, and multiplies its VC value rows.
// Barrier 4 (arrive after the remote reads, wait before exit) keeps every program's shared
// memory alive until the cluster has read it.
//
// Compile-time: MAXP, the positions a program holds (the cache capacity / CL, rounded up); Q,
// the q latent dims (q_lora_rank, a multiple of 256).
#include "common.cuh"

#define CL 8                  // programs a cluster
#define L 512                 // latent dims (kv_lora_rank)
#define DR 64                 // rope dims
#define DN 128                // no-rope query dims a head
#define DV 128                // value dims a head
#define ROW (L + DR)          // bf16 values of a cached KV row in shared memory
#define QR ((DN + DR) / CL)   // query rows of the head a program computes
#define LC (L / CL)           // q_lat columns a program computes
#define XV (((Q + L) / 8 + THREADS - 1) / THREADS)   // 16-byte loads of the q and kv latents a thread
#define VC (DV / CL)          // value rows a program projects
#define THREADS 256
#define NEG_INF __int_as_float(0xff800000)
static_assert(THREADS == 4 * LC && 2 * THREADS == L && VC * 16 == THREADS && L == 512 && DR == 64 && QR == 24
              && DN % QR % 2 == 0 && Q % 256 == 0, "the thread mappings below assume K2.6's head dims");

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ float ld_rank(const float* p, unsigned rank) {   // p in program `rank`'s shared memory
    unsigned a;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_addr(p)), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(a) : "memory");
    return v;
}
__device__ __forceinline__ float2 ld_rank2(const float* p, unsigned rank) {
    unsigned a;
    float2 v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_addr(p)), "r"(rank));
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(a) : "memory");
    return v;
}
__device__ __forceinline__ float dot8(uint4 w, const float* x) {   // 8 bf16 . 8 fp32
    return bf16_lo(w.x) * x[0] + bf16_hi(w.x) * x[1] + bf16_lo(w.y) * x[2] + bf16_hi(w.y) * x[3]
         + bf16_lo(w.z) * x[4] + bf16_hi(w.z) * x[5] + bf16_lo(w.w) * x[6] + bf16_hi(w.w) * x[7];
}
__device__ __forceinline__ float round_bf16(float f) { return bf16_lo(to_bf16(f)); }

extern "C" __global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(THREADS, 1)
mla_decode(const unsigned short* qkv, int s_xb,                   // [B, Q + L + DR] (the fused GEMM's row), stream stride
           const unsigned short* q_w, const unsigned short* kv_w,  // norm weights [Q], [L]
           const float* cos, const float* sin,                     // [B, DR / 2] each
           const unsigned short* wq_b,                             // [NH * (DN + DR), Q]
           const unsigned short* wkv_b,                            // [NH, DN + DV, L]
           unsigned short* ckv, int s_cb,                          // [B, S, L], stream stride
           unsigned short* kpe, int s_kb,                          // [B, S, DR], stream stride
           const int* plen, const unsigned char* vis, int s_vb,    // [B]; [B, 1, 1] (the token sees itself?)
           unsigned short* out,                                    // [B, NH, DV]
           float eps, float scale, int pdl)                        // scale: softmax scale * log2(e)
{
    extern __shared__ uint4 dyn[];
    unsigned short* kv = reinterpret_cast<unsigned short*>(dyn);       // [MAXP, ROW]
    unsigned short* wuk = kv + MAXP * ROW;                             // [DN, LC]
    unsigned short* wuv = wuk + DN * LC;                               // [VC, L]
    unsigned short* wqb = wuv + VC * L;                                // [QR, Q]
    unsigned short* nw = wqb + QR * Q;                                 // q_w [Q], kv_w [L]
    float* xa = reinterpret_cast<float*>(nw + Q + L);                  // the normed q latent [Q]
    __shared__ __align__(16) float qn[DN], qpe[DR], ql[L], o[L], po[L];
    __shared__ float qp[QR], qs[LC], red[4][LC], sc[MAXP], pml[2], cm[CL], cl[CL], part[2][THREADS / 32];
    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    unsigned c;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(c));
    const int h = blockIdx.x / CL, nh = gridDim.x / CL, b = blockIdx.y;
    const int cached = plen[b];                                        // written by an earlier step
    const int chunk = (cached + 1 + CL - 1) / CL;                      // the new token at `cached` counted
    const int p0 = min(cached + 1, (int)c * chunk), p1 = min(cached + 1, p0 + chunk), np = p1 - p0;
    unsigned short* ckv_b = ckv + (long)b * s_cb;
    unsigned short* kpe_b = kpe + (long)b * s_kb;
    // 1. static for this launch: cached rows, wq_b rows, W_uk columns, W_uv rows, norm weights
    for (int i = t; i < (min(p1, cached) - p0) * (ROW / 8); i += THREADS) {
        const int r = i / (ROW / 8), j = i % (ROW / 8);
        cp_async16(smem_addr(kv + r * ROW + j * 8), j < L / 8 ? (const void*)(ckv_b + (long)(p0 + r) * L + j * 8)
                                                            : (const void*)(kpe_b + (long)(p0 + r) * DR + j * 8 - L));
    }
    for (int i = t; i < QR * Q / 8; i += THREADS)
        cp_async16(smem_addr(wqb + i * 8), wq_b + ((long)h * (DN + DR) + c * QR) * Q + i * 8);
    const unsigned short* wh = wkv_b + (long)h * (DN + DV) * L;
    for (int i = t; i < DN * LC / 8; i += THREADS)
        cp_async16(smem_addr(wuk + i * 8), wh + (long)(i / (LC / 8)) * L + c * LC + i % (LC / 8) * 8);
    for (int i = t; i < VC * L / 8; i += THREADS)
        cp_async16(smem_addr(wuv + i * 8), wh + (long)(DN + c * VC + i / (L / 8)) * L + i % (L / 8) * 8);
    for (int i = t; i < (Q + L) / 8; i += THREADS)
        cp_async16(smem_addr(nw + i * 8), i < Q / 8 ? q_w + i * 8 : kv_w + i * 8 - Q);
    asm volatile("cp.async.commit_group;");
    if (pdl) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;");
    }
    // 2. the fused GEMM's row: sums of squares of the q and kv latents (8 values a thread a load)
    const unsigned short* x = qkv + (long)b * s_xb;
    float sq = 0.f, skv = 0.f;
    uint4 xv[XV];
#pragma unroll
    for (int j = 0; j < XV; j++) {
        const int i = t + j * THREADS;
        if (i < (Q + L) / 8) {
            xv[j] = ld_v4(x + i * 8);
            const unsigned u[4] = {xv[j].x, xv[j].y, xv[j].z, xv[j].w};
            float ss = 0.f;
#pragma unroll
            for (int e = 0; e < 4; e++) ss += bf16_lo(u[e]) * bf16_lo(u[e]) + bf16_hi(u[e]) * bf16_hi(u[e]);
            if (i < Q / 8) sq += ss; else skv += ss;
        }
    }
    const bool sees_self = vis[(long)b * s_vb] != 0;
    asm volatile("cp.async.wait_all;" ::: "memory");
    sq = warp_sum(sq);
    skv = warp_sum(skv);
    if (lane == 0) { part[0][warp] = sq; part[1][warp] = skv; }
    __syncthreads();
    sq = skv = 0.f;
#pragma unroll
    for (int w = 0; w < THREADS / 32; w++) { sq += part[0][w]; skv += part[1][w]; }
    const float rq = rsqrtf(sq / Q + eps), rkv = rsqrtf(skv / L + eps);
    const bool new_row = cached >= p0 && cached < p1;                   // position `cached` is in this chunk
#pragma unroll
    for (int j = 0; j < XV; j++) {
        const int i = t + j * THREADS;
        if (i < (Q + L) / 8) {
            const unsigned u[4] = {xv[j].x, xv[j].y, xv[j].z, xv[j].w};
            const unsigned short* w = nw + i * 8;
            if (i < Q / 8) {                                           // q_norm, rounded as stored
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    xa[i * 8 + 2 * e] = round_bf16(bf16_lo(u[e]) * rq * __uint_as_float((unsigned)w[2 * e] << 16));
                    xa[i * 8 + 2 * e + 1] = round_bf16(bf16_hi(u[e]) * rq * __uint_as_float((unsigned)w[2 * e + 1] << 16));
                }
            } else if (new_row) {                                      // kv_norm: the new cache row
                unsigned short* dst = kv + (cached - p0) * ROW + i * 8 - Q;
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    dst[2 * e] = to_bf16(bf16_lo(u[e]) * rkv * __uint_as_float((unsigned)w[2 * e] << 16));
                    dst[2 * e + 1] = to_bf16(bf16_hi(u[e]) * rkv * __uint_as_float((unsigned)w[2 * e + 1] << 16));
                }
            }
        }
    }
    if (new_row && t < DR / 2) {                                       // rope of the key's rope part: pair t
        const unsigned u = reinterpret_cast<const unsigned*>(x + Q + L)[t];
        const float a = bf16_lo(u), bb = bf16_hi(u), cs = cos[b * (DR / 2) + t], sn = sin[b * (DR / 2) + t];
        kv[(cached - p0) * ROW + L + 2 * t] = to_bf16(a * cs - bb * sn);
        kv[(cached - p0) * ROW + L + 2 * t + 1] = to_bf16(bb * cs + a * sn);
    }
    __syncthreads();
    if (new_row && h == 0) {                                           // the cache row, once a stream
        const uint4* src = reinterpret_cast<const uint4*>(kv + (cached - p0) * ROW);
        for (int j = t; j < ROW / 8; j += THREADS)
            *reinterpret_cast<uint4*>(j < L / 8 ? ckv_b + (long)cached * L + j * 8
                                                : kpe_b + (long)cached * DR + j * 8 - L) = src[j];
    }
    // 3. the head's query rows c QR ..: warp w rows w, w + 8, w + 16; lane the Q / 256 vectors
    // lane, lane + 32, .. of a row; rope on the rope dims (pairs stay in a program: QR even)
    for (int r = warp; r < QR; r += THREADS / 32) {
        float a = 0.f;
#pragma unroll
        for (int j = 0; j < Q / 256; j++) {
            const int v = lane + 32 * j;
            a += dot8(*reinterpret_cast<const uint4*>(wqb + r * Q + v * 8), xa + v * 8);
        }
        a = warp_sum(a);
        if (lane == 0) qp[r] = a;
    }
    __syncthreads();
    if (t < QR) {
        const int d = c * QR + t - DN;                                 // rope dim of this row, if >= 0
        float v = qp[t];
        if (d >= 0) {
            const float cs = cos[b * (DR / 2) + d / 2], sn = sin[b * (DR / 2) + d / 2], p = qp[t ^ 1];
            v = d % 2 ? v * cs + p * sn : v * cs - p * sn;
        }
        __syncwarp(0x00ffffffu);
        qp[t] = round_bf16(v);
    }
    cluster_sync();                                                    // 1: every program's query rows written
    if (t < DN + DR) {
        const float v = ld_rank(qp + t % QR, t / QR);
        if (t < DN) qn[t] = v; else qpe[t - DN] = v;
    }
    __syncthreads();
    // 4. q_lat columns c LC ..: thread (quarter g of the DN rows, column j)
    {
        const int g = t / LC, j = t % LC;
        float a = 0.f;
#pragma unroll 8
        for (int d = g * (DN / 4); d < (g + 1) * (DN / 4); d++)
            a += qn[d] * __uint_as_float((unsigned)wuk[d * LC + j] << 16);
        red[g][j] = a;
        __syncthreads();
        if (t < LC) qs[t] = round_bf16(red[0][t] + red[1][t] + red[2][t] + red[3][t]);
    }
    cluster_sync();                                                    // 2: every program's qs written
    for (int i = t; i < L; i += THREADS) ql[i] = ld_rank(qs + i % LC, i / LC);
    __syncthreads();
    // 5. scores: warp w takes positions w, w + 8, ..; lane the latent vectors lane and lane + 32
    // (8 dims each) and the rope dims 2 lane, 2 lane + 1
    {
        float qa[8], qb[8];
#pragma unroll
        for (int e = 0; e < 8; e++) { qa[e] = ql[lane * 8 + e]; qb[e] = ql[L / 2 + lane * 8 + e]; }
        const float r0 = qpe[2 * lane], r1 = qpe[2 * lane + 1];
        for (int p = warp; p < np; p += THREADS / 32) {
            const unsigned short* row = kv + p * ROW;
            const uint4 x = *reinterpret_cast<const uint4*>(row + lane * 8);
            const uint4 y = *reinterpret_cast<const uint4*>(row + L / 2 + lane * 8);
            const unsigned r = *reinterpret_cast<const unsigned*>(row + L + 2 * lane);
            const float s = warp_sum(dot8(x, qa) + dot8(y, qb) + bf16_lo(r) * r0 + bf16_hi(r) * r1);
            if (lane == 0) sc[p] = p0 + p == cached && !sees_self ? NEG_INF : s * scale;
        }
    }
    __syncthreads();
    float m = NEG_INF, l = 0.f;                                      // every warp the same max and sum
    for (int p = lane; p < np; p += 32) m = fmaxf(m, sc[p]);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    const float ms = m == NEG_INF ? 0.f : m;
    for (int p = lane; p < np; p += 32) l += exp2f(sc[p] - ms);
    l = warp_sum(l);
    {                                                                  // thread t: latent dims 2t, 2t + 1
        float a0 = 0.f, a1 = 0.f;
        for (int p = 0; p < np; p++) {
            const float e = exp2f(sc[p] - ms);
            const unsigned w = reinterpret_cast<const unsigned*>(kv + p * ROW)[t];
            a0 += e * bf16_lo(w);
            a1 += e * bf16_hi(w);
        }
        po[2 * t] = a0;
        po[2 * t + 1] = a1;
        if (t == 0) { pml[0] = m; pml[1] = l; }
    }
    cluster_sync();                                                    // 3: every program's partial written
    // 6. merge (each program all of o) and project
    if (t < CL) { cm[t] = ld_rank(pml, t); cl[t] = ld_rank(pml + 1, t); }
    __syncthreads();
    float mx = NEG_INF;
#pragma unroll
    for (int r = 0; r < CL; r++) mx = fmaxf(mx, cm[r]);
    const float mxs = mx == NEG_INF ? 0.f : mx;
    float den = 0.f, o0 = 0.f, o1 = 0.f;
#pragma unroll
    for (int r = 0; r < CL; r++) {
        const float w = cm[r] == NEG_INF ? 0.f : exp2f(cm[r] - mxs);
        const float2 v = ld_rank2(po + 2 * t, r);
        den += w * cl[r];
        o0 += w * v.x;
        o1 += w * v.y;
    }
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");   // 4: done with remote memory
    const float inv = den > 0.f ? 1.f / den : 0.f;
    o[2 * t] = round_bf16(o0 * inv);
    o[2 * t + 1] = round_bf16(o1 * inv);
    __syncthreads();
    {                                                                  // 16 threads a value row
        const int v = t / 16, part = t % 16;
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < L / 8 / 16; i++) {
            const int j = (part + 16 * i) * 8;
            a += dot8(*reinterpret_cast<const uint4*>(wuv + v * L + j), o + j);
        }
#pragma unroll
        for (int off = 8; off > 0; off /= 2) a += __shfl_xor_sync(0xffffffffu, a, off);
        if (part == 0) out[((long)b * nh + h) * DV + c * VC + v] = to_bf16(a);
    }
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
