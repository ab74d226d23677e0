"""Where the one-token MoE kernel's time goes (kernels/moe_decode.cu, one launch): the product
kernel and variants of its source with one part removed, timed at the K2.6 TP-8 shard (one
token, uniform routing), 20 launches a CUDA graph, PDL on and off. Variants (text patches of a
copy of the source, compiled beside it on the device):
  nomath     no dequantization and no mma in the w13 role (each word added as a float)
  noload     the w13 role's weight words not copied (scales, x, maths and the waits stay)
  w2noload   the w2 role's words not copied
  bare       nomath + noload + w2noload: launch, PDL wait, scales, x, tickets and the wait
  cluster    a unit's KS splits one cluster: they sum their partials through distributed shared
             memory, each computes KS-th of the unit's fp16 act row into global memory, so the
             w2 role reads 4 KB of act rows after its wait instead of every split's fp32 sums
             (64 KB); run only where every cluster of the grid can be resident at once
  ring6, ring7  w13 rings of 6 / 7 stages a warp (7 = a warp's whole share at K2.6 TP-8: every
             w13 byte in flight from the start, no refill round)
  sum2       the w2 role's split sum with both of a thread's passes' L2 loads issued before
             either's maths (one L2 round trip after the wait instead of two)
  fast       ring7 + sum2
  w2late     the w2 role's words and scales issued after the program's w13 role (its stream,
             split store and count) instead of before it: the w13 stream, the critical path,
             has the SM's bandwidth alone (the w2 copy was the oldest cp.async group, so the
             ring's first wait waited for all 64 KB of it) and the w2 copy overlaps the wait
             for the other programs' units
  late_sum2  w2late + sum2
and KS = 2 (K splits a unit; more would need more programs than SMs). CSV to argv[1].
    python3 -m experiments.scripts.moe_decode_probe OUT.csv [VARIANT,...]
"""
from __future__ import annotations

import csv
import functools
import sys
from pathlib import Path

import torch

from ddbench.kernels import moe_decode as md
from ddbench.kernels.cuda import Kernel, occupancy
from ddbench.kernels.moe import random_marlin_moe, synthetic_routing

