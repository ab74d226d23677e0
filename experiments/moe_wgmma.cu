// W4A16 MoE on Hopper's wgmma (experiments/moe_wgmma.py; docs/notes/moe.md, "wgmma v3"): every
// weight dequantized once a block of up to N3 tokens, the tensor-core products running on under
// the next stage's dequantization.
//
// Two GEMM launches after moe_marlin's planning (moe_plan with blocks of CH = N3 rows):
//   wg_w13  x [T, H] -> act [rows, I] bf16 (sorted rows): SiLU(gate) * up;
//   wg_w2   act -> ypart [T*k, H] bf16: each row times its top-k weight (moe_wide's wide_ksum
//           then sums a token's k rows in slot order).
// A program (one an SM, persistent) is three warpgroups. Warpgroup 0 produces: it copies each
// 64-K stage of the item's token rows (B: CH rows x 128 bytes, the 128-byte swizzle wgmma reads),
// words and scales into a ring of STAGES slots with cp.async and arrives on the slot's `full`
// mbarrier through cp.async.mbarrier.arrive (counts 128). Warpgroups 1 and 2 consume: each owns
// 64 weight rows of the item (w13: 1 the gate rows, 2 the up rows of 64 features; w2: 64 output
// columns each), dequantizes its rows' words of a stage into registers as wgmma's A operand
// (warp w the Marlin tile w of its block: the word of lane 4g + t is exactly that lane's A
// fragment, as in moe_marlin), issues 4 wgmma m64nNk16 (N = N1, N2 or N3, the least that holds
// the block's rows: with more than three sizes compiled in, ptxas 13.0 serializes the wgmma for
// want of registers at 168 a thread), commits them and waits for the group before, so a stage's
// products run while the next stage's words are dequantized; then it frees the slot before on
// `empty` (8 warps arrive). The A registers alternate between two sets (stages even / odd), so
// the set an in-flight group reads is never rewritten before its wait.
//
// Items: w13 (block, 64 features), w2 (block, 128 output columns), taken round robin
// (program, program + grid, ...), so the items of one block run at the same time on
// neighbouring programs and share its token rows in L2.
// Weights: (q - 8) * scale rounded to bf16 once (moe_wide's rounding), fp32 accumulators.
// Determinism: no K split, no atomics. A wait on an mbarrier that lasts ~2 s traps: an error,
// not a hang (the kernel has not yet run on a GPU).
//
// Compile-time: STAGES, N1 <= N2 <= N3 (multiples of 16 up to 128), G (group: 32, 64 or 128), H, I, TOPK.
#include PROBE_COMMON                           // common.cuh; mbar_init, mbar_done, mbar_arrive

#define CH N3                                   // rows a block
#define KS 64                                   // K a stage: 4 k16 steps, 128 bytes a token row
#define XB (CH * 128)                           // a stage's token tile
#define WB (2 * 4 * 128 * 4)                    // words: 2 warpgroups x 4 k16 x 128 words
#define SB 1024                                 // scales: 2 warpgroups x NGS groups x 64 bf16 (<= 512), padded
#define STAGE_B (XB + WB + SB)                  // a multiple of 1024
#define NGS (G == 32 ? 2 : 1)                   // scale groups a stage
#define XCH_B (64 * CH * 4)                     // w13: the up warpgroup's accumulators for the gate one
#define STG_B (CH * 128)                        // a warpgroup's bf16 output tile (CH rows x 64 columns)
#define SMEM_B (1024 + STAGES * STAGE_B + XCH_B + 2 * STG_B + 2 * CH * 8 + STAGES * 16)

static_assert(G == 32 || G == 64 || G == 128, "G is 32, 64 or 128");
static_assert(N1 % 16 == 0 && N2 % 16 == 0 && N3 % 16 == 0 && N1 <= N2 && N2 <= N3 && N3 <= 128,
              "N1 <= N2 <= N3: multiples of 16 up to 128");
static_assert(H % 128 == 0 && I % 128 == 0, "the stage loop runs stages in pairs: H and I multiples of 128");

