"""experiments/moe_wgmma.cu against the product's MoE at the K2.6 TP-8 rank shard (E=384, H=7168,
I=256, group 32, top-8), uniform routing, at the c = 10 DDTree verify sizes (T = 90 and 170 at
budgets 8 and 16) up to prefill sizes: whole layer, w13 alone and w2 + k sum alone, us (CUDA
graph of ROT calls over rotated inputs, best of 2 rounds, the product and the stage counts
alternated), relative error against the fp32 reference, bitwise run to run, and the layer's
share of the measured bf16 GEMM rate. The product runs its rule's kernel (`kernel` column);
its parts are timed where that kernel is moe_wide.

    python3 -m experiments.scripts.moe_wgmma_check OUT.csv [T,T,...] [STAGES:N1-N2-N3,...]

A variant `8:16-32-48` runs 8 stages with blocks of 48 rows and wgmma N 16, 32 or 48 (run at T <=
512 only: up to 11 tokens an expert); the default sizes are experiments.moe_wgmma.SIZES.
"""
from __future__ import annotations

import csv
import sys

import torch

from ddbench import timing
from ddbench.kernels import moe_marlin as mm
from ddbench.kernels import moe_wide as mw
from ddbench.kernels.moe import fused_moe, fused_moe_ref, random_marlin_moe, resolve_moe_kernel
from experiments import moe_wgmma as mg
from experiments.cuda import resources
from experiments.scripts.moe_marlin_variants import E, G, H, I, K, rotated_inputs

ROT = 4


def flops(tokens: int) -> float:
    """Useful FLOPs of the layer: T k (2I H (w13) + H I (w2)) multiply-adds."""
    return 2.0 * tokens * K * (2 * I * H + H * I)


def _time(fn, dev) -> float:
    return timing.bench(fn, device=dev, warmup=2, reps=20, graph=True, graph_ops=ROT).median_us


def parse(spec: str) -> tuple[int, tuple]:
    """'8:16-32-48' -> (8, (16, 32, 48)); '4' -> (4, SIZES)."""
    stages, _, sizes = spec.partition(":")
    return int(stages), tuple(int(n) for n in sizes.split("-")) if sizes else mg.SIZES


def main(out: str, tokens: str = "4096,512,96,170,1024,2048,256", specs: str = "4,6,8:16-32-48,12:16-32-48",
         device: str = "cuda") -> None:
    dev = torch.device(device)
    w = random_marlin_moe(E, H, I, G, K, device=dev, seed=0)
    tflops, copy_gbps = timing.gemm_tflops(dev), timing.copy_bandwidth_gbps(dev)
    per_expert = sum(p[0].numel() * p.element_size() for p in (w.w13, w.w13_scale, w.w2, w.w2_scale))
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    rows, shown = [], set()
    for t in (int(v) for v in tokens.split(",")):
        xs, routes = rotated_inputs(t, ROT, dev)
        ref = fused_moe_ref(xs[0].float(), *routes[0], w).float()
        floor_us = (routes[0][0].unique().numel() * per_expert + 2 * t * H * 2) / (copy_gbps * 1e3)
        kernel, tiles = resolve_moe_kernel(t, K, w, dev)
        it = iter(range(10**9))

        def rot(f):
            """f(r) on input r of the rotation, the next one each call"""
            return lambda: f(next(it) % ROT)

        def product(r):
            return fused_moe(xs[r], *routes[r], w, "triton")

        variants = {"product": (product, None)}                     # name: (layer(r), (w13(r), w2(r)) or None)
        if kernel == "wide":
            wroute = [mm.plan(ids, E, 16 * tiles["mt"]) for ids, _ in routes]
            acts = [mw.wide_w13(xs[r], wroute[r], K, w, tiles) for r in range(ROT)]
            variants["product"] = (product, (lambda r: mw.wide_w13(xs[r], wroute[r], K, w, tiles),
                                             lambda r: mw.wide_w2(acts[r], wroute[r], routes[r][1], w, tiles)))
        for spec in specs.split(","):
            s, sz = parse(spec)
            if sz[-1] < 64 and t > 512:                             # small blocks: verify sizes only
                continue
            gr = [mm.plan(ids, E, sz[-1]) for ids, _ in routes]
            gacts = [mg.wg_w13(xs[r], gr[r], K, w, s, sz) for r in range(ROT)]
            if spec not in shown:                                   # the device's compile of the build, once
                shown.add(spec)
                for kname in ("wg_w13", "wg_w2"):
                    print(spec, kname, resources(mg._kernel(kname, s, sz, G, H, I, K, dev)), flush=True)
            variants[f"wgmma_{spec}"] = (lambda r, s=s, sz=sz: mg.fused_moe_wgmma(xs[r], *routes[r], w, s, sz),
                                         (lambda r, s=s, sz=sz, gr=gr: mg.wg_w13(xs[r], gr[r], K, w, s, sz),
                                          lambda r, s=s, sz=sz, gr=gr, a=gacts: mg.wg_w2(a[r], gr[r], routes[r][1], w,
                                                                                          s, sz)))
        for rep in range(2):
            for name, (layer, parts) in variants.items():
                y = layer(0)
                us = _time(rot(layer), dev)
                w13_us, w2_us = (_time(rot(parts[0]), dev), _time(rot(parts[1]), dev)) if parts else (None, None)
                rows.append(dict(tokens=t, variant=name, rep=rep,
                                 kernel=(f"{kernel} {mw.tile_name(tiles) if kernel == 'wide' else tiles}"
                                         if name == "product" else "wgmma"),
                                 layer_us=round(us, 1), w13_us=w13_us and round(w13_us, 1),
                                 w2_ksum_us=w2_us and round(w2_us, 1),
                                 pct_copy=round(100 * floor_us / us, 1),
                                 pct_gemm=round(100 * flops(t) / (us * 1e-6) / (tflops * 1e12), 1),
                                 rel_err=f"{((y.float() - ref).norm() / ref.norm()).item():.2e}",
                                 bitwise_repeat=bool(torch.equal(y, layer(0))), gpu=gpu,
                                 gemm_tflops=round(tflops, 1), copy_gbps=round(copy_gbps)))
                print(rows[-1], flush=True)
                with open(out, "w", newline="") as f:                  # after every row: a cut run keeps its rows
                    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                    writer.writeheader()
                    writer.writerows(rows)
    names = list(dict.fromkeys(r["variant"] for r in rows))
    print(f"\nlayer us (w13 / w2 + k sum) % of copy, % of GEMM, best of 2; GEMM {tflops:.0f} TFLOP/s, copy "
          f"{copy_gbps:.0f} GB/s\nT  " + "  ".join(names))
    for t in sorted({r["tokens"] for r in rows}):
        cells = []
        for n in names:
            best = min((r for r in rows if r["tokens"] == t and r["variant"] == n), key=lambda r: r["layer_us"])
            cells.append(f"{best['layer_us']} ({best['w13_us']} / {best['w2_ksum_us']}) {best['pct_copy']}% "
                         f"{best['pct_gemm']}%"
                         f" err {best['rel_err']}{'' if best['bitwise_repeat'] else ' NOT BITWISE'}")
        print(t, *cells, sep="  |  ")


if __name__ == "__main__":
    main(*sys.argv[1:4])
