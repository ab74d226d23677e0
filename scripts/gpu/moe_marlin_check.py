"""Compile, check and time the CUDA Marlin MoE (kernels/moe_marlin.cu), its large-T sibling
(kernels/moe_wide.cu, variants w<MT>[s<stages>][n<warps>][v<w2 warps>][b<minb>]) and the Triton
kernels at the K2.6 TP-8 rank shard (E=384, H=7168, I=256, group 32, top-8; the optional I = 2048
is TP-1's whole layer), uniform routing, CUDA graphs of ROT calls over rotated inputs. Writes
moe_marlin_check.csv under the given folder and prints a short table last (whole layer, us, % of
measured copy bandwidth).

usage: python3 scripts/gpu/moe_marlin_check.py OUT_DIR [T,T,...] [variant,variant,...] [I]
"""
from __future__ import annotations

import csv
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from ddbench import timing  # noqa: E402
from ddbench.kernels import moe_marlin as mm  # noqa: E402
from ddbench.kernels import moe_triton as mt  # noqa: E402
from ddbench.kernels import moe_wide as mw  # noqa: E402
from ddbench.kernels.moe import fused_moe_ref, random_marlin_moe, synthetic_routing  # noqa: E402

ROT = 10
E, H, I, G, K = 384, 7168, 256, 32, 8
VARIANTS = ["m1", "m1k16", "m2", "m4", "triton"]   # default variants


def variant(name: str) -> tuple[str, dict | None]:
    """'m<NG>[k<splits>][s<stages>][b<w2 blocks>]' -> ("marlin", tiles for kernels.moe_marlin.resolve_tiles);
    'w<MT>[s<stages>][n<warps>][v<w2's warps>][b<minb>]' -> ("wide", tiles for kernels.moe_wide); 'triton' ->
    ("triton", None: the Triton default table)."""
    if name == "triton":
        return "triton", None
    m = re.fullmatch(r"w(\d)(?:s(\d+))?(?:n(\d))?(?:v(\d))?(?:b(\d))?", name)
    if m:
        warps = int(m[3] or 8)
        return "wide", {"mt": int(m[1]), "stages": int(m[2] or 4), "warps": warps, "w2_warps": int(m[4] or warps),
                        "minb": int(m[5] or 1)}
    m = re.fullmatch(r"m(\d)(?:k(\d+))?(?:s(\d+))?(?:b(\d))?", name)
    if not m:
        raise SystemExit(f"unknown variant {name!r}")
    tiles = {"ng": int(m[1]), "stages": int(m[3] or 4), "warps": 4, "w2b": int(m[4] or 2)}
    if m[2]:
        tiles["splits"] = int(m[2])
    return "marlin", tiles


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    tokens = [int(t) for t in sys.argv[2].split(",")] if len(sys.argv) > 2 else \
        [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else VARIANTS
    inter = int(sys.argv[4]) if len(sys.argv) > 4 else I
    dev = torch.device("cuda")
    t0 = time.time()
    w = random_marlin_moe(E, H, inter, G, K, device=dev, seed=0)
    copy = timing.copy_bandwidth_gbps(dev)
    gemm = timing.gemm_tflops(dev)
    exp_b = w.expert_bytes()
    print(f"copy {copy:.0f} GB/s, gemm {gemm:.0f} TFLOP/s, weights built in {time.time() - t0:.1f} s", flush=True)
    rows = []
    for t in tokens:
        xs, routes = [], []
        for r in range(ROT):
            g = torch.Generator(device=dev).manual_seed(t * 31 + r)
            xs.append(torch.randn(t, H, generator=g, device=dev).bfloat16())
            routes.append(synthetic_routing("uniform", t, E, K, device=dev, seed=t * 31 + r))
        touched = sum(torch.unique(ids).numel() for ids, _ in routes) / ROT
        floor_us = (touched * exp_b + 2 * t * H * 2) / (copy * 1e9) * 1e6
        flops = 2 * t * K * 3 * H * inter
        ref = fused_moe_ref(xs[0].float(), *routes[0], w).float()
        for name in names:
            kind, spec = variant(name)
            if kind == "triton":
                cfg = mt.default_config(t, K, E, inter, H, mt.sm_count(dev))
                tiles = f"{'gemv-' if cfg.gemv else ''}m{cfg.block_m}"

                def fn(r, cfg=cfg):
                    return mt.fused_moe_triton(xs[r], *routes[r], w, cfg)
            elif kind == "wide":
                tl = mw.resolve_tiles(t, K, w, spec)
                tiles = mw.tile_name(tl)

                def fn(r, tl=tl):
                    return mw.fused_moe_wide(xs[r], *routes[r], w, tl)
            else:
                tl = mm.resolve_tiles(t, K, w, dev, spec)
                tiles = mm.tile_name(tl)

                def fn(r, tl=tl):
                    return mm.fused_moe_marlin(xs[r], *routes[r], w, tl)
            try:
                y = fn(0)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                same = torch.equal(y, fn(0))
                it = iter(range(10**9))
                st = timing.bench(lambda: fn(next(it) % ROT), device=dev, warmup=2, reps=20, graph=True, graph_ops=ROT)
                us = st.median_us
            except Exception as e:  # noqa: BLE001 - report and go on with the other variants
                print(f"T={t} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            row = dict(tokens=t, inter=inter, variant=name, tiles=tiles, time_us=round(us, 2),
                       floor_us=round(floor_us, 2),
                       pct_copy=round(100 * floor_us / us, 1), pct_gemm=round(100 * flops / (us * 1e-6) / 1e12 / gemm, 2),
                       rel_err=f"{err:.2e}", bitwise_repeat=same, copy_gbps=round(copy), gemm_tflops=round(gemm))
            rows.append(row)
            print(row, flush=True)
    with open(out / "moe_marlin_check.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    print(f"\nwhole layer at I = {inter}, us (% of copy bandwidth), copy {copy:.0f} GB/s;"
          f" total {time.time() - t0:.0f} s")
    print("T".rjust(5) + "".join(n.rjust(14) for n in names))
    for t in tokens:
        cells = []
        for n in names:
            r = next((r for r in rows if r["tokens"] == t and r["variant"] == n), None)
            cells.append((f"{r['time_us']:.1f} ({r['pct_copy']:.0f}%)" if r else "-").rjust(14))
        print(str(t).rjust(5) + "".join(cells))


if __name__ == "__main__":
    main()
