// A chain of dependent one-row GEMVs in one persistent launch whose weight stream does not stop
// at the dependencies (kernels/dataflow.py): phase p computes y_p = W_p x_p, x_p the first K_p
// values of an earlier phase's output (or of the input), fp32 activations, bf16 weights.
//
// Every phase is cut into tiles of whole rows of W (one contiguous run of at most SLOT bytes),
// numbered in phase order and dealt round robin over the programs (one an SM, all resident).
// In a program, one producer lane walks its tiles in order and copies each into a ring of SLOTS
// shared-memory slots with one bulk copy (cp.async.bulk, completion on the slot's `full`
// mbarrier) as soon as the slot is free: weights depend on nothing, so it runs ahead of the
// dependencies by up to the ring's size. The consumer warps take the tiles in the same order:
// at a tile of a new phase they wait until every tile of the phase it reads is done (a counter
// a phase in global memory: relaxed polls, then a fence), load x_p into shared memory, then multiply each
// tile as it lands (the warps split a long row's 256-value segments, or take a short row each;
// fp32 sums, a row's partials added in order: repeatable to the bit), release the slot (`empty`
// mbarrier) and store its y rows. After its last tile of a phase, thread 0 adds the program's
// tiles of the phase to its counter with one release reduction, after a barrier of the consumer
// warps (which orders the other threads' stores before it, as CUTLASS's semaphores rely on); so
// a program publishes once a phase, not once a tile. The phase table is kept in shared memory
// (it is walked at every tile).
// The last program to finish sets the counters to zero again for the next launch. A wait that
// lasts over ~1 s (a program not resident) gives up and sets *err instead of hanging the GPU.
//
// Compile-time: SLOTS, SLOT (bytes a slot), KMAX (the largest K: the x buffer), MARKS (1: thread 0
// of the consumers writes where its cycles go, a phase: kernels/dataflow.py `run(marks=)`).
#include "common.cuh"

