// A latency probe, not used by the engine (experiments/hop_probe.py, experiments/scripts/hop_probe.py): what
// one dependency between SMs costs through global memory, alone (between two, and over all of
// them as in a dataflow chain): the floor under a persistent kernel's software dependency
// (experiments/dataflow.cu's hop measured ~2.2 us, a PDL launch ~1.1).
// Programs 0 and 1 (one an SM: each asks for most of an SM's shared memory) pass a token back and
// forth through flag[0]: program 0 waits for 2r and makes it 2r + 1, program 1 waits for 2r + 1
// and makes it 2r + 2, for `rounds` rounds. MODE says how a program posts and polls:
//   0: st.relaxed.gpu / ld.relaxed.gpu (a bare flag, as NCCL's LL protocol without the data)
//   1: st.release.gpu / ld.acquire.gpu (a flag that orders the data written before it)
//   2: red.release.gpu.add / ld.relaxed.gpu + fence.acq_rel.gpu (experiments/dataflow.cu's counter)
//   3: as 2, then the data: a proxy fence and a bulk copy of `bytes` of x into shared memory,
//      waited for on an mbarrier, before the token goes back (experiments/dataflow.cu's x loader)
//   4: all to one, as a dataflow phase completes: program 0 posts round r (st.release.gpu r + 1),
//      every other program waits for it and adds 1 to flag[2] (red.release.gpu); program 0
//      waits for all of them (relaxed polls, fence.acq_rel.gpu); a round is two hops
//   5: as 3, but a consumer warp waits for x on the mbarrier, multiplies one row of 256 bf16
//      weights (`w`, in its registers) by x's first 256 values, stores the sum (out[2 + me]) and
//      posts: the dataflow kernel's hop with its hand-off from the x loader to a team
//   6: as 5, and the consumer hands the post to a publisher lane through shared memory (a
//      CTA-scope release that the publisher acquires), as dataflow.cu's PUBLISHER build
//   7-9: all to all, as one dependency of a dataflow chain: every program waits in round r
//      until all programs have added their round r - 1 to flag[2] (relaxed polls, fence.acq_rel.gpu)
//      and adds its round r: 7 the waiting lane adds at once (the counter alone), 8 as 5 (x
//      copied, a consumer warp multiplies and adds), 9 as 6 (and a publisher lane adds); a
//      round is one hop
//   10-11: as 7 and 9, with a flag a program instead of the counter: a program posts round r
//      by st.release.gpu of r + 1 to its own flag (flag[4 + g]); a whole warp polls all the
//      flags (ld.relaxed.gpu, a vote), then fence.acq_rel.gpu; no atomics on one address
// The other programs, if any, stream their span of `buf` from DRAM until program 0 is done
// (flag[1]), so the hop can be timed under a weight stream as a decode step has.
// out[0]: %globaltimer ns of the rounds after the first WARM (program 0's view); out[1]: the
// token at the end (2 rounds; MODE 4: flag[2], (programs - 1) rounds; MODE 7-9: flag[2],
// programs x rounds; MODE 10-11: the flags' sum, the same); out[2]: MODE 5, 6, 8, 9, 11,
// program 0's last sum (fp32 bits); flag[3]: 1 if a wait gave up (~1 s).
#include PROBE_COMMON   // experiments/probe_common.cuh (experiments/cuda.py); it includes common.cuh

#define WARM 16

