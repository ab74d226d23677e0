// The MoE block of one decode token in one launch (kernels/moe_block.py): the ffn norm, the
// router and its top-k, the shared expert's gate/up, the routed experts' w13 + act + w2 and
// the shared expert's w2, with two grid barriers in place of five launch boundaries.
//
// One program an SM (all resident: the barriers need it). Each streams its share of the
// weights through a ring of SLOTS shared-memory slots with bulk copies (the TMA engine, one
// mbarrier a slot, issued by warp 0), so DRAM keeps streaming across the dependencies: the
// static weights (router rows, shared gate/up rows, shared w2 rows) are issued before the
// programmatic-dependent-launch wait, the routed experts' w13 as soon as the
// program knows the top-k, their w2 right behind it (in flight during the w13 maths and the
// second barrier). The barriers are split: a program arrives, does work that the barrier does
// not guard, then waits. Measured slower than the five launches it replaces (a program's
// ~330 KB arrive at ~10-15 GB/s, where a copy moves 33 GB/s an SM; docs/BENCHMARKS.md,
// decode session 13): off by default.
//
//   pre-wait  issue this program's router rows and shared (gate, up) row pairs, its 64 rows of
//             the shared w2
//   phase 1   h = a + res (bf16), xn = h / rms(h) * nw (fp32, and fp16 for the INT4 dots;
//             a, res, nw loaded directly, not through the ring);
//             router logits of its rows (to global)
//   barrier 1 arrive; SiLU(g) * u of its shared pairs (to global); wait
//   phase 2   top-k of the logits (every program, redundantly); issue its w13 / w2 pieces
//   phase 3   one w13 unit: expert slot j, 64-column Marlin block nb, K split ks (fp32 partials)
//   barrier 2
//   phase 4   (programs < H / 64) act = SiLU(gate) * up * weight of all k experts (fp16),
//             64 output columns of sum_j act_j w2_j + sact w2_shared, bf16
//
// Marlin words (DESIGN §4): word [kt, nb*128 + (4g + t)*4 + tile] holds the K rows 16kt + 2t,
// +1 (nibbles 0, 4 and 1, 5 at +8, +9) ... of columns 64nb + 16tile + g (nibbles 0, 1, 4, 5)
// and + 8 (nibbles 2, 3, 6, 7); kernels/moe_gemv.py explains the packed fp16 dot used here.
//
// Compile-time shape: H hidden, E experts, TOPK, I routed and SI shared intermediate (this
// rank's), G group size (a multiple of 16), GRID programs, KS w13 K splits, PK13 / PK2 k tiles
// a w13 / w2 piece, SLOTS slots of SLOT bytes.
#define THREADS 512
#define QUARTERS (THREADS / 128)           // k-tile groups of a Marlin piece (thread c = tid % 128 of each)
#define WARPS (THREADS / 32)
#define KT13 (H / 16 / KS)                 // k tiles of a w13 unit
#define NBLK13 (2 * I / 64)                // 64-column blocks of an expert's w13
#define NU13 (TOPK * NBLK13 * KS)          // w13 units
#define NU2 (H / 64)                       // w2 units (64 output columns)
#define P13 (KT13 / PK13)                  // pieces of a w13 unit
#define P2 (I / 16 / PK2)                  // pieces of an expert's w2
#define EPL ((E + 31) / 32)                // router scores a lane (top-k)
#define RMAX ((E + GRID - 1) / GRID)       // router rows a program, at most
#define PMAX ((SI + GRID - 1) / GRID)      // shared (gate, up) pairs a program, at most
#define XV ((H / 8 + THREADS - 1) / THREADS)   // 8-value vectors of x a thread
#define ACTN ((TOPK * I + THREADS - 1) / THREADS)   // act values a thread
// TIMES: thread 0 of each program writes clock64() at 11 marks (start, weights issued, PDL wait
// over, norm, router, barrier 1, top-k + first pieces issued, w13, barrier 2, act, end) to
// times[program][11]
#if TIMES
#define MARK(i) do { if (threadIdx.x == 0) times[blockIdx.x * 11 + (i)] = clock64(); } while (0)
#else
#define MARK(i) do {} while (0)
#endif

typedef unsigned short bf16_t;
#define NEG_INF __int_as_float(0xff800000)

#include "common.cuh"

