// y = W x for one row x (bf16 W): a decode-step GEMV that loads its weights into shared
// memory *before* the programmatic-dependent-launch wait (kernels/gemv.py).
//
// W [n, k] row-major is cut into row blocks of ROWS rows, each into `splits` tiles of KC columns.
// Program b owns a run of whole row blocks (so it finishes its rows itself: no partial sums
// leave it) and streams their tiles through a ring of STAGES tiles in shared memory with
// cp.async. The first STAGES tiles are issued before griddepcontrol.wait: the weights depend
// on nothing, so they arrive while the kernel before (whose output is x) still runs.
//
// Compile-time switches:
//   WARPS warps a program, ROWS rows and KC columns a tile (KC / 8 / WARPS divides 32), STAGES
//   ring slots;
//   X_BF16 / Y_BF16: x / y bf16 (else fp32);
//   NORM: RMSNorm prologue, x := h / rms(h) * nw with h = x + res rounded to x's dtype, h
//     written to h_out (each program a slice); the 1/rms is applied to the finished dot product;
//   ADD_ROWS > 0: y += the sum of add's ADD_ROWS fp32 rows [ADD_ROWS, n];
//   ROPE_HEAD > 0: interleaved rope on the columns ROPE_OFF.. of each ROPE_HEAD-wide head
//     (y[2i] = a c - b s, y[2i+1] = b c + a s, cos / sin fp32 [ROPE_HEAD - ROPE_OFF) / 2]).
#define VEC (KC / 8)             // 16-byte vectors (8 bf16) in a tile row
#define VW (VEC / WARPS)         // vectors of a row each warp multiplies = lanes a row (divides 32)
#define RPL (32 / VW)            // rows a warp works on at once
#define ACC (ROWS / RPL)         // rows (accumulators) a lane
#define TILE_VEC (ROWS * VEC)
#define BATCH (NORM ? 2 : 4)     // 16-byte loads of x (and res, nw) a thread has in flight

#include "common.cuh"
#if X_BF16
typedef unsigned short x_t;
__device__ __forceinline__ void ld_x8(const x_t* p, float* f) {   // x[0..8) as fp32 (16-byte aligned)
    const uint4 v = ld_v4(p);
    const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 4; e++) { f[2 * e] = bf16_lo(u[e]); f[2 * e + 1] = bf16_hi(u[e]); }
}
#else
typedef float x_t;
__device__ __forceinline__ void ld_x8(const x_t* p, float* f) {
    const uint4 a = ld_v4(p), b = ld_v4(p + 4);
    f[0] = __uint_as_float(a.x); f[1] = __uint_as_float(a.y); f[2] = __uint_as_float(a.z); f[3] = __uint_as_float(a.w);
    f[4] = __uint_as_float(b.x); f[5] = __uint_as_float(b.y); f[6] = __uint_as_float(b.z); f[7] = __uint_as_float(b.w);
}
#endif
__device__ __forceinline__ x_t to_x(float f) {                 // f in x's dtype
#if X_BF16
    return to_bf16(f);
#else
    return f;
#endif
}
__device__ __forceinline__ float as_x(float f) {               // f rounded to x's dtype
#if X_BF16
    return bf16_lo(to_bf16(f));
#else
    return f;
#endif
}
#if Y_BF16
typedef unsigned short y_t;
__device__ __forceinline__ y_t out(float f) { return to_bf16(f); }
#else
typedef float y_t;
__device__ __forceinline__ y_t out(float f) { return f; }
#endif