__device__ __forceinline__ int poll(const int* p) {
    int v;
#if MODE == 1
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#else
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#endif
    return v;
}
__device__ __forceinline__ void post(int* p, int v) {   // the token was v - 1 (MODE >= 2: adds 1)
#if MODE == 0
    asm volatile("st.relaxed.gpu.global.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
#elif MODE == 1
    asm volatile("st.release.gpu.global.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
#else
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(p) : "memory");
#endif
}
__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

extern "C" __global__ void __launch_bounds__(256, 1)
hop(int* flag, int rounds, const uint4* buf, int span, const float* x, int bytes, const uint4* w,
    unsigned long long* out)
{
    extern __shared__ __align__(128) unsigned char sm[];   // MODE 3 and with XWARP: x lands here
    __shared__ __align__(8) unsigned long long bar;
#if MODE >= 5
#define ALL (MODE >= 7)                                    // every program, flag[2] (or the flags)
#define FLAGS (MODE >= 10)                                 // a flag a program (flag[4 + g]), not one counter
#define XWARP (MODE != 7 && MODE != 10)                    // x copied to a consumer warp
#define PUB (MODE == 6 || MODE == 9 || MODE == 11)         // posts through a publisher lane
    __shared__ int ready;                                  // PUB: the consumer's posts, for the publisher
    int* const cnt = ALL ? flag + 2 : flag;                // what the loaders wait for and the posts add to
    int* const flags = flag + 4;
    if (ALL || blockIdx.x < 2) {
        const int me = blockIdx.x, G = gridDim.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        auto posted = [&](int r) {                         // ALL: every program's round r - 1 is in; pairs: my turn
            if (!FLAGS) return ALL ? poll(cnt) >= G * r : poll(cnt) == 2 * r + me;
            bool in = true;                                // FLAGS: the whole warp polls
            for (int i = lane; i < G; i += 32) in = in && poll(flags + i) >= r;
            return __all_sync(0xffffffffu, in) != 0;
        };
        auto publish = [&](int r) {                        // my round r is done
            if (FLAGS) asm volatile("st.release.gpu.global.s32 [%0], %1;" :: "l"(flags + me), "r"(r + 1) : "memory");
            else post(cnt, 2 * r + me + 1);
        };
        if (threadIdx.x == 0) {
            mbar_init(smem_addr(&bar), 1);
            ready = 0;
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncthreads();
        if (warp == 0 && (FLAGS || lane == 0)) {           // the x loader (FLAGS: its warp polls)
            unsigned long long t0 = 0;
            for (int r = 0; r < rounds; r++) {
                if (me == 0 && r == WARM) t0 = now_ns();
                if (!wait_until([&] { return posted(r); }, flag + 3)) { flag[1] = 1; return; }
                if (lane != 0) continue;
                asm volatile("fence.acq_rel.gpu;" ::: "memory");
                if (!XWARP) { publish(r); continue; }
                asm volatile("fence.proxy.async.global;" ::: "memory");
                bulk_load(sm, x, bytes, smem_addr(&bar));
            }
            if (me == 0) {
                wait_until([&] { return posted(rounds); }, flag + 3);
                if (lane == 0) {
                    out[0] = now_ns() - t0;
                    int token = FLAGS ? 0 : poll(cnt);
                    for (int i = 0; FLAGS && i < G; i++) token += poll(flags + i);
                    out[1] = token;
                    asm volatile("st.relaxed.gpu.global.s32 [%0], 1;" :: "l"(flag + 1) : "memory");
                }
            }
        } else if (XWARP && warp == 1) {                   // the consumer
            const uint4 wv = w[lane];
            const float4* x4 = reinterpret_cast<const float4*>(sm);
            for (int r = 0; r < rounds; r++) {
                if (!mbar_wait(smem_addr(&bar), r & 1, flag + 3)) return;
                const float s = warp_sum(dot8(wv, x4[2 * lane], x4[2 * lane + 1]));
                if (lane == 0) {
                    if (me < 2) out[2 + me] = __float_as_uint(s);
                    if (!PUB) publish(r);
                    else asm volatile("red.release.cta.shared::cta.add.s32 [%0], 1;" :: "r"(smem_addr(&ready)) : "memory");
                }
            }
        } else if (PUB && warp == 2 && lane == 0) {        // the publisher
            for (int r = 0; r < rounds; r++) {
                if (!wait_until([&] { return ld_acquire_cta(&ready) >= r + 1; }, flag + 3)) return;
                publish(r);
            }
        }
        return;
    }
#endif
#if MODE == 4
    if (threadIdx.x != 0) return;
    const int fan = gridDim.x - 1;
    unsigned long long t0 = 0;
    for (int r = 0; r < rounds; r++) {
        if (blockIdx.x == 0) {
            if (r == WARM) t0 = now_ns();
            asm volatile("st.release.gpu.global.s32 [%0], %1;" :: "l"(flag), "r"(r + 1) : "memory");
            if (!wait_until([&] { return poll(flag + 2) >= fan * (r + 1); }, flag + 3)) return;
        } else {
            if (!wait_until([&] { return poll(flag) >= r + 1; }, flag + 3)) return;
            asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(flag + 2) : "memory");
        }
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
    }
    if (blockIdx.x == 0) {
        out[0] = now_ns() - t0;
        out[1] = poll(flag + 2);
    }
    return;
#endif
    if (MODE < 5 && blockIdx.x < 2) {
        if (threadIdx.x != 0) return;
        const int me = blockIdx.x;
        if (MODE == 3) {
            mbar_init(smem_addr(&bar), 1);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        unsigned long long t0 = 0;
        for (int r = 0; r < rounds; r++) {
            if (me == 0 && r == WARM) t0 = now_ns();
            if (!wait_until([&] { return poll(flag) == 2 * r + me; }, flag + 3)) { flag[1] = 1; return; }
            if (MODE >= 2) asm volatile("fence.acq_rel.gpu;" ::: "memory");
            if (MODE == 3) {
                asm volatile("fence.proxy.async.global;" ::: "memory");
                bulk_load(sm, x, bytes, smem_addr(&bar));
                while (!mbar_done(smem_addr(&bar), r & 1)) {}
            }
            post(flag, 2 * r + me + 1);
        }
        if (me == 0) {
            wait_until([&] { return poll(flag) == 2 * rounds; }, flag + 3);
            out[0] = now_ns() - t0;
            out[1] = poll(flag);
            asm volatile("st.relaxed.gpu.global.s32 [%0], 1;" :: "l"(flag + 1) : "memory");
        }
        return;
    }
    const uint4* base = buf + (long long)(blockIdx.x - 2) * span;   // the stream: span 16-byte words a program
    unsigned acc = 0;
    while (!poll(flag + 1))
        for (long long i = threadIdx.x; i < span; i += blockDim.x) {
            const uint4 v = ld_v4(base + i);
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
    if (acc == 0x9e3779b9u) out[3] = acc;                 // keeps the loads
}