__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {   // ~2 s without the phase: trap, not hang
    const long long t0 = clock64();
    while (!mbar_done(bar, parity))
        if (clock64() - t0 > 4000000000ll) __trap();
}
__device__ __forceinline__ void cp_arrive(unsigned bar) {   // arrives when this thread's cp.async so far have landed
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }
template <int M>                                // the compiler may not move reads of the accumulators across a wait
__device__ __forceinline__ void fence_regs(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i < M; i++) asm volatile("" : "+f"(d[i]) :: "memory");
}
// wgmma's shared-memory B: K-major rows of 128 bytes, 128-byte swizzle, 8-row groups 1024 bytes apart
__device__ __forceinline__ unsigned long long desc_b(unsigned addr) {
    return (unsigned long long)((addr & 0x3ffff) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
// word q of lane 4g + t, scale pair sc (rows g, g + 8 of the warp's tile) -> the lane's m64nNk16 A fragment:
// nibble pairs (0, 4), (1, 5) are rows g (a0a1, a4a5), (2, 6), (3, 7) rows g + 8 (a2a3, a6a7)
__device__ __forceinline__ void dequant_a(unsigned q, unsigned sc, unsigned* a) {
    const unsigned slo = __byte_perm(sc, 0, 0x1010), shi = __byte_perm(sc, 0, 0x3232);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        unsigned v;
        asm("lop3.b32 %0, %1, 0x000f000f, 0x43004300, 0xea;" : "=r"(v) : "r"(q >> (4 * i)));
        asm("sub.rn.bf16x2 %0, %1, %2;" : "=r"(v) : "r"(v), "r"(0x43084308u));
        asm("fma.rn.bf16x2 %0, %1, %2, %3;"
            : "=r"(a[(i % 2) * 2 + i / 2]) : "r"(v), "r"(i < 2 ? slo : shi), "r"(0x80008000u));
    }
}

// d[0 .. N/2) += A (the 4 registers a) B (the descriptor b); acc 0: d = A B
template <int N>
__device__ __forceinline__ void wgmma(float (&d)[64], const unsigned* a, unsigned long long b, int acc);
template <>
__device__ __forceinline__ void wgmma<16>(float (&d)[64], const unsigned* a, unsigned long long b, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7"
                 "}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
}
template <>
__device__ __forceinline__ void wgmma<32>(float (&d)[64], const unsigned* a, unsigned long long b, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
                 "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
}
template <>
__device__ __forceinline__ void wgmma<48>(float (&d)[64], const unsigned* a, unsigned long long b, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23"
                 "}, {%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
}
template <>
__device__ __forceinline__ void wgmma<64>(float (&d)[64], const unsigned* a, unsigned long long b, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
                 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
}
template <>
__device__ __forceinline__ void wgmma<80>(float (&d)[64], const unsigned* a, unsigned long long b, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %45, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39"
                 "}, {%40, %41, %42, %43}, %44, p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                   "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
}
template <>
__device__ __forceinline__ void wgmma<96>(float (&d)[64], const unsigned* a, unsigned long long b, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
                 "}, {%48, %49, %50, %51}, %52, p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                   "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
                   "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
}
template <>
__device__ __forceinline__ void wgmma<112>(float (&d)[64], const unsigned* a, unsigned long long b, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %61, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n112k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55"
                 "}, {%56, %57, %58, %59}, %60, p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                   "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
                   "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
                   "+f"(d[54]), "+f"(d[55])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
}
template <>
__device__ __forceinline__ void wgmma<128>(float (&d)[64], const unsigned* a, unsigned long long b, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                 "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                   "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
                   "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
                   "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
                   "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
}

// the shared memory of a program: ring slots (token tile, words, scales), the epilogue's tiles, mbarriers
struct Smem {
    unsigned base;                               // shared-window address, 1024-aligned
    unsigned char* ptr;                          // the same as a generic pointer
    __device__ unsigned x(int slot) const { return base + slot * STAGE_B; }
    __device__ unsigned w(int slot) const { return base + slot * STAGE_B + XB; }
    __device__ unsigned s(int slot) const { return base + slot * STAGE_B + XB + WB; }
    __device__ float* xch() const { return (float*)(ptr + STAGES * STAGE_B); }
    __device__ unsigned short* stg(int wg) const {
        return (unsigned short*)(ptr + STAGES * STAGE_B + XCH_B + wg * STG_B);
    }
    __device__ int* slots(int wg) const { return (int*)(ptr + STAGES * STAGE_B + XCH_B + 2 * STG_B) + wg * 2 * CH; }
    __device__ float* wts(int wg) const { return (float*)(slots(wg) + CH); }
    __device__ unsigned full(int slot) const {
        return base + STAGES * STAGE_B + XCH_B + 2 * STG_B + 2 * CH * 8 + slot * 8;
    }
    __device__ unsigned empty(int slot) const { return full(slot) + STAGES * 8; }
};

// Marlin block of consumer warpgroup wg (0, 1) in item chunk c
template <bool W13>
__device__ __forceinline__ int block_of(int wg, int c) { return W13 ? wg * (I / 64) + c : 2 * c + wg; }

// what a producer thread reads of an item's block before its copies: the expert, the rows, and
// (w13) the tokens of its rows tid / 8 + 16 i (-1 past the rows); loaded an item ahead
template <bool W13>
struct Ahead {
    int e = 0, rows = 0, tok[W13 ? CH / 16 : 1];
    __device__ void load(int blk, const int* sorted, const int* block_expert, const int* block_rows) {
        e = block_expert[blk];
        rows = block_rows[blk];
        if constexpr (W13) {
#pragma unroll
            for (int i = 0; i < CH / 16; i++) {
                const int r = threadIdx.x / 8 + 16 * i;
                tok[i] = r < rows ? sorted[blk * CH + r] / TOPK : -1;
            }
        }
    }
};

template <bool W13>
__device__ void produce(const Smem& sm, const unsigned short* xin, const unsigned* w, const unsigned short* s,
                        const int* sorted, const int* block_expert, const int* block_rows, int total)
{
    constexpr int K = W13 ? H : I, N = W13 ? 2 * I : H, NST = K / KS, CHUNKS = W13 ? I / 64 : H / 128;
    const int tid = threadIdx.x;                 // 0..127
    const unsigned long long pol = evict_first();
    int q = 0;
    Ahead<W13> next;
    if ((int)blockIdx.x < total) next.load(blockIdx.x / CHUNKS, sorted, block_expert, block_rows);
    for (int item = blockIdx.x; item < total; item += gridDim.x) {
        const Ahead<W13> cur = next;
        const int blk = item / CHUNKS, c = item % CHUNKS, e = cur.e, rows = cur.rows;
        if (item + (int)gridDim.x < total) next.load((item + gridDim.x) / CHUNKS, sorted, block_expert, block_rows);
        const unsigned short* xrow[CH / 16];     // rows tid / 8 + 16 i, 16-byte chunk tid % 8
#pragma unroll
        for (int i = 0; i < CH / 16; i++) {
            const int r = tid / 8 + 16 * i;
            long row = -1;
            if constexpr (W13) row = cur.tok[i];
            else if (r < rows) row = (long)blk * CH + r;
            xrow[i] = row < 0 ? nullptr : xin + row * K + (tid % 8) * 8;
        }
        const unsigned* wsrc[2];                 // vectors v = tid, tid + 128: warpgroup v / 128, k16 step v / 32 % 4,
#pragma unroll                                  // vector v % 32
        for (int j = 0; j < 2; j++) {
            const int v = tid + 128 * j;
            wsrc[j] = w + (long)e * (K / 16) * (2 * N) + (v / 32 % 4) * (2 * N) + block_of<W13>(v / 128, c) * 128
                      + (v % 32) * 4;
        }
        const int sv = tid / 8 % NGS;            // scales: tid < 16 NGS; warpgroup tid / (8 NGS), group sv, vector tid % 8
        const unsigned short* ssrc = s + (long)e * (K / G) * N + block_of<W13>(tid / (8 * NGS), c) * 64 + (tid % 8) * 8;
        for (int st = 0; st < NST; st++, q++) {
            const int slot = q % STAGES;
            if (q >= STAGES) mbar_wait(sm.empty(slot), ((q / STAGES) & 1) ^ 1);
#pragma unroll
            for (int i = 0; i < CH / 16; i++) {
                const int r = tid / 8 + 16 * i;
                if (xrow[i]) cp_async16(sm.x(slot) + r * 128 + (((tid % 8) ^ (r % 8)) << 4), xrow[i] + st * KS);
            }
#pragma unroll
            for (int j = 0; j < 2; j++)
                cp16_ef(sm.w(slot) + (tid + 128 * j) * 16, wsrc[j] + (long)st * 4 * (2 * N), pol);
            if (tid < 16 * NGS) {
                const int grp = G == 32 ? 2 * st + sv : st * KS / G;
                cp16_ef(sm.s(slot) + tid * 16, ssrc + (long)grp * N, pol);
            }
            cp_arrive(sm.full(slot));
        }
    }
    cp_wait<0>();
}

// one stage of consumer warpgroup wg: wait for the slot, dequantize into a, issue the 4 products,
// wait for the stage before and free its slot
template <int NT>
__device__ __forceinline__ void consume_stage(const Smem& sm, float (&acc)[64], unsigned (&a)[16], int wg, int warp,
                                              int lane, int st, int q)
{
    const int slot = q % STAGES, g = lane / 4;
    mbar_wait(sm.full(slot), (q / STAGES) & 1);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // the cp.async rows, seen by wgmma's reads
    unsigned qw[4], sc[NGS];
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
        asm volatile("ld.shared.u32 %0, [%1];"
                     : "=r"(qw[kk]) : "r"(sm.w(slot) + ((wg * 4 + kk) * 128 + lane * 4 + warp) * 4));
#pragma unroll
    for (int gi = 0; gi < NGS; gi++)             // the pair of columns 16 warp + g, + 8: bf16 8g + 2 warp of the 64
        asm volatile("ld.shared.u32 %0, [%1];"
                     : "=r"(sc[gi]) : "r"(sm.s(slot) + (wg * NGS + gi) * 128 + (4 * g + warp) * 4));
#pragma unroll
    for (int kk = 0; kk < 4; kk++) dequant_a(qw[kk], sc[G == 32 ? kk / 2 : 0], a + 4 * kk);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; kk++) wgmma<NT>(acc, a + 4 * kk, desc_b(sm.x(slot) + kk * 32), st + kk > 0);
    wg_commit();
    wg_wait<1>();
    if (st > 0 && lane == 0) mbar_arrive(sm.empty((q + STAGES - 1) % STAGES));
}

