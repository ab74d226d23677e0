"""Few-row dense GEMMs of the K2.6 TP-8 decode step: kernels.skinny vs F.linear (cuBLAS), H200.

python3 -m experiments.scripts.skinny_bench [OUT_DIR]: each shape in CUDA graphs of 20 calls over
rotated weights (so W comes from DRAM), GB/s of W against the measured copy bandwidth.
Then the fused GEMMs the engine uses (norm prologue, SiLU or rope epilogue) against the
launches they replace (rms_norm -> skinny GEMM -> silu_mul / half_rows / rope_), same timing.
Writes OUT_DIR/skinny_bench.csv and OUT_DIR/skinny_fused_bench.csv and prints tables. About 30 s.
"""
import csv
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from ddbench.timing import bench, copy_bandwidth_gbps
from ddbench.engine.config import preset
from ddbench.kernels import fused_ops
from ddbench.kernels.moe_gemv import half_rows
from ddbench.kernels.skinny import norm_linear, skinny_linear, tiles

out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
copy = copy_bandwidth_gbps(dev)
SHAPES = preset("k2.6", tp=8).dense_shapes()


def time_each(fns: dict, ws: list) -> dict:
    """label -> median us of fn(w) per call, a CUDA graph of 20 calls over the 20 weights in `ws`."""
    res = {}
    for label, fn in fns.items():
        it = itertools.cycle(range(len(ws)))
        res[label] = bench(lambda: fn(ws[next(it)]), device=dev, graph=True, graph_ops=20, reps=10).median_us
    return res


def write_csv(name: str, table: list) -> None:
    with open(out / name, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)


rows = []
for (name, (n, k)), m in itertools.product(SHAPES.items(), (1, 2, 4)):
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(20)]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    want = F.linear(x, ws[0])
    err = ((skinny_linear(x, ws[0]).float() - want.float()).norm() / want.float().norm()).item()
    res = time_each({"skinny": lambda w: skinny_linear(x, w), "cublas": lambda w: F.linear(x, w)}, ws)
    gb = n * k * 2 / 1e3
    rows.append(dict(gemm=name, m=m, n=n, k=k, tile="x".join(map(str, tiles(m, n, k))), skinny_us=round(res["skinny"], 2),
                     cublas_us=round(res["cublas"], 2), skinny_pct_copy=round(100 * gb / res["skinny"] / copy, 1),
                     cublas_pct_copy=round(100 * gb / res["cublas"] / copy, 1), rel_err=f"{err:.1e}"))
    del ws
write_csv("skinny_bench.csv", rows)
print(f"copy {copy:.0f} GB/s")
print(f"{'gemm':11s} {'m':>2} {'n':>5} {'k':>5} {'tile':>10} {'skinny_us':>9} {'cublas_us':>9} {'sk%copy':>7} {'cu%copy':>7} {'err':>8}")
for r in rows:
    print(f"{r['gemm']:11s} {r['m']:2d} {r['n']:5d} {r['k']:5d} {r['tile']:>10} {r['skinny_us']:9.2f} {r['cublas_us']:9.2f} "
          f"{r['skinny_pct_copy']:7.1f} {r['cublas_pct_copy']:7.1f} {r['rel_err']:>8}")

# fused (one launch) vs unfused (the launches the engine ran before):
# name -> (N out, K, norm, glu, normed x + gemv order, q rope); shared_w2+sum_k: the 8 fp32 routed
# expert rows summed in the epilogue vs a sum over k (torch, standing in for moe_gemv's _sum_k) + addmm_
FUSED = {"attn_norm+wqkv_a": (2112, 7168, True, False, False, False),
         "ffn_norm+router(+xn,xh)": (384, 7168, True, False, True, False),
         "shared_w13+silu": (256, 7168, False, True, False, False),
         "ffn_norm+dense_w13+silu": (2304, 7168, True, True, False, False),
         "wq_b+rope": (1536, 1536, False, False, False, True),
         "shared_w2+sum_k": (7168, 256, False, False, False, False)}
fused_rows = []
for (name, (n, K, norm, glu, side, rope)), m in itertools.product(FUSED.items(), (1, 4)):
    ws = [torch.randn(n * (2 if glu else 1), K, device=dev, dtype=torch.bfloat16) * K ** -0.5 for _ in range(20)]
    x, r = torch.randn(m, K, device=dev, dtype=torch.bfloat16), torch.randn(m, K, device=dev, dtype=torch.bfloat16)
    nw = 1 + 0.1 * torch.randn(K, device=dev, dtype=torch.bfloat16)
    ang = torch.randn(1, m, 32, device=dev)
    cos, sin = ang.cos(), ang.sin()

    rows = torch.randn(8 * m, n, device=dev)

    def fused(w):
        if name == "shared_w2+sum_k":
            return skinny_linear(x, w, add=rows, add_rows=8)
        if norm:
            return norm_linear(x, nw, 1e-5, w, r, glu=glu, out_xn=side, out_xh=side)[0]
        if rope:
            return skinny_linear(x, w, rope=(cos, sin, 192, 128))
        return skinny_linear(x, w, glu=True)

    def unfused(w):
        if name == "shared_w2+sum_k":
            return rows.view(m, 8, n).sum(1).to(x.dtype).addmm_(x, w.t())
        xn = fused_ops.rms_norm(x, nw, 1e-5, residual=r)[0] if norm else x
        y = skinny_linear(xn, w)
        if side:
            half_rows(xn)
        if rope:
            fused_ops.rope_(y.view(1, m, -1, 192), cos, sin, 128)
        return fused_ops.silu_mul(y) if glu else y

    err = ((fused(ws[0]).float() - unfused(ws[0]).float()).norm() / unfused(ws[0]).float().norm()).item()
    res = time_each({"fused": fused, "unfused": unfused}, ws)
    fused_rows.append(dict(gemm=name, m=m, n=n * (2 if glu else 1), k=K, fused_us=round(res["fused"], 2),
                           unfused_us=round(res["unfused"], 2), saved_us=round(res["unfused"] - res["fused"], 2),
                           rel_diff=f"{err:.1e}"))
    del ws
write_csv("skinny_fused_bench.csv", fused_rows)
print(f"\n{'fused gemm':26s} {'m':>2} {'n':>5} {'fused_us':>9} {'unfused_us':>10} {'saved_us':>8} {'diff':>8}")
for r in fused_rows:
    print(f"{r['gemm']:26s} {r['m']:2d} {r['n']:5d} {r['fused_us']:9.2f} {r['unfused_us']:10.2f} {r['saved_us']:8.2f} "
          f"{r['rel_diff']:>8}")
