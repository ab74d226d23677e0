// A chain of dependent one-row GEMVs in one persistent launch whose weight stream does not stop
// at the dependencies (experiments/dataflow.py): phase p computes y_p = W_p x_p, x_p the first K_p
// values of an earlier phase's output (or of the input), fp32 activations, bf16 weights.
//
// Every phase is cut into tiles of whole rows of W (one contiguous run of at most SLOT bytes),
// numbered in phase order and dealt round robin over the programs (one an SM, all resident).
// A program has three roles, each walking its tiles in the same order:
// - the producer (one lane) copies tile i into slot i % SLOTS of shared memory with one bulk
//   copy (cp.async.bulk, completion on the slot's `full` mbarrier) as soon as the slot is free:
//   weights depend on nothing, so the stream runs ahead of the dependencies by the ring;
// - the x loader (one lane), at each phase in which the program has tiles, waits until every
//   tile of the phase it reads is done (a counter a phase in global memory: relaxed polls, then
//   an acquire fence and a proxy fence, since a bulk copy reads what other programs stored),
//   then copies x_p with one bulk copy into one of two x buffers (`xfull`), once the consumers
//   have left the phase that used that buffer before (`xempty`);
// - TEAMS teams of SPLIT consumer warps take the tiles round robin (tile i: team i % TEAMS;
//   SLOTS is a multiple of TEAMS, so a slot's tiles are all one team's, which has taken the
//   slot's last tile before it waits for the next: its mbarriers are never two phases apart),
//   no block-wide barrier: a team waits for its phase's x and its tile, multiplies RB rows at
//   a time, then the rest one at a time (`team_rows`: each warp a share of a row's vectors, x
//   loaded once for the rows; fp32 sums added in a fixed order: repeatable to the bit), frees
//   the slot (`empty`) and stores the rows; after its last tile of a phase it adds its tiles of
//   the phase to the phase's counter with one release reduction. Every warp, tiles of the
//   phase or not, waits for each phase's x before it leaves the phase (`xempty`), so a warp
//   with nothing to do cannot arrive twice on one buffer's barrier.
// With PUBLISHER, a team instead adds its tiles to a shared-memory count a phase (a CTA-scope
// release: no wait on the GPU's memory) and one more lane, the publisher, waits for each of
// the program's phases to be complete there and publishes it with the release reduction, whose
// wait for the stores to land (1-4 us under the weight stream) then stalls no team.
// The last program to finish sets the counters to zero again for the next launch. A wait that
// lasts over ~1 s (a program not resident) gives up and sets *err instead of hanging the GPU.
//
// Compile-time: SLOTS, SLOT (bytes a slot), KMAX (the largest K: an x buffer), SPLIT (warps a
// team), RB (rows a team multiplies at once), VECS (16-byte vectors of each of those rows a
// team's lane loads before it multiplies; a multiple of SPLIT), PUBLISHER (1: the publisher
// lane above), MARKS (1: where a (program, phase)'s cycles go: experiments/dataflow.py
// `run(marks=)`).
#include PROBE_COMMON   // experiments/probe_common.cuh (experiments/cuda.py); it includes common.cuh

#define TEAMS 8                            // consumer teams (a tile each); then the producer's warp, the loader's
#define CONSUMERS (TEAMS * SPLIT)          // consumer warps: SPLIT a team, each a share of a row's vectors
#define THREADS (32 * (CONSUMERS + 2 + PUBLISHER))   // + the publisher's warp
#define COLS 9                             // table columns (experiments/dataflow.py)
#define MAXPH 64                           // phases, at most
#define UNROLL (VECS / SPLIT)              // 16-byte vectors of a row a lane loads at once (registers)
static_assert(SLOTS % TEAMS == 0, "a slot belongs to one consumer team");
static_assert(VECS % SPLIT == 0, "a team's vectors in flight are shared by its warps");
enum { W_OFF, N, K, X_OFF, Y_OFF, SRC, BN, TILES, FIRST };
enum { M_INPUT, M_XBUF, M_X, M_TILE, M_MULT, M_PUBLISH, M_TILES, M_COLS };   // marks: cycles, tiles a (program, phase)

