// MLA decode attention of one token a stream in one launch (kernels/mla_decode.py): the query
// absorption q_lat = q_nope W_uk, attention over the latent KV cache, the merge of the
// position chunks and each head's value projection, at K2.6's head dims.
//
// A cluster of CL programs serves one (stream, head); program c of it owns the c-th chunk of
// the n visible positions, the columns [c LC, c LC + LC) of q_lat and the value rows
// [c VC, c VC + VC). Its steps:
//  1. before the PDL wait (nothing there is written by the kernel before): cp.async of its
//     chunk's cached KV rows (positions below prefix_len, written by earlier steps), its LC
//     columns of the head's key rows W_uk [DN, L] and its VC value rows W_uv [VC, L];
//  2. after it: the query (the kernel before wrote it) and, in the program whose chunk holds
//     it, the new token's KV row (mla_a_post wrote it two launches before; it is read after the
//     wait all the same, since the wq_b GEMV before this kernel, kernels/gemv.cu, lets it in
//     before its own wait, i.e. possibly while mla_a_post still runs);
//  3. its q_lat columns (fp32 sums, rounded to bf16 as a stored product), exchanged with
//     the cluster through distributed shared memory (cluster barrier 1);
//  4. scores, max and sum over its chunk and its unnormalised output o_c [L] (fp32);
//  5. after cluster barrier 2 each program merges the CL partials (remote shared memory)
//     into the head's output o [L], rounded to bf16, and multiplies its VC value rows.
// Barrier 3 (arrive after the remote reads, wait before exit) keeps every program's shared
// memory alive until the cluster has read it.
//
// Compile-time: MAXP, the positions a program holds (the cache capacity / CL, rounded up).
#include "common.cuh"

#define CL 8                  // programs a cluster
#define L 512                 // latent dims (kv_lora_rank)
#define DR 64                 // rope dims
#define DN 128                // no-rope query dims a head
#define DV 128                // value dims a head
#define ROW (L + DR)          // bf16 values of a cached KV row in shared memory
#define LC (L / CL)           // q_lat columns a program computes
#define VC (DV / CL)          // value rows a program projects
#define THREADS 256
#define NEG_INF __int_as_float(0xff800000)
static_assert(THREADS == 4 * LC && 2 * THREADS == L && VC * 16 == THREADS && L == 512 && DR == 64,
              "the thread mappings below assume K2.6's head dims");

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
mla_decode(const unsigned short* q, int s_qb,                     // [B, NH, DN + DR], stream stride
           const unsigned short* wkv_b,                            // [NH, DN + DV, L]
           const unsigned short* ckv, int s_cb,                    // [B, S, L], stream stride
           const unsigned short* kpe, int s_kb,                    // [B, S, DR], stream stride
           const int* plen, const unsigned char* vis, int s_vb,    // [B]; [B, 1, 1] (the token sees itself?)
           unsigned short* out,                                      // [B, NH, DV]
           float scale, int pdl)                                     // softmax scale * log2(e)
{
    extern __shared__ uint4 dyn[];
    unsigned short* kv = reinterpret_cast<unsigned short*>(dyn);       // [MAXP, ROW]
    unsigned short* wuk = kv + MAXP * ROW;                             // [DN, LC]
    unsigned short* wuv = wuk + DN * LC;                               // [VC, L]
    __shared__ __align__(16) float qn[DN], qpe[DR], ql[L], o[L], po[L];
    __shared__ float qs[LC], red[4][LC], sc[MAXP], pml[2], cm[CL], cl[CL];
    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    unsigned c;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(c));
    const int h = blockIdx.x / CL, nh = gridDim.x / CL, b = blockIdx.y;
    const int cached = plen[b];                                        // written by an earlier step
    const int chunk = (cached + 1 + CL - 1) / CL;                      // the new token at `cached` counted
    const int p0 = min(cached + 1, (int)c * chunk), p1 = min(cached + 1, p0 + chunk), np = p1 - p0;
    const unsigned short* ckv_b = ckv + (long)b * s_cb;
    const unsigned short* kpe_b = kpe + (long)b * s_kb;
    auto load_row = [&](int r, int j) {                                // 16-byte vector j of chunk row r
        cp_async16(smem_addr(kv + r * ROW + j * 8), j < L / 8 ? (const void*)(ckv_b + (long)(p0 + r) * L + j * 8)
                                                            : (const void*)(kpe_b + (long)(p0 + r) * DR + j * 8 - L));
    };
    // 1. static for this launch: cached rows, W_uk columns, W_uv rows
    for (int i = t; i < (min(p1, cached) - p0) * (ROW / 8); i += THREADS) load_row(i / (ROW / 8), i % (ROW / 8));
    const unsigned short* wh = wkv_b + (long)h * (DN + DV) * L;
    for (int i = t; i < DN * LC / 8; i += THREADS)
        cp_async16(smem_addr(wuk + i * 8), wh + (long)(i / (LC / 8)) * L + c * LC + i % (LC / 8) * 8);
    for (int i = t; i < VC * L / 8; i += THREADS)
        cp_async16(smem_addr(wuv + i * 8), wh + (long)(DN + c * VC + i / (L / 8)) * L + i % (L / 8) * 8);
    asm volatile("cp.async.commit_group;");
    pdl_enter(pdl ? 2 : 0);
    // 2. the new token's row, the query
    if (cached >= p0 && cached < p1 && t < ROW / 8) load_row(cached - p0, t);
    asm volatile("cp.async.commit_group;");
    const bool sees_self = vis[(long)b * s_vb] != 0;
    if (t < (DN + DR) / 8) {
        const uint4 v = ld_v4(q + (long)b * s_qb + h * (DN + DR) + t * 8);
        float* dst = t < DN / 8 ? qn + t * 8 : qpe + t * 8 - DN;
        const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int e = 0; e < 4; e++) { dst[2 * e] = bf16_lo(u[e]); dst[2 * e + 1] = bf16_hi(u[e]); }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    // 3. q_lat columns c LC ..: thread (quarter g of the DN rows, column j)
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
    cluster_sync();                                                    // 1: every program's qs written
    for (int i = t; i < L; i += THREADS) ql[i] = ld_rank(qs + i % LC, i / LC);
    __syncthreads();
    // 4. scores: warp w takes positions w, w + 8, ..; lane the latent vectors lane and lane + 32
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
    cluster_sync();                                                    // 2: every program's partial written
    // 5. merge (each program all of o) and project
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
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");   // 3: done with remote memory
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