SRC = Path(md.__file__).with_name("moe_decode.cu")
PATCHES = {
    "nomath": [("dequant_f16(wq[tile], a);", ""),
               ("mma_f16(c[tile], a, xs[kx], xs[kx + 4]);", "c[tile][0] += __uint_as_float(wq[tile]);")],
    "noload": [("cp16_ef(smem_addr(st + (kk * 2) * 32 + lane), row + p * 128, pol);", ""),
               ("cp16_ef(smem_addr(st + (kk * 2 + 1) * 32 + lane), row + (P13 + p) * 128, pol);", "")],
    "w2noload": [("for (int i = threadIdx.x; i < n * KTI * 32; i += THREADS) {",
                  "for (int i = threadIdx.x; i < 0; i += THREADS) {")],
}
PATCHES["bare"] = PATCHES["nomath"] + PATCHES["noload"] + PATCHES["w2noload"]
RING = "#define STAGES13 (G <= 64 ? 4 : 2)"
PATCHES["ring6"] = [(RING, "#define STAGES13 6")]
PATCHES["ring7"] = [(RING, "#define STAGES13 7")]
SUM_LOOP = """    for (int i = threadIdx.x; i < n * I / 4; i += THREADS) {      // 4 act columns a step: sum the splits in order
        const int unit = i / 16, c = 4 * (i % 16), j = unit / P13;
        const float* up = part + (long)unit * KS * 128 + c;
        float4 gs = make_float4(0.f, 0.f, 0.f, 0.f), us = gs;
#pragma unroll
        for (int r = 0; r < KS; r++) {
            const float4 gv = ld_f32x4(up + r * 128), uv = ld_f32x4(up + r * 128 + 64);
"""
PATCHES["sum2"] = [(SUM_LOOP, """    float4 pv[2][2 * KS];                                         // both passes' loads first
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int i = threadIdx.x + h * THREADS;
        if (i < n * I / 4) {
            const float* up = part + (long)(i / 16) * KS * 128 + 4 * (i % 16);
#pragma unroll
            for (int r = 0; r < KS; r++) {
                pv[h][2 * r] = ld_f32x4(up + r * 128);
                pv[h][2 * r + 1] = ld_f32x4(up + r * 128 + 64);
            }
        }
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int i = threadIdx.x + h * THREADS;
        if (i >= n * I / 4) continue;
        const int unit = i / 16, c = 4 * (i % 16), j = unit / P13;
        float4 gs = make_float4(0.f, 0.f, 0.f, 0.f), us = gs;
#pragma unroll
        for (int r = 0; r < KS; r++) {
            const float4 gv = pv[h][2 * r], uv = pv[h][2 * r + 1];
""")]
PATCHES["fast"] = PATCHES["ring7"] + PATCHES["sum2"]
PATCHES["w2late"] = [   # the copy block becomes a lambda, called after the w13 role where the program has one
    ("    if (has2) {\n        for (int i = threadIdx.x; i < n * KTI * 32; i += THREADS) {\n",
     "    auto w2_copy = [&]() {                                     // the w2 role's words and scales\n"
     "        for (int i = threadIdx.x; i < n * KTI * 32; i += THREADS) {\n"),
    ("        cp_commit();\n    }\n    if (has13) {\n",
     "        cp_commit();\n    };\n    if (has2 && !has13) w2_copy();\n    if (has13) {\n"),
    ("    if (!has2) return;\n", "    if (!has2) return;\n    if (has13) w2_copy();\n"),
]
PATCHES["late_sum2"] = PATCHES["w2late"] + PATCHES["sum2"]
STAGES = {"ring6": 6, "ring7": 7, "fast": 7}          # variants' w13 ring stages (shared memory)
PATCHES["cluster"] = [
    ('extern "C" __global__ void __launch_bounds__(THREADS, 1)\ndecode_moe(',
     """__device__ __forceinline__ float2 cl_ld2(const float* p, int rank) {   // another program's shared memory
    unsigned a;
    float2 v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_addr(p)), "r"(rank));
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(a) : "memory");
    return v;
}
extern "C" __global__ void __cluster_dims__(KS, 1, 1) __launch_bounds__(THREADS, 1)
decode_moe("""),
    ("""        if (threadIdx.x < 128) part[((long)unit * KS + sp) * 128 + threadIdx.x] = sh.part[threadIdx.x];
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(done, 1);
    }""",
     """        asm volatile("barrier.cluster.arrive.release.aligned;\\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
        if (threadIdx.x < 32 / KS) {                               // act columns c, c + 1 of the unit, splits in order
            const int c = 2 * (sp * (32 / KS) + threadIdx.x);
            float g0 = 0.f, g1 = 0.f, u0 = 0.f, u1 = 0.f;
            for (int r = 0; r < KS; r++) {
                const float2 gv = cl_ld2(&sh.part[c], r), uv = cl_ld2(&sh.part[64 + c], r);
                g0 += gv.x; g1 += gv.y; u0 += uv.x; u1 += uv.y;
            }
            const float wt = topk_w[unit / P13];
            reinterpret_cast<unsigned*>(part)[unit * 32 + c / 2] =
                (unsigned)to_f16(silu_mul(g0, u0) * wt) | (unsigned)to_f16(silu_mul(g1, u1) * wt) << 16;
        }
        asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");   // done with the others' sh.part
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(done, 1);
        asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
    }"""),
    ("""    for (int i = threadIdx.x; i < n * I / 4; i += THREADS) {      // 4 act columns a step: sum the splits in order""",
     """    for (int i = threadIdx.x; i < n * I / 8; i += THREADS)        // the act rows, fp16, 16 bytes a step
        reinterpret_cast<uint4*>(&sh.acts[0][0])[i] = ld_v4(reinterpret_cast<const uint4*>(part) + i);
    for (int i = threadIdx.x; i < 0; i += THREADS) {"""),
]


