"""Source variants of the CUDA Marlin MoE (kernels/moe_marlin.cu) against the product kernel, at
the K2.6 TP-8 rank shard (E=384, H=7168, I=256, group 32, top-8), uniform routing, the product's
tiles at each T: whole layer us (CUDA graph of ROT calls over rotated inputs, product and variants
alternated twice) and whether a variant's output is bitwise the product's. A variant is a text
patch of a copy of the source, compiled beside it (kernels/_probe_marlin_<name>.cu):

  addr  the stage loop (`stream`) copies from running sources and ring slots (a stage's 64-bit
        address arithmetic, its modulo by STAGES and the rematerialised generic -> shared
        conversion of the ring pointer gone) and reads the ring by 32-bit shared address
        (`lds128`). Same products in the same order, so bitwise equal. SASS a stage (nvcc 13.0,
        sm_90), NG 2, 5 stages: w13 437 -> 380 (two groups valid) / 331 -> 307 (one), w2 373 -> 353
        / 314 -> 299; NG 1: w13 347 -> 324.
  f16   x and the act rows in fp16, the weights dequantized to fp16 (`dequant_f16`: one shift a
        word instead of three, the fp16 mantissa holding a nibble at bits 4-7) and fp16 mma; the
        output stays bf16. Needs the caller's x in fp16 (the engine's gate GEMM can write it:
        `out_xh`). Not bitwise the product's: checked against the fp32 reference.
  addr_f16  both. SASS a stage, NG 2, 5 stages: w13 437 -> 352 / 331 -> 278, w2 373 -> 323 /
        314 -> 268; NG 1: w13 347 -> 292.
  (addr, f16, addr_f16 ran on an H100 on 2026-12-07: docs/notes/moe.md "Tried and dropped".)
  (Variants ring2 / xring / xring_f / ksum / xring_ksum of moe_w2 and sk of moe_w13 (stream-K)
  ran on an H100 on 2026-12-08 from commit 186e70e; the k sum apart and stream-K are built as
  experiments/pending/moe_ksum_sk.patch.)

    python3 -m experiments.scripts.moe_marlin_variants OUT.csv [T,T,...] [variant,...]
"""
from __future__ import annotations

import csv
import functools
import sys
from pathlib import Path

import torch

from ddbench import timing
from ddbench.kernels import moe_marlin as mm
from ddbench.kernels.cuda import Kernel
from ddbench.kernels.moe import fused_moe_ref, random_marlin_moe, synthetic_routing