template <bool W13, int NT>
__device__ __forceinline__ void consume_item(const Smem& sm, int wg, int warp, int lane, int& q,
                                             int blk, int c, int rows, const int* sorted, const float* topk_w,
                                             unsigned short* out)
{
    constexpr int NST = (W13 ? H : I) / KS;
    const int tw = warp * 32 + lane;
    int asg = 0;                                 // w2: row tw's slot and top-k weight, read now, used by the epilogue
    float wt = 0.f;
    if (!W13 && tw < rows) {
        asg = sorted[blk * CH + tw];
        wt = topk_w[asg];
    }
    float acc[64];                               // the first NT / 2 used; the first products overwrite them
    unsigned a0[16], a1[16];
    for (int st = 0; st < NST; st += 2, q += 2) {
        consume_stage<NT>(sm, acc, a0, wg, warp, lane, st, q);
        consume_stage<NT>(sm, acc, a1, wg, warp, lane, st + 1, q + 1);
    }
    wg_wait<0>();
    fence_regs<NT / 2>(acc);
    if (lane == 0) mbar_arrive(sm.empty((q + STAGES - 1) % STAGES));

    // ---- epilogue. Accumulator i of lane 4g + t in warp w: row 16 w + g + 8 (i / 2 % 2),
    // token 8 (i / 4) + 2 t + i % 2
    const int g = lane / 4, t = lane % 4;
    if constexpr (W13) {
        float* xch = sm.xch();
        if (wg == 1) {
#pragma unroll
            for (int i = 0; i < NT / 2; i++) xch[i * 128 + tw] = acc[i];
        }
        bar_sync(1, 256);
        if (wg == 0) {
            unsigned short* stg = sm.stg(0);
#pragma unroll
            for (int i = 0; i < NT / 2; i++)
                stg[(8 * (i / 4) + 2 * t + i % 2) * 64 + 16 * warp + g + 8 * (i / 2 % 2)] =
                    to_bf16(silu_mul(acc[i], xch[i * 128 + tw]));
            bar_sync(2, 128);
            for (int v = tw; v < rows * 8; v += 128)
                *(uint4*)(out + (long)(blk * CH + v / 8) * I + c * 64 + (v % 8) * 8) =
                    *(const uint4*)(stg + (v / 8) * 64 + (v % 8) * 8);
        }
        bar_sync(1, 256);                        // the exchange and output tiles are free again
    } else {
        int* slots = sm.slots(wg);
        float* wts = sm.wts(wg);
        unsigned short* stg = sm.stg(wg);
        if (tw < rows) {
            slots[tw] = asg;
            wts[tw] = wt;
        }
        bar_sync(2 + wg, 128);
#pragma unroll
        for (int i = 0; i < NT / 2; i++) {
            const int n = 8 * (i / 4) + 2 * t + i % 2;
            stg[n * 64 + 16 * warp + g + 8 * (i / 2 % 2)] = to_bf16(acc[i] * (n < rows ? wts[n] : 0.f));
        }
        bar_sync(2 + wg, 128);
        for (int v = tw; v < rows * 8; v += 128)
            *(uint4*)(out + (long)slots[v / 8] * H + c * 128 + wg * 64 + (v % 8) * 8) =
                *(const uint4*)(stg + (v / 8) * 64 + (v % 8) * 8);
        bar_sync(2 + wg, 128);
    }
}

