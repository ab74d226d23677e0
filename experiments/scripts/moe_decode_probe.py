"""Where the one-token MoE kernel's time goes (kernels/moe_decode.cu, one launch): the product
kernel and variants of its source with one part removed, timed at the K2.6 TP-8 shard (one
token, uniform routing), 20 launches a CUDA graph, PDL on and off. Variants (text patches of a
copy of the source, compiled beside it on the device):
  nomath     no dequantization and no mma in the w13 role (each word added as a float)
  noload     the w13 role's weight words not copied (scales, x, maths and the waits stay)
  w2noload   the w2 role's words not copied
  bare       nomath + noload + w2noload: launch, PDL wait, scales, x, tickets and the wait
and KS = 2 (K splits a unit; more would need more programs than SMs). CSV to argv[1].
    python3 -m experiments.scripts.moe_decode_probe OUT.csv
"""
from __future__ import annotations

import csv
import functools
import sys
from pathlib import Path

import torch

from ddbench.kernels import moe_decode as md
from ddbench.kernels.cuda import Kernel
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


def variant_source(name: str) -> str:
    text = SRC.read_text()
    for old, new in PATCHES.get(name, []):
        assert old in text, old
        text = text.replace(old, new, 1)
    path = SRC.with_name(f"_probe_{name}.cu")
    path.write_text(text)
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


def main(out: str) -> None:
    dev = torch.device("cuda")
    w = random_marlin_moe(384, 7168, 256, 32, top_k=8, device=dev, seed=1)
    x = torch.randn(1, 7168, device=dev).bfloat16()
    ids, tw = synthetic_routing("uniform", 1, 384, 8, device=dev, seed=1)
    ref = md.fused_moe_decode(x, ids, tw, w)
    rows, orig, ks0 = [], md._kernel, md.KS
    for name, ks in [("product", ks0), ("nomath", ks0), ("noload", ks0), ("w2noload", ks0), ("bare", ks0),
                     ("ks2", 2)]:
        src = variant_source(name) if name in PATCHES else "moe_decode.cu"
        md.KS = ks
        md._kernel = functools.lru_cache(maxsize=None)(
            lambda h, i, g, d, _src=src, _ks=ks: Kernel(_src, "decode_moe", {"H": h, "I": i, "G": g, "KS": _ks}, d))
        try:
            us = time_us(lambda: md.fused_moe_decode(x, ids, tw, w, pdl_mode=2))
            us_off = time_us(lambda: md.fused_moe_decode(x, ids, tw, w, pdl_mode=0))
            same = bool(torch.equal(md.fused_moe_decode(x, ids, tw, w), ref))
        finally:
            md._kernel, md.KS = orig, ks0
        rows.append(dict(variant=name, ks=ks, programs=md.programs(8, w), layer_us_pdl=round(us, 2),
                         layer_us_nopdl=round(us_off, 2), equal_to_product=same))
        print(rows[-1], flush=True)
    with open(out, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)


if __name__ == "__main__":
    main(sys.argv[1])