SRC = Path(mm.__file__).with_name("moe_marlin.cu")
STREAM_HEAD = "template <int KDIM, int NDIM, int NBLK, int NV>\n__device__ __forceinline__ void stream("
LDS128 = """__device__ __forceinline__ uint4 lds128(unsigned addr) {   // 16 bytes at a shared-window address
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}
"""
ADDR_ISSUE = """    const unsigned short* xsrc[NV];
#pragma unroll
    for (int ng = 0; ng < NV; ng++) xsrc[ng] = xrow[ng] + 32 * st0 + 8 * t;
    constexpr unsigned STAGE_B = STAGE_V(NBLK) * 16;          // bytes a ring stage
    int next = st0, put_at = 0;                             // the stage the next issue copies, its ring slot
    unsigned put = base;                                    // = base + put_at stages
    auto issue = [&]() {
        if (next < st1) {
#pragma unroll
            for (int j = 0; j < NBLK; j++) {
                cp16_ef(put + (64 * j + lane) * 16, wsrc + j * nb_step * 128, pol);
                cp16_ef(put + (64 * j + 32 + lane) * 16, wsrc + j * nb_step * 128 + 2 * NDIM, pol);
            }
            if (copies_scale) cp_async16(put + (WVEC(NBLK) + lane) * 16, sl + (long)(next * 32 / G) * NDIM);
#pragma unroll
            for (int ng = 0; ng < NV; ng++) {
                cp16z(put + XVEC(NBLK, ng) * 16 + xput, xsrc[ng], xval[ng]);
                xsrc[ng] += 32;
            }
            wsrc += 4 * NDIM;
        }
        cp_commit();
        next++;
        put = ++put_at == STAGES ? put - (STAGES - 1) * STAGE_B : put + STAGE_B;
        put_at = put_at == STAGES ? 0 : put_at;
    };
"""
# (old, new) pairs; each old occurs once in the stage loop `stream` of today's source
ADDR = [
    (STREAM_HEAD, LDS128 + STREAM_HEAD),
    ("    const unsigned* wl = w + (long)e * (KDIM / 16) * (2 * NDIM) + lane * 4;\n",
     "    const unsigned* wsrc = w + (long)e * (KDIM / 16) * (2 * NDIM) + (long)(2 * st0) * (2 * NDIM) + nb0 * 128 + lane * 4;\n"),
    ("    for (int i = 0; i < STAGES - 1; i++) issue(st0 + i);\n",
     "    for (int i = 0; i < STAGES - 1; i++) issue();\n"
     "    int slot_at = 0;                                        // stage st's ring slot\n"
     "    unsigned slot = base;                                   // = base + slot_at stages\n"),
    ("        issue(st + STAGES - 1);                             // into stage st - 1's slot\n"
     "        const unsigned slot = base + (st % STAGES) * STAGE_V(NBLK) * 16;\n"
     "        const uint4* vec = ring + (st % STAGES) * STAGE_V(NBLK);\n",
     "        issue();                                            // stage st + STAGES - 1 into stage st - 1's slot\n"),
    ("const uint4 w0 = vec[64 * j + lane], w1 = vec[64 * j + 32 + lane], sc = vec[WVEC(NBLK) + 8 * j + g];",
     "const uint4 w0 = lds128(slot + (64 * j + lane) * 16), w1 = lds128(slot + (64 * j + 32 + lane) * 16),\n"
     "                        sc = lds128(slot + (WVEC(NBLK) + 8 * j + g) * 16);"),
    ("    }\n    cp_wait<0>();\n",
     "        slot = ++slot_at == STAGES ? slot - (STAGES - 1) * STAGE_B : slot + STAGE_B;\n"
     "        slot_at = slot_at == STAGES ? 0 : slot_at;\n    }\n    cp_wait<0>();\n"),
]
ROT = 10
E, H, I, G, K = 384, 7168, 256, 32, 8


def replace_between(text: str, start: str, end: str, new: str) -> str:
    """text with the span from the first `start` to the end of the first `end` after it replaced."""
    i = text.index(start)
    j = text.index(end, i) + len(end)
    return text[:i] + new + text[j:]


F16 = [("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"),
       ("dequant(wq0[tile], a0);", "dequant_f16(wq0[tile], a0);"),
       ("dequant(wq1[tile], a1);", "dequant_f16(wq1[tile], a1);"),
       ("= to_bf16(silu_mul(acc[0][f][ng][i], acc[1][f][ng][i]));",
        "= to_f16(silu_mul(acc[0][f][ng][i], acc[1][f][ng][i]));"),
       ("= bf16x2(silu_mul(gs.x, us.x), silu_mul(gs.y, us.y));",
        "= (unsigned)to_f16(silu_mul(gs.x, us.x)) | (unsigned)to_f16(silu_mul(gs.y, us.y)) << 16;")]


def replace_all(text: str, pairs: list[tuple[str, str]]) -> str:
    """text with each (old, new) replaced; each old must occur exactly once."""
    for old, new in pairs:
        if text.count(old) != 1:
            raise ValueError(f"patch text found {text.count(old)} times, not once: {old[:80]!r}")
        text = text.replace(old, new)
    return text


def addr(text: str) -> str:
    text = replace_between(text, "    auto issue = [&](int st) {\n", "        cp_commit();\n    };\n", ADDR_ISSUE)
    return replace_all(text, ADDR)


# name -> (patch of the source text, dtype of x the variant takes)
VARIANTS = {"addr": (addr, torch.bfloat16),
            "f16": (lambda text: replace_all(text, F16), torch.float16),
            "addr_f16": (lambda text: replace_all(addr(text), F16), torch.float16)}


def variant_source(name: str) -> str:
    """Variant `name` written beside the kernel; its file name."""
    path = SRC.with_name(f"_probe_marlin_{name}.cu")
    path.write_text(VARIANTS[name][0](SRC.read_text()))
    return path.name