extern "C" __global__ void __launch_bounds__(WARPS * 32, 1)
gemv(const uint4* __restrict__ w, const x_t* x, y_t* y, int n, int k, int pdl,
     const x_t* res, const x_t* nw, x_t* h_out, float eps,     // NORM
     const float* add,                                          // ADD_ROWS
     const float* cos, const float* sin)                        // ROPE_HEAD
{
    extern __shared__ uint4 ring[];                               // STAGES tiles, then x (fp32 [k])
    float* xs = reinterpret_cast<float*>(ring + STAGES * TILE_VEC);
    const int splits = k / KC, kv = k / 8, blocks = (n + ROWS - 1) / ROWS;
    const int rb0 = (int)((long)blockIdx.x * blocks / gridDim.x);                 // this program's row blocks
    const int mine = ((int)((long)(blockIdx.x + 1) * blocks / gridDim.x) - rb0) * splits;   // its tiles

    auto load = [&](int i) {                                      // tile i -> slot i % STAGES
        if (i < mine) {
            const int r0 = (rb0 + i / splits) * ROWS, c0 = i % splits * VEC;
            const unsigned dst = smem_addr(ring + i % STAGES * TILE_VEC);
            for (int v = threadIdx.x; v < TILE_VEC; v += WARPS * 32) {
                const int r = v / VEC, c = v % VEC;
                if (r0 + r < n) cp_async16(dst + v * 16, w + (long)(r0 + r) * kv + c0 + c);
            }
        }
        asm volatile("cp.async.commit_group;");
    };
    for (int i = 0; i < STAGES; i++) load(i);
    if (pdl) {   // let the next kernel launch (it may preload too), then wait for the one before
        asm volatile("griddepcontrol.launch_dependents;");
        asm volatile("griddepcontrol.wait;" ::: "memory");
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // x (and with NORM res, nw) into shared memory as fp32: 8 values a load, BATCH loads in
    // flight a thread (one L2 round trip for the whole row, not one a value)
    float rstd = 1.f;
#if NORM
    float ss = 0.f;
#endif
    for (int base = threadIdx.x * 8; base < k; base += BATCH * WARPS * 32 * 8) {
        float f[BATCH][8];
#if NORM
        float r[BATCH][8], wn[BATCH][8];
#endif
#pragma unroll
        for (int b = 0; b < BATCH; b++) {
            const int j = base + b * WARPS * 32 * 8;
            if (j < k) {
                ld_x8(x + j, f[b]);
#if NORM
                if (res) ld_x8(res + j, r[b]);
                ld_x8(nw + j, wn[b]);
#endif
            }
        }
#pragma unroll
        for (int b = 0; b < BATCH; b++) {
            const int j = base + b * WARPS * 32 * 8;
            if (j < k) {
#pragma unroll
                for (int e = 0; e < 8; e++) {
#if NORM
                    const float h = res ? as_x(f[b][e] + r[b][e]) : f[b][e];
                    ss += h * h;
                    xs[j + e] = h * wn[b][e];
                    if (h_out && j / (WARPS * 32 * 8) % gridDim.x == blockIdx.x) h_out[j + e] = to_x(h);
#else
                    xs[j + e] = f[b][e];
#endif
                }
            }
        }
    }
#if NORM
    __shared__ float nred[WARPS];
    ss = block_sum<WARPS>(ss, nred);
    rstd = rsqrtf(ss / k + eps);
#endif
    // warp w multiplies the vectors w VW .. w VW + VW - 1 of every tile row: lane group g = lane / VW
    // takes rows g, g + RPL, ..; so each lane reads its 8 x values once a tile, for all its rows
    const int g = lane / VW, vec = warp * VW + lane % VW;
    __shared__ float red[WARPS][ROWS];                            // each warp's sums of a row block
    float acc[ACC];
#pragma unroll
    for (int j = 0; j < ACC; j++) acc[j] = 0.f;
    for (int i = 0; i < mine; i++) {
        asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 1));
        __syncthreads();
        const int s = i % splits, r0 = (rb0 + i / splits) * ROWS;
        const uint4* tile = ring + i % STAGES * TILE_VEC;
        const float4* xv = reinterpret_cast<const float4*>(xs + s * KC + vec * 8);
        const float4 xa = xv[0], xb = xv[1];
#pragma unroll
        for (int j = 0; j < ACC; j++) {
            const uint4 v = tile[(g + RPL * j) * VEC + vec];
            acc[j] += bf16_lo(v.x) * xa.x + bf16_hi(v.x) * xa.y + bf16_lo(v.y) * xa.z + bf16_hi(v.y) * xa.w
                    + bf16_lo(v.z) * xb.x + bf16_hi(v.z) * xb.y + bf16_lo(v.w) * xb.z + bf16_hi(v.w) * xb.w;
        }
        if (s == splits - 1) {                                    // the row block is done: finish its rows
#pragma unroll
            for (int j = 0; j < ACC; j++) {
#pragma unroll
                for (int o = VW / 2; o > 0; o /= 2) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
                if (lane % VW == 0) red[warp][g + RPL * j] = acc[j];
                acc[j] = 0.f;
            }
            __syncthreads();
            const int r = threadIdx.x;
            if (r < ROWS && r0 + r < n) {
                float v = 0.f;
#pragma unroll
                for (int q = 0; q < WARPS; q++) v += red[q][r];
                v *= rstd;
#if ROPE_HEAD
                const int d = (r0 + r) % ROPE_HEAD - ROPE_OFF;
                if (d >= 0) {                                     // the pair (r & ~1, r | 1)
                    float p = 0.f;
#pragma unroll
                    for (int q = 0; q < WARPS; q++) p += red[q][r ^ 1];
                    p *= rstd;
                    const float c = ld_f32(cos + d / 2), sn = ld_f32(sin + d / 2);
                    v = r % 2 ? v * c + p * sn : v * c - p * sn;
                }
#endif
#if ADD_ROWS
#pragma unroll
                for (int j = 0; j < ADD_ROWS; j++) v += ld_f32(add + (long)j * n + r0 + r);
#endif
                y[r0 + r] = out(v);
            }
        }
        __syncthreads();                                          // slot i % STAGES is free again
        load(i + STAGES);
    }
}
