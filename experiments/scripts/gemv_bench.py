"""ddbench.kernels.gemv (CUDA, weights loaded before the PDL wait) against kernels.skinny, one launch at a
time, at the K2.6 TP-8 decode shapes (H200).

python3 -m experiments.scripts.gemv_bench [OUT_DIR]: each shape in CUDA graphs of 20 calls over 20
weight copies (W from DRAM), back to back in one stream (so each launch waits for the one
before, as in the decode step's chain) with and without PDL; kernels.skinny the
same way; and gemv launch-shape variants (programs an SM, shared budget). Prints us a call,
GB/s of W and the bytes floor (W / measured copy bandwidth); writes OUT_DIR/gemv_bench.csv.
"""
import csv
import sys
from pathlib import Path

import torch

from ddbench.timing import bench, copy_bandwidth_gbps
from ddbench.engine.config import preset
from ddbench.kernels import gemv, pdl, skinny

out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
copy = copy_bandwidth_gbps(dev)
SHAPES = {k: v for k, v in preset("k2.6", tp=8).dense_shapes().items() if not k.startswith("dense")}
VARIANTS = {  # label -> (PROGRAMS_PER_SM, SHARED_BUDGET, WARPS)
    "gemv": (1, 110 * 1024, 8), "gemv 2/SM 55K": (2, 55 * 1024, 8), "gemv 1/SM 200K": (1, 200 * 1024, 8),
    "gemv 1/SM 64K": (1, 64 * 1024, 8), "gemv 16 warps": (1, 110 * 1024, 16), "gemv 4 warps": (1, 110 * 1024, 4)}
rows = []
for name, (n, k) in SHAPES.items():
    ws = [torch.randn(n, k, device=dev).to(torch.bfloat16) * k ** -0.5 for _ in range(20)]
    x = torch.randn(1, k, device=dev).to(torch.bfloat16)
    floor = n * k * 2 / (copy * 1e3)

    def chain(call):
        def fn():   # 20 calls in stream order: each starts (past its PDL wait) when the one before ends
            return [call(w, x) for w in ws][-1]
        return fn
    runs = {"skinny": lambda w, x: skinny.skinny_linear(x, w) if n <= k else skinny.linear(x, w)}
    for label, (per_sm, budget, warps) in VARIANTS.items():
        for use_pdl in (True, False):
            def call(w, x, per_sm=per_sm, budget=budget, warps=warps, use_pdl=use_pdl):
                gemv.PROGRAMS_PER_SM, gemv.SHARED_BUDGET, gemv.WARPS = per_sm, budget, warps
                return gemv.gemv(w, x, pdl=use_pdl)
            runs[label + ("" if use_pdl else " no PDL")] = call
    for label, call in runs.items():
        try:
            us = bench(chain(call), device=dev, graph=True, graph_ops=1, reps=10).median_us / len(ws)
        except Exception as e:   # a shape a variant cannot take
            print(f"{name} {label}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        rows.append(dict(shape=name, n=n, k=k, kernel=label, us=round(us, 2), gbps=round(n * k * 2 / (us * 1e3)),
                         x_floor=round(us / floor, 2), floor_us=round(floor, 2), pdl_on=pdl.ENABLED))
        print(rows[-1], flush=True)
with open(out / "gemv_bench.csv", "w", newline="") as f:
    wr = csv.DictWriter(f, fieldnames=list(rows[0]))
    wr.writeheader()
    wr.writerows(rows)
print(f"\ncopy {copy:.0f} GB/s\n| shape | floor us | " + " | ".join(runs) + " |\n|---|---|" + "---|" * len(runs))
for name in SHAPES:
    r = {x["kernel"]: x for x in rows if x["shape"] == name}
    print(f"| {name} | {next(iter(r.values()))['floor_us']} | "
          + " | ".join(f"{r[k]['us']}" if k in r else "-" for k in runs) + " |")