__device__ __forceinline__ int ld_relaxed(const int* p) {
    int v;
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// rows [0, R) of a tile (kv 16-byte vectors a row) times x, this warp's share: vectors
// c0, c0 + 32 SPLIT, ... (c0 = 32 h + lane), UNROLL of them loaded before their sums, UNROLL
// partial sums a row (added in a fixed order), then a warp sum: every lane gets the R sums.
template <int R>
__device__ __forceinline__ void rows_dot(const uint4* tile, const float4* x4, int kv, int c0, float (&y)[R]) {
    float a[R][UNROLL] = {};
    for (; c0 < kv; c0 += 32 * SPLIT * UNROLL) {
        uint4 wv[UNROLL][R];
        float4 xa[UNROLL], xb[UNROLL];
#pragma unroll
        for (int v = 0; v < UNROLL; v++) {
            const int c = min(c0 + 32 * SPLIT * v, kv - 1);
            xa[v] = x4[2 * c];
            xb[v] = x4[2 * c + 1];
#pragma unroll
            for (int q = 0; q < R; q++) wv[v][q] = tile[q * kv + c];
        }
#pragma unroll
        for (int v = 0; v < UNROLL; v++)
#pragma unroll
            for (int q = 0; q < R; q++)
                if (c0 + 32 * SPLIT * v < kv) a[q][v] += dot8(wv[v][q], xa[v], xb[v]);
    }
#pragma unroll
    for (int q = 0; q < R; q++) {
        float sum = 0.f;
#pragma unroll
        for (int v = 0; v < UNROLL; v++) sum += a[q][v];
        y[q] = warp_sum(sum);
    }
}
__device__ __forceinline__ void team_sync(int team) {   // the SPLIT warps of a team (named barrier 1 + team)
    if (SPLIT == 1) __syncwarp();
    else asm volatile("bar.sync %0, %1;" :: "r"(1 + team), "n"(32 * SPLIT) : "memory");
}
// A team's rows [0, R) into y: warp h of the team adds its share; lane 0 of warp 0 stores
// the sums (warp 0's share, then the others' in order; part: the team's RB (SPLIT - 1) floats).
template <int R>
__device__ __forceinline__ void team_rows(const uint4* tile, const float4* x4, int kv, int h, int lane, int team,
                                          float* part, float* y) {
    float s[R];
    rows_dot<R>(tile, x4, kv, 32 * h + lane, s);
    if (SPLIT > 1) {
        if (h > 0 && lane == 0)
            for (int q = 0; q < R; q++) part[(h - 1) * RB + q] = s[q];
        team_sync(team);
        if (h == 0 && lane == 0)
            for (int q = 0; q < R; q++)
                for (int o = 1; o < SPLIT; o++) s[q] += part[(o - 1) * RB + q];
        team_sync(team);                              // part read before the next rows write it
    }
    if (h == 0 && lane == 0)
        for (int q = 0; q < R; q++) y[q] = s[q];
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
dataflow(const unsigned short* w,                     // bf16, every phase's W [N, K] row-major at W_OFF
         float* act,                                  // fp32: the input, every phase's y
         const long long* gtable, int phases, int total,  // [phases <= MAXPH, COLS]; tiles of all phases
         int* done, int* err,                         // [phases + 1]: tiles done a phase, programs done
         unsigned long long* marks)                   // MARKS: [G, phases, M_COLS]
{
    extern __shared__ __align__(1024) unsigned char sm[];
    float* xs = reinterpret_cast<float*>(sm + SLOTS * SLOT);   // [2][KMAX]
    __shared__ __align__(8) unsigned long long full[SLOTS], empty[SLOTS], xfull[2], xempty[2];
    __shared__ long long table[MAXPH * COLS];        // the phase table, walked at every tile
    __shared__ float part[TEAMS][RB * SPLIT];        // a team's other warps' sums (team_rows)
    __shared__ int ready[MAXPH];                     // PUBLISHER: the program's tiles done a phase
    const int t = threadIdx.x, warp = t / 32, lane = t % 32, g = blockIdx.x, G = gridDim.x;
    const int team = warp / SPLIT, h = warp % SPLIT;
    for (int i = t; i < phases * COLS; i += THREADS) table[i] = gtable[i];
    for (int i = t; i < phases; i += THREADS) ready[i] = 0;
    auto end = [&](int q) { return table[q * COLS + FIRST] + table[q * COLS + TILES]; };   // past phase q's tiles
#if MARKS
    auto mark = [&](int p, int col, unsigned long long v) { atomicAdd(marks + ((long long)g * phases + p) * M_COLS + col, v); };
#else
    auto mark = [](int, int, unsigned long long) {};
#endif
    if (t == 0) {
        for (int s = 0; s < SLOTS; s++) { mbar_init(smem_addr(full + s), 1); mbar_init(smem_addr(empty + s), 1); }
        for (int b = 0; b < 2; b++) { mbar_init(smem_addr(xfull + b), 1); mbar_init(smem_addr(xempty + b), CONSUMERS); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == CONSUMERS) {                          // the producer
        if (lane == 0) {
            int p = 0;
            for (int i = 0, u = g; u < total; u += G, i++) {
                while (u >= end(p)) p++;
                const long long* ph = table + p * COLS;
                const int s = i % SLOTS, r0 = (u - (int)ph[FIRST]) * (int)ph[BN];
                const int rows = min((int)ph[BN], (int)ph[N] - r0);
                if (i >= SLOTS && !mbar_wait(smem_addr(empty + s), (i / SLOTS - 1) & 1, err)) break;
                bulk_load(sm + s * SLOT, w + ph[W_OFF] + (long long)r0 * ph[K], (unsigned)(rows * ph[K] * 2),
                          smem_addr(full + s));
            }
        }
    } else if (warp == CONSUMERS + 1) {               // the x loader
        if (lane == 0) {
            for (int u = g, p = 0, n = -1; u < total; u += G) {
                if (u < end(p) && n >= 0) continue;  // same phase as the tile before
                while (u >= end(p)) p++;
                const long long* ph = table + p * COLS;
                const int b = ++n & 1, src = (int)ph[SRC];
                const long long c0 = clock64();
                if (n >= 2 && !mbar_wait(smem_addr(xempty + b), ((n >> 1) - 1) & 1, err)) break;
                const long long c1 = clock64();
                if (src >= 0) {
                    wait_until([&] { return ld_relaxed(done + src) >= (int)table[src * COLS + TILES]; }, err);
                    asm volatile("fence.acq_rel.gpu;\n\tfence.proxy.async.global;" ::: "memory");
                }
                mark(p, M_XBUF, c1 - c0);
                mark(p, M_INPUT, clock64() - c1);
                bulk_load(xs + b * KMAX, act + ph[X_OFF], (unsigned)(ph[K] * 4), smem_addr(xfull + b));
            }
        }
    } else if (warp == CONSUMERS + 2) {               // PUBLISHER: the publisher
        if (lane == 0) {
            for (int u = g, p = 0, cnt = 0;; u += G, cnt++) {   // cnt: the program's tiles of phase p so far
                if (u >= total || u >= end(p)) {     // phase p's tiles here all counted: publish them once done
                    if (cnt > 0) {
                        wait_until([&] { return ld_acquire_cta(ready + p) >= cnt; }, err);
                        const long long c1 = clock64();   // cumulative: orders the teams' stores it acquired
                        asm volatile("red.release.gpu.global.add.s32 [%0], %1;" :: "l"(done + p), "r"(cnt) : "memory");
                        mark(p, M_PUBLISH, clock64() - c1);
                    }
                    if (u >= total) break;
                    while (u >= end(p)) p++;
                    cnt = 0;
                }
            }
        }
    } else {                                          // the consumers
        int p = 0, n = -1, mine = 0;                  // the phase of tile i, its index among the program's; tiles not yet published
        for (int i = 0, u = g; u < total; u += G, i++) {
            if (u >= end(p) || n < 0) {               // a new phase: leave the one before, wait for its x
                if (n >= 0 && lane == 0) mbar_arrive(smem_addr(xempty + (n & 1)));
                while (u >= end(p)) p++;
                n++;
                const long long c0 = clock64();
                mbar_wait(smem_addr(xfull + (n & 1)), (n >> 1) & 1, err);
                if (h == 0 && lane == 0) mark(p, M_X, clock64() - c0);
            }
            if (i % TEAMS != team) continue;
            const long long* ph = table + p * COLS;
            const int s = i % SLOTS, k = (int)ph[K], r0 = (u - (int)ph[FIRST]) * (int)ph[BN];
            const int rows = min((int)ph[BN], (int)ph[N] - r0), kv = k / 8;   // 16-byte vectors a row
            const long long c0 = clock64();
            mbar_wait(smem_addr(full + s), (i / SLOTS) & 1, err);
            const long long c1 = clock64();
            const bool lead = h == 0 && lane == 0;    // marks, frees the slot, publishes
            if (lead) { mark(p, M_TILE, c1 - c0); mark(p, M_TILES, 1); }
            const uint4* tile = reinterpret_cast<const uint4*>(sm + s * SLOT);
            const float4* x4 = reinterpret_cast<const float4*>(xs + (n & 1) * KMAX);
            float* y = act + ph[Y_OFF] + r0;
            int r = 0;
            for (; r + RB <= rows; r += RB) team_rows<RB>(tile + r * kv, x4, kv, h, lane, team, part[team], y + r);
            for (; r < rows; r++) team_rows<1>(tile + r * kv, x4, kv, h, lane, team, part[team], y + r);
            team_sync(team);                          // every warp of the team done with the slot
            mine++;
            const bool last = u + TEAMS * G >= end(p);   // the team's last tile of the phase
            if (lead) {
                mbar_arrive(smem_addr(empty + s));
                const long long c2 = clock64();
                if (last && PUBLISHER)                // hand the team's tiles of the phase to the publisher
                    asm volatile("red.release.cta.shared::cta.add.s32 [%0], %1;" :: "r"(smem_addr(ready + p)), "r"(mine)
                                 : "memory");
                else if (last)                        // publish them
                    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" :: "l"(done + p), "r"(mine) : "memory");
                mark(p, M_MULT, c2 - c1);
                if (!PUBLISHER) mark(p, M_PUBLISH, clock64() - c2);
            }
            if (last) mine = 0;
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
