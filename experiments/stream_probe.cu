// A streaming probe, not used by the engine (experiments/scripts/stream_probe.py): how fast the
// programs of a grid pull a buffer from DRAM by copy kind, programs an SM and threads. Program
// p reads its own contiguous span of `src` (`span` bytes from p * span) in chunks of CHUNK
// bytes (span a multiple of CHUNK and of 16 x THREADS), and XORs the words it read into out[p] (so nothing is optimised away).
//
// MODE 0: ld.global.v4 into registers, UNROLL 16-byte loads in flight a thread
// MODE 1: cp.async, 16 bytes a thread, into a ring of STAGES chunks of shared memory
// MODE 2: TMA bulk copies, one a chunk, into a ring of STAGES chunks (one mbarrier a slot,
//         issued by thread 0)
// In modes 1 and 2 every thread then reads its 16-byte words of each chunk from shared
// memory, as a kernel consuming the ring would.
#include "common.cuh"

__device__ __forceinline__ unsigned fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

extern "C" __global__ void __launch_bounds__(THREADS)
stream(const unsigned char* src, int span, unsigned* out)
{
    const unsigned char* base = src + (long)blockIdx.x * span;
    const int tid = threadIdx.x;
    unsigned acc = 0;
#if MODE == 0
    for (long off = (long)tid * 16; off < span; off += (long)THREADS * 16 * UNROLL) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const long o = off + (long)u * THREADS * 16;
            if (o < span) v[u] = ld_v4(base + o);
            else v[u] = {0u, 0u, 0u, 0u};
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) acc ^= fold(v[u]);
    }
#else
    extern __shared__ __align__(128) unsigned char ring[];        // STAGES x CHUNK
    const int chunks = (int)(span / CHUNK);
#if MODE == 1
    auto issue = [&](int c) {
        if (c < chunks)
            for (int v = tid; v < CHUNK / 16; v += THREADS)
                cp_async16(smem_addr(ring + (c % STAGES) * CHUNK + 16 * v), base + (long)c * CHUNK + 16 * v);
        asm volatile("cp.async.commit_group;");
    };
    for (int c = 0; c < STAGES; c++) issue(c);
    for (int c = 0; c < chunks; c++) {
        asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 1) : "memory");
        __syncthreads();
        for (int v = tid; v < CHUNK / 16; v += THREADS)
            acc ^= fold(reinterpret_cast<const uint4*>(ring + (c % STAGES) * CHUNK)[v]);
        __syncthreads();
        issue(c + STAGES);
    }
#else
    __shared__ __align__(8) unsigned long long full[STAGES];
    auto issue = [&](int c) {
        if (c < chunks) {
            const unsigned bar = smem_addr(full + c % STAGES);
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(CHUNK) : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         :: "r"(smem_addr(ring + (c % STAGES) * CHUNK)), "l"(base + (long)c * CHUNK), "r"(CHUNK), "r"(bar)
                         : "memory");
        }
    };
    if (tid == 0) {
        for (int i = 0; i < STAGES; i++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(full + i)));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (tid == 0)
        for (int c = 0; c < STAGES; c++) issue(c);
    for (int c = 0; c < chunks; c++) {
        asm volatile("{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT;\n}"
                     :: "r"(smem_addr(full + c % STAGES)), "r"((c / STAGES) & 1) : "memory");
        for (int v = tid; v < CHUNK / 16; v += THREADS)
            acc ^= fold(reinterpret_cast<const uint4*>(ring + (c % STAGES) * CHUNK)[v]);
        __syncthreads();
        if (tid == 0) issue(c + STAGES);
    }
#endif
#endif
    atomicXor(out + blockIdx.x, acc);
}
