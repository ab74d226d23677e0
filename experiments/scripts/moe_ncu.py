"""The CUDA Marlin MoE (kernels/moe_marlin.cu) under Nsight Compute: what limits moe_plan, moe_w13
and moe_w2 at each token count (K2.6 TP-8 rank shard, uniform routing, the default tiles).

python3 -m experiments.scripts.moe_ncu run T,T,...: for each T (in order) two eager calls, then
one between cudaProfilerStart/Stop without PDL (each kernel's time is its own), so the profiled
kernels come as (plan, w13, w2) per T. Run under `ncu --profile-from-start off --page raw --csv`
and summarized by `experiments.scripts.decode_ncu summary`: `bash experiments/scripts/ncu.sh moe
experiments.scripts.moe_ncu run 1,8,128,512,4096`. `... moe_ncu decode`: the one-token kernels
(kernels/moe_decode.cu: decode_moe) the same way. `... moe_ncu wide 4096`: moe_wide's kernels.
"""
import sys

import torch

from ddbench.kernels import moe_marlin as mm
from ddbench.kernels.moe import random_marlin_moe, synthetic_routing

E, H, I, G, K = 384, 7168, 256, 32, 8


def run(tokens: list[int]) -> None:
    dev = torch.device("cuda")
    w = random_marlin_moe(E, H, I, G, K, device=dev, seed=0)
    for t in tokens:
        x = torch.randn(t, H, generator=torch.Generator(device=dev).manual_seed(t), device=dev).bfloat16()
        ids, tw = synthetic_routing("uniform", t, E, K, device=dev, seed=t)
        tiles = mm.resolve_tiles(t, K, w, dev)
        print(f"T={t} tiles {tiles}", flush=True)
        for _ in range(2):
            mm.fused_moe_marlin(x, ids, tw, w, tiles, pdl_mode=0)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        mm.fused_moe_marlin(x, ids, tw, w, tiles, pdl_mode=0)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def decode() -> None:
    from ddbench.kernels import moe_decode as md

    dev = torch.device("cuda")
    w = random_marlin_moe(E, H, I, G, K, device=dev, seed=0)
    x = torch.randn(1, H, device=dev).bfloat16()
    ids, tw = synthetic_routing("uniform", 1, E, K, device=dev, seed=1)
    for _ in range(2):
        md.fused_moe_decode(x, ids, tw, w, pdl_mode=0)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    md.fused_moe_decode(x, ids, tw, w, pdl_mode=0)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def wide(tokens: list[int]) -> None:
    """moe_wide (kernels/moe_wide.cu) at its default tiles: kernels (plan, wide_w13, wide_w2, wide_ksum) per T."""
    from ddbench.kernels import moe_wide as mw

    dev = torch.device("cuda")
    w = random_marlin_moe(E, H, I, G, K, device=dev, seed=0)
    for t in tokens:
        x = torch.randn(t, H, generator=torch.Generator(device=dev).manual_seed(t), device=dev).bfloat16()
        ids, tw = synthetic_routing("uniform", t, E, K, device=dev, seed=t)
        tiles = mw.resolve_tiles(t, K, w)
        print(f"T={t} tiles {mw.tile_name(tiles)}", flush=True)
        for _ in range(2):
            mw.fused_moe_wide(x, ids, tw, w, tiles, pdl_mode=0)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        mw.fused_moe_wide(x, ids, tw, w, tiles, pdl_mode=0)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    if sys.argv[1] == "decode":
        decode()
    elif sys.argv[1] == "wide":
        wide([int(t) for t in sys.argv[2].split(",")])
    else:
        run([int(t) for t in sys.argv[2].split(",")])