def patched(name: str) -> str:
    """The kernel's source with variant `name`'s patches."""
    text = SRC.read_text()
    for old, new in PATCHES.get(name, []):
        assert old in text, old
        text = text.replace(old, new, 1)
    return text


def variant_source(name: str) -> str:
    """Variant `name` written beside the kernel (kernels/_probe_<name>.cu); its file name."""
    path = SRC.with_name(f"_probe_{name}.cu")
    path.write_text(patched(name))
    return path.name


def time_us(fn, calls: int = 20, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    return best


def clusters_resident(kernel: Kernel, grid: int, shared: int) -> int:
    """Clusters of `kernel` (compiled cluster size) the GPU holds at once at this launch shape
    (cuOccupancyMaxActiveClusters)."""
    import ctypes

    from ddbench.kernels import cuda

    occupancy(kernel, md.THREADS, shared)                        # sets the kernel's dynamic shared memory
    cfg = cuda._Config((grid, 1, 1), (md.THREADS, 1, 1), shared, None, None, 0)
    n = ctypes.c_int()
    cuda._check(cuda._driver().cuOccupancyMaxActiveClusters(ctypes.byref(n), kernel.fn, ctypes.byref(cfg)),
                "cuOccupancyMaxActiveClusters")
    return n.value


def main(out: str, names: str = "product,nomath,noload,w2noload,bare,ks2,cluster") -> None:
    dev = torch.device("cuda")
    w = random_marlin_moe(384, 7168, 256, 32, top_k=8, device=dev, seed=1)
    x = torch.randn(1, 7168, device=dev).bfloat16()
    ids, tw = synthetic_routing("uniform", 1, 384, 8, device=dev, seed=1)
    ref = md.fused_moe_decode(x, ids, tw, w)
    rows, orig, ks0, orig_shared = [], md._kernel, md.KS, md.shared_bytes
    for name in names.split(","):
        ks = 2 if name == "ks2" else ks0
        src = variant_source(name) if name in PATCHES else "moe_decode.cu"
        if name == "cluster":
            k = Kernel(src, "decode_moe", {"H": w.hidden, "I": w.inter, "G": w.group_size, "KS": ks}, dev)
            grid = md.programs(ids.numel(), w)
            have, need = clusters_resident(k, grid, md.shared_bytes(w.hidden, w.inter, w.group_size)), grid // ks
            print(f"cluster: {have} clusters of {ks} resident at once, the grid has {need}", flush=True)
            if have < need:
                continue
        md.KS = ks
        md._kernel = functools.lru_cache(maxsize=None)(
            lambda h, i, g, d, _src=src, _ks=ks: Kernel(_src, "decode_moe", {"H": h, "I": i, "G": g, "KS": _ks}, d))
        if name in STAGES:                                 # the variant's deeper w13 ring
            md.shared_bytes = lambda h, i, g, _s=STAGES[name]: orig_shared(h, i, g, stages=_s)
        try:
            us = time_us(lambda: md.fused_moe_decode(x, ids, tw, w, pdl_mode=2))
            us_off = time_us(lambda: md.fused_moe_decode(x, ids, tw, w, pdl_mode=0))
            same = bool(torch.equal(md.fused_moe_decode(x, ids, tw, w), ref))
        finally:
            md._kernel, md.KS, md.shared_bytes = orig, ks0, orig_shared
        rows.append(dict(variant=name, ks=ks, programs=md.programs(8, w), layer_us_pdl=round(us, 2),
                         layer_us_nopdl=round(us_off, 2), equal_to_product=same))
        print(rows[-1], flush=True)
    with open(out, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)


if __name__ == "__main__":
    main(*sys.argv[1:3])