__device__ __forceinline__ float round_bf16(float f) { return bf16_lo(to_bf16(f)); }
__device__ __forceinline__ unsigned short to_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }
__device__ __forceinline__ float dot8(uint4 w, const float* x) {   // 8 bf16 weights . 8 fp32
    return bf16_lo(w.x) * x[0] + bf16_hi(w.x) * x[1] + bf16_lo(w.y) * x[2] + bf16_hi(w.y) * x[3]
         + bf16_lo(w.z) * x[4] + bf16_hi(w.z) * x[5] + bf16_lo(w.w) * x[6] + bf16_hi(w.w) * x[7];
}

// ---- bulk copies (TMA) into shared memory, completion counted on an mbarrier
__device__ __forceinline__ void mbar_init(unsigned long long* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(bar)));
}
__device__ __forceinline__ void mbar_expect(unsigned long long* bar, unsigned bytes) {   // the one arrival
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    asm volatile("{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT;\n}"
                 :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
// A TMA descriptor (CUtensorMap: kernels/cuda.py tensor_map_2d), passed by value
struct __align__(64) TensorMap { unsigned long long v[16]; };
// box (x, y) (x the column, y the row) of a 2-D tensor map -> dst, row-major
__device__ __forceinline__ void box_copy(void* dst, const TensorMap& map, int x, int y, unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(smem_addr(dst)), "l"(&map), "r"(x), "r"(y), "r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// A split grid barrier: after every program's `arrive` returned, every program's `wait` returns,
// and writes before an arrive are visible after the waits (read them with .cg loads). bar[0]
// counts arrivals (zero between barriers), bar[1] is the generation the last arrival advances;
// `arrive` returns the generation to wait past (thread 0's; the others get 0 and do not use it).
__device__ __forceinline__ unsigned grid_arrive(unsigned* bar) {
    __syncthreads();
    unsigned gen = 0;
    if (threadIdx.x == 0) {
        gen = ld_acquire(bar + 1);
        __threadfence();
        if (atomicAdd(bar, 1u) == gridDim.x - 1) {
            atomicExch(bar, 0u);
            asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(bar + 1), "r"(gen + 1) : "memory");
        }
    }
    return gen;
}
__device__ __forceinline__ void grid_wait(const unsigned* bar, unsigned gen) {
    if (threadIdx.x == 0) {
        while (ld_acquire(bar + 1) == gen) {}
        __threadfence();
    }
    __syncthreads();
}

// One Marlin word times its activations: the fp16 pairs xa = (x[16kt + 2t], x[.. + 1]) and
// xb = (x[.. + 8], x[.. + 9]) -> fp32 (column lo, column lo + 8), to be scaled.
__device__ __forceinline__ void word_dot(unsigned w, unsigned xa, unsigned xb, float& lo, float& hi) {
    asm("{\n.reg .b32 m, s, c, k, b, p0, p1, p2, p3, l, h;\n.reg .f16 u, v;\n"
        "mov.b32 m, 0x64006400;\nmov.b32 c, 0x64086408;\nmov.b32 k, 0x2c002c00;\nmov.b32 b, 0xd480d480;\n"
        "shr.u32 s, %2, 8;\n"
        "lop3.b32 p0, %2, 0x000f000f, m, 0xea;\nlop3.b32 p1, %2, 0x00f000f0, m, 0xea;\n"
        "lop3.b32 p2, s, 0x000f000f, m, 0xea;\nlop3.b32 p3, s, 0x00f000f0, m, 0xea;\n"
        "sub.rn.f16x2 p0, p0, c;\nfma.rn.f16x2 p1, p1, k, b;\nsub.rn.f16x2 p2, p2, c;\nfma.rn.f16x2 p3, p3, k, b;\n"
        "mul.rn.f16x2 l, p0, %3;\nfma.rn.f16x2 l, p1, %4, l;\nmul.rn.f16x2 h, p2, %3;\nfma.rn.f16x2 h, p3, %4, h;\n"
        "mov.b32 {u, v}, l;\nadd.rn.f16 u, u, v;\ncvt.f32.f16 %0, u;\n"
        "mov.b32 {u, v}, h;\nadd.rn.f16 u, u, v;\ncvt.f32.f16 %1, u;\n}"
        : "=f"(lo), "=f"(hi) : "r"(w), "r"(xa), "r"(xb));
}

// acc += the words of a piece (KTS k tiles of one 64-column block, then its group scales) times
// x (fp16 pairs, u32 index 8 * k tile + t; kt0 the piece's first k tile): thread c = tid % 128
// takes word column c of every QUARTERS-th k tile.
template <int KTS>
__device__ __forceinline__ void marlin_piece(const unsigned* piece, const unsigned* x, int kt0, float& acc_lo,
                                             float& acc_hi) {
    const unsigned* sc = piece + KTS * 128;            // [KTS * 16 / G][32] scale pairs
    const int c = threadIdx.x % 128, t = (c >> 2) & 3, pair = (c >> 4) * 4 + (c & 3);
#pragma unroll
    for (int kt = threadIdx.x / 128; kt < KTS; kt += QUARTERS) {
        float lo, hi;
        const unsigned* xp = x + 8 * (kt0 + kt) + t;
        word_dot(piece[kt * 128 + c], xp[0], xp[4], lo, hi);
        const unsigned s = sc[(kt * 16 / G) * 32 + pair];
        acc_lo = fmaf(lo, bf16_lo(s), acc_lo);
        acc_hi = fmaf(hi, bf16_hi(s), acc_hi);
    }
}

// marlin_piece's accumulators summed over t and the QUARTERS k-tile groups -> the 64 columns of
// the block, in thread col (< 64); `red` [QUARTERS][64] is scratch. Ends with a block barrier.
__device__ __forceinline__ float marlin_reduce(float acc_lo, float acc_hi, float* red) {
    acc_lo += __shfl_xor_sync(0xffffffffu, acc_lo, 4);
    acc_lo += __shfl_xor_sync(0xffffffffu, acc_lo, 8);
    acc_hi += __shfl_xor_sync(0xffffffffu, acc_hi, 4);
    acc_hi += __shfl_xor_sync(0xffffffffu, acc_hi, 8);
    const int c = threadIdx.x % 128, col = (c & 3) * 16 + (c >> 4);   // columns col and col + 8
    if (((c >> 2) & 3) == 0) {
        red[threadIdx.x / 128 * 64 + col] = acc_lo;
        red[threadIdx.x / 128 * 64 + col + 8] = acc_hi;
    }
    __syncthreads();
    float out = 0.f;
    if (threadIdx.x < 64)
#pragma unroll
        for (int q = 0; q < QUARTERS; q++) out += red[q * 64 + threadIdx.x];
    __syncthreads();
    return out;
}

// Dots of `rows` bf16 rows [H] in shared memory (rows apart by SLOT bytes) with xs (fp32 [H]),
// the whole block on each row -> out[r] in thread r (r < rows), via red_rows [MAXR][WARPS].
template <int MAXR>
__device__ __forceinline__ float rows_dot(const unsigned char* rows, int n, const float* xs, float* red_rows) {
    float d[MAXR];
#pragma unroll
    for (int r = 0; r < MAXR; r++) d[r] = 0.f;
#pragma unroll
    for (int i = 0; i < XV; i++) {
        const int v = threadIdx.x + i * THREADS;
        if (v < H / 8) {
            float x[8];
            *reinterpret_cast<float4*>(x) = reinterpret_cast<const float4*>(xs)[2 * v];
            *reinterpret_cast<float4*>(x + 4) = reinterpret_cast<const float4*>(xs)[2 * v + 1];
#pragma unroll
            for (int r = 0; r < MAXR; r++)
                if (r < n) d[r] += dot8(reinterpret_cast<const uint4*>(rows + r * SLOT)[v], x);
        }
    }
#pragma unroll
    for (int r = 0; r < MAXR; r++) {
        const float s = warp_sum(d[r]);
        if (threadIdx.x % 32 == 0) red_rows[r * WARPS + threadIdx.x / 32] = s;
    }
    __syncthreads();
    float out = 0.f;
    if (threadIdx.x < n)
#pragma unroll
        for (int w = 0; w < WARPS; w++) out += red_rows[threadIdx.x * WARPS + w];
    return out;
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
moe_block(const bf16_t* a, const bf16_t* res, const bf16_t* nw, float eps,     // input, residual, norm
          const bf16_t* gate, const float* bias, float scaling,                  // router
          const bf16_t* sw13, const bf16_t* sw2,                                 // shared expert [2SI, H], [H, SI]
          const __grid_constant__ TensorMap w13, const __grid_constant__ TensorMap s13,   // Marlin experts
          const __grid_constant__ TensorMap w2, const __grid_constant__ TensorMap s2,     // (tensor_map_2d)
          bf16_t* y, bf16_t* h_out, int* ids_out, float* wts_out,               // outputs
          float* logits, float* sact, float* part13, unsigned* bar, int pdl,     // scratch
          long long* times)                                                      // TIMES: clock64 marks
{
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* ring = smem;                                         // SLOTS x SLOT
    float* xs = reinterpret_cast<float*>(ring + SLOTS * SLOT);          // [H] xn (fp32)
    unsigned short* xh = reinterpret_cast<unsigned short*>(xs + H);     // [H] xn (fp16)
    bf16_t* sw2s = reinterpret_cast<bf16_t*>(xh + H);                   // [64, SI]
    __shared__ __align__(8) unsigned long long full[SLOTS], stat[1];    // a slot's piece / the shared w2 landed
    __shared__ float red[QUARTERS * 64], sh_out[64], red_rows[2 * (RMAX > PMAX ? RMAX : PMAX) * WARPS], part[WARPS];
    __shared__ int ids[TOPK];
    __shared__ float wts[TOPK];
    const int b = blockIdx.x, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    MARK(0);

    // this program's stream of pieces: router rows, shared (gate, up) rows, its w13 unit, the
    // w2 of the k experts (b < NU2); piece q goes to slot q % SLOTS
    const int r0 = b * E / GRID, nr = (b + 1) * E / GRID - r0;
    const int p0 = b * SI / GRID, np = (b + 1) * SI / GRID - p0;
    const int n_static = nr + 2 * np, n13 = b < NU13 ? P13 : 0;   // n_static <= SLOTS (config): all issued pre-wait
    const int n_pieces = n_static + n13 + (b < NU2 ? TOPK * P2 : 0);
    const int j13 = b / (NBLK13 * KS), nb13 = b / KS % NBLK13, ks = b % KS;
    int issued = 0;                       // warp 0's count of pieces issued
    // warp 0: issue pieces while the ring has room (consumed: pieces the block is done with),
    // the routed pieces once the top-k is known; lane k issues the k-th of them
    auto pump = [&](int consumed, bool routed) {
        const int end = min(min(n_pieces, consumed + SLOTS), routed ? n_pieces : n_static);
        const int q = issued + lane;
        if (q < end) {
            unsigned char* dst = ring + (q % SLOTS) * SLOT;
            unsigned long long* fb = full + q % SLOTS;
            if (q < n_static) {
                const bf16_t* src = q < nr ? gate + (long)(r0 + q) * H
                                           : sw13 + (long)(p0 + (q - nr) / 2 + ((q - nr) % 2) * SI) * H;
                mbar_expect(fb, 2 * H);
                bulk_copy(dst, src, 2 * H, fb);
            } else {                      // words [k tiles, 128] of the 64-column block, then its scales
                const bool up = q < n_static + n13;
                const int j = up ? j13 : (q - n_static - n13) / P2;
                const int kt0 = up ? ks * KT13 + (q - n_static) * PK13 : (q - n_static - n13) % P2 * PK2;
                const int kts = up ? PK13 : PK2, blk = up ? nb13 : b, e = ids[j];
                mbar_expect(fb, kts * 512 + kts * 16 / G * 128);
                box_copy(dst, up ? w13 : w2, blk * 128, e * (up ? H / 16 : I / 16) + kt0, fb);
                box_copy(dst + kts * 512, up ? s13 : s2, blk * 64, e * (up ? H / G : I / G) + kt0 * 16 / G, fb);
            }
        }
        issued = max(issued, end);
        __syncwarp();
    };
    // all threads: wait for piece q
    auto landed = [&](int q) { mbar_wait(full + q % SLOTS, (q / SLOTS) & 1); };

    // ---- pre-wait: the static weights
    if (tid == 0) {
        for (int i = 0; i < SLOTS; i++) mbar_init(full + i);
        mbar_init(stat);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == 0) {              // in the order they are needed: the shared w2 last
        pump(0, false);
        if (lane == 0 && b < NU2) {
            mbar_expect(stat, 128 * SI);
            bulk_copy(sw2s, sw2 + (long)b * 64 * SI, 128 * SI, stat);
        }
    }
    MARK(1);
    if (pdl) {
        asm volatile("griddepcontrol.launch_dependents;");
        asm volatile("griddepcontrol.wait;" ::: "memory");
    }
    MARK(2);

    // ---- phase 1: norm, router logits
    {
        uint4 av[XV], rv[XV], nv[XV];
#pragma unroll
        for (int i = 0; i < XV; i++) {            // every load in flight at once
            const int v = tid + i * THREADS;
            if (v < H / 8) {
                av[i] = ld_v4(a + 8 * v);
                rv[i] = av[i];
                if (res) rv[i] = ld_v4(res + 8 * v);
                nv[i] = ld_v4(nw + 8 * v);
            }
        }
        const int h0 = b * (H / 8) / GRID, h1 = (b + 1) * (H / 8) / GRID;
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < XV; i++) {            // h = a + res (bf16) in av
            const int v = tid + i * THREADS;
            if (v < H / 8) {
                unsigned* hu = &av[i].x;
                const unsigned* ru = &rv[i].x;
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    if (res) hu[e] = to_bf16(bf16_lo(hu[e]) + bf16_lo(ru[e])) | ((unsigned)to_bf16(bf16_hi(hu[e]) + bf16_hi(ru[e])) << 16);
                    ss += bf16_lo(hu[e]) * bf16_lo(hu[e]) + bf16_hi(hu[e]) * bf16_hi(hu[e]);
                }
                if (v >= h0 && v < h1) *reinterpret_cast<uint4*>(h_out + 8 * v) = av[i];
            }
        }
        ss = block_sum<WARPS>(ss, part);
        const float rstd = rsqrtf(ss / H + eps);
#pragma unroll
        for (int i = 0; i < XV; i++) {            // xn = h * rstd * nw: fp32 in xs, fp16 in xh
            const int v = tid + i * THREADS;
            if (v < H / 8) {
                const unsigned* hu = &av[i].x;
                const unsigned* nu = &nv[i].x;
                float x[8];
                unsigned xhu[4];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    x[2 * e] = bf16_lo(hu[e]) * rstd * bf16_lo(nu[e]);
                    x[2 * e + 1] = bf16_hi(hu[e]) * rstd * bf16_hi(nu[e]);
                    xhu[e] = to_f16(x[2 * e]) | ((unsigned)to_f16(x[2 * e + 1]) << 16);
                }
                reinterpret_cast<float4*>(xs)[2 * v] = *reinterpret_cast<float4*>(x);
                reinterpret_cast<float4*>(xs)[2 * v + 1] = *reinterpret_cast<float4*>(x + 4);
                const uint4 hv = {xhu[0], xhu[1], xhu[2], xhu[3]};
                reinterpret_cast<uint4*>(xh)[v] = hv;
            }
        }
    }
    MARK(3);
    for (int q = 0; q < nr; q++) landed(q);
    __syncthreads();                               // xs complete
    {
        const float d = rows_dot<RMAX>(ring, nr, xs, red_rows);
        if (tid < nr) logits[r0 + tid] = d;
    }
    MARK(4);
    unsigned gen = grid_arrive(bar);

    // ---- barrier 1's wait covers the shared expert's gate/up
    for (int q = nr; q < n_static; q++) landed(q);
    {
        __syncthreads();
        const float d = rows_dot<2 * PMAX>(ring + nr * SLOT, 2 * np, xs, red_rows);
        // thread 2p holds gate row p, thread 2p + 1 its up row
        const float u = __shfl_down_sync(0xffffffffu, d, 1);
        if (tid < 2 * np && tid % 2 == 0) sact[p0 + tid / 2] = round_bf16(silu(round_bf16(d)) * round_bf16(u));
    }
    grid_wait(bar, gen);
    MARK(5);

    // ---- phase 2: top-k (sigmoid scores, chosen by score + bias; weights renormalised)
    if (warp == 0) {
        float sel[EPL], score[EPL];
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            const int e = lane + 32 * i;
            score[i] = e < E ? ld_f32(logits + e) : 0.f;
            sel[i] = e < E ? bias[e] : NEG_INF;
        }
#pragma unroll
        for (int i = 0; i < EPL; i++) {
            score[i] = 1.f / (1.f + __expf(-score[i]));
            sel[i] += score[i];
        }
        float total = 0.f;
        for (int j = 0; j < TOPK; j++) {
            float best = NEG_INF, bs = 0.f;
            int bi = 0x7fffffff;
#pragma unroll
            for (int i = 0; i < EPL; i++)
                if (sel[i] > best) { best = sel[i]; bs = score[i]; bi = lane + 32 * i; }
#pragma unroll
            for (int o = 16; o > 0; o /= 2) {
                const float ob = __shfl_xor_sync(0xffffffffu, best, o), os = __shfl_xor_sync(0xffffffffu, bs, o);
                const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (ob > best || (ob == best && oi < bi)) { best = ob; bs = os; bi = oi; }
            }
#pragma unroll
            for (int i = 0; i < EPL; i++)
                if (lane + 32 * i == bi) sel[i] = NEG_INF;
            if (lane == 0) { ids[j] = bi; wts[j] = bs; }
            total += bs;
        }
        __syncwarp();
        if (lane < TOPK) {
            wts[lane] = wts[lane] / total * scaling;
            if (b == 0) { ids_out[lane] = ids[lane]; wts_out[lane] = wts[lane]; }
        }
        __syncwarp();
        pump(n_static, true);
    }
    __syncthreads();
    MARK(6);

    // ---- phase 3: the w13 unit
    float acc_lo = 0.f, acc_hi = 0.f;
    for (int q = n_static; q < n_static + n13; q++) {
        landed(q);
        marlin_piece<PK13>(reinterpret_cast<const unsigned*>(ring + (q % SLOTS) * SLOT),
                           reinterpret_cast<const unsigned*>(xh), ks * KT13 + (q - n_static) * PK13, acc_lo, acc_hi);
        __syncthreads();
        if (warp == 0) pump(q + 1, true);
    }
    if (n13) {
        const float d = marlin_reduce(acc_lo, acc_hi, red);
        if (tid < 64) part13[(ks * TOPK + j13) * (2 * I) + nb13 * 64 + tid] = d;
    }
    MARK(7);
    gen = grid_arrive(bar);
    grid_wait(bar, gen);
    MARK(8);
    if (b >= NU2) return;

    // ---- phase 4: act of the k experts (into xs's space), then 64 columns of w2
    unsigned short* act = reinterpret_cast<unsigned short*>(xs);          // [TOPK, I] fp16
    float* sact_s = xs + TOPK * I / 2;                                     // [SI]
    {
        float g[ACTN], u[ACTN];
#pragma unroll
        for (int m = 0; m < ACTN; m++) {            // every load in flight at once
            const int idx = tid + m * THREADS, j = idx / I, i = idx % I;
            g[m] = u[m] = 0.f;
            if (idx < TOPK * I)
#pragma unroll
                for (int s = 0; s < KS; s++) {
                    g[m] += ld_f32(part13 + (s * TOPK + j) * (2 * I) + i);
                    u[m] += ld_f32(part13 + (s * TOPK + j) * (2 * I) + I + i);
                }
        }
        for (int i = tid; i < SI; i += THREADS) sact_s[i] = ld_f32(sact + i);
#pragma unroll
        for (int m = 0; m < ACTN; m++) {
            const int idx = tid + m * THREADS;
            if (idx < TOPK * I) act[idx] = to_f16(silu(g[m]) * u[m] * wts[idx / I]);
        }
    }
    __syncthreads();
    MARK(9);
    acc_lo = acc_hi = 0.f;
    for (int q = n_static + n13; q < n_pieces; q++) {
        landed(q);
        const int j = (q - n_static - n13) / P2;
        marlin_piece<PK2>(reinterpret_cast<const unsigned*>(ring + (q % SLOTS) * SLOT),
                          reinterpret_cast<const unsigned*>(act) + j * (I / 2), (q - n_static - n13) % P2 * PK2,
                          acc_lo, acc_hi);
        __syncthreads();
        if (warp == 0) pump(q + 1, true);
    }
    mbar_wait(stat, 0);                            // the shared w2 rows
    {   // row tid / TPR of the 64, SI / TPR values each thread
        constexpr int TPR = THREADS / 64;
        const int r = tid / TPR, qq = tid % TPR;
        const uint4* row = reinterpret_cast<const uint4*>(sw2s + r * SI + qq * (SI / TPR));
        float d = 0.f;
#pragma unroll
        for (int v = 0; v < SI / TPR / 8; v++) d += dot8(row[v], sact_s + qq * (SI / TPR) + 8 * v);
#pragma unroll
        for (int o = 1; o < TPR; o *= 2) d += __shfl_xor_sync(0xffffffffu, d, o);
        if (qq == 0) sh_out[r] = d;
    }
    const float d = marlin_reduce(acc_lo, acc_hi, red);   // (its barriers publish sh_out)
    if (tid < 64) y[b * 64 + tid] = to_bf16(d + sh_out[tid]);
    MARK(10);
}