template <bool W13>
__device__ void consume(const Smem& sm, const int* sorted, const int* block_rows, const float* topk_w,
                        unsigned short* out, int total)
{
    constexpr int CHUNKS = W13 ? I / 64 : H / 128;
    const int wg = threadIdx.x / 128 - 1, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
    int q = 0, rows_next = (int)blockIdx.x < total ? block_rows[blockIdx.x / CHUNKS] : 0;
    for (int item = blockIdx.x; item < total; item += gridDim.x) {
        const int blk = item / CHUNKS, c = item % CHUNKS, rows = rows_next;
        if (item + (int)gridDim.x < total) rows_next = block_rows[(item + gridDim.x) / CHUNKS];
        if (rows <= N1) consume_item<W13, N1>(sm, wg, warp, lane, q, blk, c, rows, sorted, topk_w, out);
        else if (rows <= N2) consume_item<W13, N2>(sm, wg, warp, lane, q, blk, c, rows, sorted, topk_w, out);
        else consume_item<W13, N3>(sm, wg, warp, lane, q, blk, c, rows, sorted, topk_w, out);
    }
}

template <bool W13>
__device__ __forceinline__ void run(const unsigned short* xin, const unsigned* w, const unsigned short* s,
                                    const int* sorted,
                                    const int* block_expert, const int* block_rows, const int* n_blocks,
                                    const float* topk_w, unsigned short* out, int pdl)
{
    extern __shared__ unsigned char smem_raw[];
    const unsigned raw = smem_addr(smem_raw), pad = (1024 - raw % 1024) % 1024;
    const Smem sm{raw + pad, smem_raw + pad};
    if (threadIdx.x == 0) {
        for (int i = 0; i < STAGES; i++) {
            mbar_init(sm.full(i), 128);
            mbar_init(sm.empty(i), 8);
        }
    }
    __syncthreads();
    pdl_enter(pdl);
    const int total = *n_blocks * (W13 ? I / 64 : H / 128);
    if (threadIdx.x < 128) produce<W13>(sm, xin, w, s, sorted, block_expert, block_rows, total);
    else consume<W13>(sm, sorted, block_rows, topk_w, out, total);
}

extern "C" __global__ void __launch_bounds__(384, 1)
wg_w13(const unsigned short* x, const unsigned* w, const unsigned short* s,   // x bf16 [T, H]; Marlin [E, H/16, 4I], [E, H/G, 2I]
       const int* sorted, const int* block_expert, const int* block_rows, const int* n_blocks,
       unsigned short* act,                                                     // bf16 [rows, I]
       int pdl)
{
    run<true>(x, w, s, sorted, block_expert, block_rows, n_blocks, nullptr, act, pdl);
}

extern "C" __global__ void __launch_bounds__(384, 1)
wg_w2(const unsigned short* act, const unsigned* w, const unsigned short* s,  // act bf16 [rows, I]; Marlin [E, I/16, 2H], [E, I/G, H]
      const int* sorted, const int* block_expert, const int* block_rows, const int* n_blocks,
      const float* topk_w,                                                      // fp32 [T*k]
      unsigned short* ypart,                                                    // bf16 [T*k, H]: each slot's weighted row
      int pdl)
{
    run<false>(act, w, s, sorted, block_expert, block_rows, n_blocks, topk_w, ypart, pdl);
}