#define CONSUMERS 8                        // consumer warps; one more warp produces
#define THREADS (32 * (CONSUMERS + 1))
#define COLS 9                             // table columns (kernels/dataflow.py)
#define MAXBN 256                          // rows a tile, at most
#define MAXPH 64                           // phases, at most
// a split row has > 32 (CONSUMERS - 1) 16-byte vectors: a tile holds few such rows
static_assert(SLOT / (16 * (32 * (CONSUMERS - 1) + 1)) * CONSUMERS <= MAXBN, "split rows' partials fit");
enum { W_OFF, N, K, X_OFF, Y_OFF, SRC, BN, TILES, FIRST };

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ bool mbar_wait(unsigned bar, unsigned parity, int* err) {   // false: gave up
    const long long t0 = clock64();
    unsigned done = 0;
    while (!done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
        if (!done && clock64() - t0 > 2000000000ll) { atomicExch(err, 1); return false; }
    }
    return true;
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("{ .reg .b64 s; mbarrier.arrive.shared::cta.b64 s, [%0]; }" :: "r"(bar) : "memory");
}
__device__ __forceinline__ int ld_relaxed(const int* p) {
    int v;
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void consumers_sync() {   // the consumer warps only (named barrier 1)
    asm volatile("bar.sync 1, %0;" :: "n"(32 * CONSUMERS) : "memory");
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
dataflow(const unsigned short* w,                     // bf16, every phase's W [N, K] row-major at W_OFF
         float* act,                                  // fp32: the input, every phase's y
         const long long* gtable, int phases, int total,  // [phases <= MAXPH, COLS]; tiles of all phases
         int* done, int* err,                         // [phases + 1]: tiles done a phase, programs done
         long long* marks)                            // MARKS: [G, phases, 4] clock64 spans (below)
{
    extern __shared__ __align__(1024) unsigned char sm[];
    float* xs = reinterpret_cast<float*>(sm + SLOTS * SLOT);   // [KMAX]
    __shared__ __align__(8) unsigned long long full[SLOTS], empty[SLOTS];
    __shared__ float part[2][MAXBN];                 // a tile's partial sums: (row, warp) or row
    __shared__ long long table[MAXPH * COLS];        // the phase table, walked at every tile
    const int t = threadIdx.x, warp = t / 32, lane = t % 32, g = blockIdx.x, G = gridDim.x;
    for (int i = t; i < phases * COLS; i += THREADS) table[i] = gtable[i];
    auto end = [&](int q) { return table[q * COLS + FIRST] + table[q * COLS + TILES]; };   // past phase q's tiles
    if (t == 0) {
        for (int s = 0; s < SLOTS; s++) { mbar_init(smem_addr(full + s), 1); mbar_init(smem_addr(empty + s), 1); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == CONSUMERS) {                          // the producer
        if (lane == 0) {
            int p = 0;
            for (int i = 0, u = g; u < total; u += G, i++) {
                while (u >= end(p)) p++;
                const long long* ph = table + p * COLS;
                const int s = i % SLOTS, j = u - (int)ph[FIRST], r0 = j * (int)ph[BN];
                const int rows = min((int)ph[BN], (int)ph[N] - r0);
                const unsigned bytes = (unsigned)(rows * ph[K] * 2);
                if (i >= SLOTS && !mbar_wait(smem_addr(empty + s), (i / SLOTS - 1) & 1, err)) break;
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                             :: "r"(smem_addr(full + s)), "r"(bytes) : "memory");
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                             :: "r"(smem_addr(sm + s * SLOT)), "l"(w + ph[W_OFF] + (long long)r0 * ph[K]), "r"(bytes),
                                "r"(smem_addr(full + s)) : "memory");
            }
        }
    } else {                                          // the consumers
        int p = 0, have = -1, mine = 0;               // the phase of x; its tiles done here, not yet counted
#if MARKS   // thread 0's cycles a (program, phase): 0 waiting for the input, 1 loading x, 2 waiting for tiles, 3 to publish
        long long* mk = marks;
#endif
        auto count = [&]() {                          // publish them (after a consumer barrier)
            if (t == 0) asm volatile("red.release.gpu.global.add.s32 [%0], %1;" :: "l"(done + have), "r"(mine) : "memory");
            mine = 0;
        };
        for (int i = 0, u = g; u < total; u += G, i++) {
            while (u >= end(p)) p++;
            const long long* ph = table + p * COLS;
            const int k = (int)ph[K];
            if (p != have) {                          // a new phase: wait for its input
#if MARKS
                mk = marks + ((long long)g * phases + p) * 4;
                long long c0 = clock64();
#endif
                consumers_sync();                     // x no longer read
                const int src = (int)ph[SRC];
                if (t == 0 && src >= 0) {
                    const long long t0 = clock64();
                    while (ld_relaxed(done + src) < (int)table[src * COLS + TILES])
                        if (clock64() - t0 > 2000000000ll) { atomicExch(err, 1); break; }
                    asm volatile("fence.acq_rel.gpu;" ::: "memory");
                }
                consumers_sync();
#if MARKS
                long long c1 = clock64();
                if (t == 0) mk[0] = c1 - c0;
#endif
                for (int c = t; c < k; c += 32 * CONSUMERS) xs[c] = ld_f32(act + ph[X_OFF] + c);
                consumers_sync();
#if MARKS
                if (t == 0) { mk[1] = clock64() - c1; mk[2] = 0; mk[3] = clock64(); }
#endif
                have = p;
            }
            const int s = i % SLOTS, j = u - (int)ph[FIRST], r0 = j * (int)ph[BN];
            const int rows = min((int)ph[BN], (int)ph[N] - r0);
#if MARKS
            const long long cw = clock64();
#endif
            mbar_wait(smem_addr(full + s), (i / SLOTS) & 1, err);
#if MARKS
            if (t == 0) mk[2] += clock64() - cw;
#endif
            const uint4* tile = reinterpret_cast<const uint4*>(sm + s * SLOT);
            const float4* x4 = reinterpret_cast<const float4*>(xs);
            const int kv = k / 8, segs = (kv + 31) / 32;   // 16-byte vectors a row; 32-vector segments
            // long rows: the warps split each row's segments (8 partial sums a row); short: a row a warp
            const bool split = segs >= CONSUMERS;
            float* pt = part[i & 1];                  // two buffers: one barrier a tile
            for (int r = split ? 0 : warp; r < rows; r += split ? 1 : CONSUMERS) {
                float a = 0.f;
                for (int q = split ? warp : 0; q < segs; q += split ? CONSUMERS : 1) {
                    const int c = q * 32 + lane;
                    if (c < kv) {
                        const uint4 w4 = tile[r * kv + c];
                        const float4 x0 = x4[2 * c], x1 = x4[2 * c + 1];
                        a += bf16_lo(w4.x) * x0.x + bf16_hi(w4.x) * x0.y + bf16_lo(w4.y) * x0.z + bf16_hi(w4.y) * x0.w
                           + bf16_lo(w4.z) * x1.x + bf16_hi(w4.z) * x1.y + bf16_lo(w4.w) * x1.z + bf16_hi(w4.w) * x1.w;
                    }
                }
                a = warp_sum(a);
                if (lane == 0) pt[split ? r * CONSUMERS + warp : r] = a;
            }
            consumers_sync();                         // every partial written, the slot read
            if (t == 0) mbar_arrive(smem_addr(empty + s));
            for (int r = t; r < rows; r += 32 * CONSUMERS) {   // a row's partials, in order
                float y = 0.f;
                for (int q = 0; q < (split ? CONSUMERS : 1); q++) y += pt[split ? r * CONSUMERS + q : r];
                act[ph[Y_OFF] + r0 + r] = y;
            }
            mine++;
            if (u + G >= end(p)) {                    // the program's last tile of the phase: publish
                consumers_sync();                     // every row stored
                count();
#if MARKS
                if (t == 0) mk[3] = clock64() - mk[3];
#endif
            }
        }
    }
    __syncthreads();
    if (t == 0) {                                     // the last program out resets the counters
        int old;
        asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(done + phases) : "memory");
        if (old == G - 1)
            for (int q = 0; q <= phases; q++) done[q] = 0;
    }
}