@functools.lru_cache(maxsize=None)
def _launcher(src: str):
    """kernels.moe_marlin._kernel's signature, compiling source file `src` (kernels/ folder)."""
    @functools.lru_cache(maxsize=None)
    def kernel(name, ng, stages, warps, group, hidden, inter, top_k, device, w2b=2):
        return Kernel(src, name, {"NG": ng, "STAGES": stages, "WARPS": warps, "G": group, "H": hidden,
                                  "I": inter, "TOPK": top_k, "W2B": w2b}, device)
    return kernel


def use_source(src: str) -> None:
    """Point kernels.moe_marlin's launches at source file `src`."""
    mm._kernel = _launcher(src)
    mm._grid.cache_clear()


def run(x: torch.Tensor, route: tuple, w, tiles: dict) -> torch.Tensor:
    """kernels.moe_marlin's three launches (fused_moe_marlin without its bf16 check, so a variant
    may take fp16 x)."""
    routing = mm.plan(route[0], w.n_experts, 8 * tiles["ng"])
    return mm.marlin_w2(mm.marlin_w13(x, routing, route[0].shape[1], w, tiles), routing, route[1], w, tiles)


def rotated_inputs(tokens: int, rot: int, dev: torch.device) -> tuple[list, list]:
    """`rot` inputs of `tokens` at the K2.6 TP-8 shard: x bf16 `[T, H]` and uniform top-K routings."""
    xs, routes = [], []
    for r in range(rot):
        g = torch.Generator(device=dev).manual_seed(tokens * 31 + r)
        xs.append(torch.randn(tokens, H, generator=g, device=dev).bfloat16())
        routes.append(synthetic_routing("uniform", tokens, E, K, device=dev, seed=tokens * 31 + r))
    return xs, routes


def main(out: str, tokens: str = "8,16,32,64,96,128,256,512", names: str = "addr,f16,addr_f16") -> None:
    dev = torch.device("cuda")
    w = random_marlin_moe(E, H, I, G, K, device=dev, seed=0)
    product = mm._kernel
    srcs = {"product": ("moe_marlin.cu", torch.bfloat16)} | {n: (variant_source(n), VARIANTS[n][1]) for n in names.split(",")}
    rows = []
    try:
        for t in (int(v) for v in tokens.split(",")):
            xs, routes = rotated_inputs(t, ROT, dev)
            ref = fused_moe_ref(xs[0].float(), *routes[0], w).float()
            tiles = mm.resolve_tiles(t, K, w, dev)
            outs = {}
            for rep in range(2):
                for name, (src, dtype) in srcs.items():
                    use_source(src)
                    xv = [x.to(dtype) for x in xs]
                    it = iter(range(10**9))

                    def call():
                        r = next(it) % ROT
                        return run(xv[r], routes[r], w, tiles)
                    st = timing.bench(call, device=dev, warmup=2, reps=20, graph=True, graph_ops=ROT)
                    y = run(xv[0], routes[0], w, tiles)
                    outs.setdefault(name, y)
                    rows.append(dict(tokens=t, variant=name, rep=rep, tiles=mm.tile_name(tiles),
                                     layer_us=round(st.median_us, 2),
                                     rel_err=f"{((y.float() - ref).norm() / ref.norm()).item():.2e}",
                                     bitwise_repeat=bool(torch.equal(y, run(xv[0], routes[0], w, tiles))),
                                     equal_to_product=bool(torch.equal(y, outs["product"]))))
                    print(rows[-1], flush=True)
    finally:
        mm._kernel = product
        mm._grid.cache_clear()
        if rows:
            with open(out, "w", newline="") as f:
                wr = csv.DictWriter(f, fieldnames=list(rows[0]))
                wr.writeheader()
                wr.writerows(rows)
    print("\nlayer us, best of 2:  T  " + "  ".join(srcs))
    for t in sorted({r["tokens"] for r in rows}):
        print(t, *(min(r["layer_us"] for r in rows if r["tokens"] == t and r["variant"] == n) for n in srcs))


if __name__ == "__main__":
    main(*sys.argv[1:4])
