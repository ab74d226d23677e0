"""Tile-variant timing of the Triton INT4 MoE at the K2.6 TP-8 shard (H200), CUDA graphs.

python3 -m experiments.scripts.moe_tune OUT_DIR [TILES_JSON]: checks each variant against the fp32
reference, times it in a CUDA graph over rotated routings (so small-T replays do not hit
L2), writes OUT_DIR/moe_tune.csv and, if asked, a `ddbench moe-sweep --tiles` table of the
fastest variant per token count. Prints a table last. About 2 minutes on an H200 (mostly compiling).
"""
import csv
import itertools
import json
import math
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ddbench.timing import bench, copy_bandwidth_gbps, gemm_tflops
from ddbench.engine.config import preset
from ddbench.kernels.moe import fused_moe_ref, random_marlin_moe, synthetic_routing
from ddbench.kernels.moe_triton import TILE_TABLE, MoeTritonConfig, default_config, fused_moe_triton

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
tiles_out = Path(sys.argv[2]) if len(sys.argv) > 2 else None
out_dir.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
cfg = preset("k2.6", tp=8)
E, H, I, K = cfg.n_experts, cfg.hidden, cfg.moe_inter_local, cfg.top_k
SMS = torch.cuda.get_device_properties(dev).multi_processor_count
t0 = time.time()
w = random_marlin_moe(E, H, I, cfg.group_size, K, device=dev, seed=0)
copy = copy_bandwidth_gbps(dev)
tf = gemm_tflops(dev)
f32 = w.w13.view(torch.float32)
rd = bench(lambda: f32.sum(), device=dev, reps=10, flush=False)
read_gbps = f32.numel() * 4 / (rd.median_us * 1e-6) / 1e9
print(f"copy {copy:.0f} GB/s  read(sum fp32) {read_gbps:.0f} GB/s  bf16 gemm {tf:.0f} TFLOP/s", flush=True)

COMMON = {
    "base": {},   # the built-in TILE_TABLE (BLOCK_K 128 in call 2, 64 since)
    "k64": dict(block_k13=64, block_k2=64),
    "k256": dict(block_k13=256, block_k2=256),
    "n2_128": dict(block_n2=128),
    "n128": dict(block_n13=128, block_n2=128),
    "w8": dict(num_warps=8),
    "k256w8": dict(block_k13=256, block_k2=256, num_warps=8),
    "s2": dict(num_stages=2),
    "s4": dict(num_stages=4),
    "acc32": dict(acc_scale=True),   # the 32-row path (first version)
    "join64": dict(join=True, block_k13=64, block_k2=64),   # words loaded once, tl.join expansion
    "join128": dict(join=True),
    # CUDA-core path (kernels.moe_gemv): g<block_m>_<block_n>[w<warps>][s<stages>]
    "g1_64": dict(gemv=True, block_m=1, block_n13=64, block_n2=64, split_k=0),
    "g1_128": dict(gemv=True, block_m=1, block_n13=128, block_n2=128, split_k=0),
    "g1_256": dict(gemv=True, block_m=1, block_n13=256, block_n2=256, split_k=0),
    "g1_128w2": dict(gemv=True, block_m=1, block_n13=128, block_n2=128, split_k=0, num_warps=2),
    "g1_128s5": dict(gemv=True, block_m=1, block_n13=128, block_n2=128, split_k=0, num_stages=5),
    "g2_128": dict(gemv=True, block_m=2, block_n13=128, block_n2=128, split_k=0),
    "g4_64": dict(gemv=True, block_m=4, block_n13=64, block_n2=64, split_k=0),
    "g4_128": dict(gemv=True, block_m=4, block_n13=128, block_n2=128, split_k=0),
    "g8_64": dict(gemv=True, block_m=8, block_n13=64, block_n2=64, split_k=0),
    "g1_256_128": dict(gemv=True, block_m=1, block_n13=256, block_n2=128, split_k=0),
    "g1_512_256": dict(gemv=True, block_m=1, block_n13=512, block_n2=256, split_k=0),
    "g1_256_sp28": dict(gemv=True, block_m=1, block_n13=256, block_n2=256, split_k=28),
    "g1_256_sp4": dict(gemv=True, block_m=1, block_n13=256, block_n2=256, split_k=4),
}
BM_ALT = {1: [], 16: [], 256: [32], 1024: [16, 64], 4096: [32, 128]}
# optional narrowing (used by scripts/gpu/moe.sh for a quick look): comma lists
if os.environ.get("MOE_TUNE_VARIANTS"):
    COMMON = {k: v for k, v in COMMON.items() if k in os.environ["MOE_TUNE_VARIANTS"].split(",")}
TOKENS = [int(t) for t in os.environ.get("MOE_TUNE_TOKENS", "1,16,256,1024,4096").split(",")]
rows = []
ROT = 10
BUDGET_S = float(os.environ.get("MOE_TUNE_BUDGET_S", "95"))
for T in TOKENS:
    if time.time() - t0 > BUDGET_S:
        print(f"time budget {BUDGET_S:.0f} s spent: stopping before T={T}", flush=True)
        break
    xs = [torch.randn(T, H, device=dev, dtype=torch.bfloat16) for _ in range(ROT)]
    rts = [synthetic_routing("uniform", T, E, K, device=dev, seed=100 * T + r) for r in range(ROT)]
    touched = sum(torch.unique(ids).numel() for ids, _ in rts) / ROT
    nbytes = touched * w.expert_bytes() + 2 * T * H * 2
    flops = 2 * T * K * 3 * H * I
    ref = fused_moe_ref(xs[0].float(), *rts[0], w)
    heur = default_config(T, K, E, I, H, SMS)
    variants = {n: replace(heur, **ch) for n, ch in COMMON.items()}
    variants["mma"] = default_config(T, K, E, I, H, SMS, TILE_TABLE[1:])   # tensor-core path only
    for bm in BM_ALT.get(T, []) if not os.environ.get("MOE_TUNE_VARIANTS") else []:
        variants[f"m{bm}"] = replace(default_config(T, K, E, I, H, SMS, [(math.inf, dict(block_m=bm))]))
    for name, mc in variants.items():
        try:
            y = fused_moe_triton(xs[0], *rts[0], w, mc)
            err = ((y.float() - ref).norm() / ref.norm()).item()
            it = itertools.cycle(range(ROT))

            def fn():
                r = next(it)
                return fused_moe_triton(xs[r], *rts[r], w, mc)

            st = bench(fn, device=dev, graph=True, graph_ops=ROT, reps=10, warmup=2)
        except Exception as e:  # noqa: BLE001 - one bad variant must not stop the sweep
            print(f"T={T} {name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
            continue
        row = dict(tokens=T, variant=name, **asdict(mc), rel_err=err, touched=touched,
                   time_us=st.median_us, p20=st.p20_us, p80=st.p80_us,
                   gbps=nbytes / st.median_us / 1e3, pct_copy=100 * nbytes / st.median_us / 1e3 / copy,
                   tflops=flops / st.median_us / 1e6, pct_gemm=100 * flops / st.median_us / 1e6 / tf)
        rows.append(row)
        print(f"T={T:5d} {name:8s} err={err:.1e} {st.median_us:9.1f} us {row['gbps']:7.0f} GB/s "
              f"{row['pct_copy']:5.1f}% copy {row['pct_gemm']:5.1f}% gemm", flush=True)
    del xs, rts
with open(out_dir / "moe_tune.csv", "w", newline="") as f:
    wr = csv.DictWriter(f, fieldnames=list(rows[0]))
    wr.writeheader()
    wr.writerows(rows)
best = {}
for T in sorted({r["tokens"] for r in rows}):
    ok = [r for r in rows if r["tokens"] == T and r["rel_err"] < 1e-2]
    if ok:
        best[T] = min(ok, key=lambda r: r["time_us"])
if tiles_out is not None and best:
    ts = sorted(best)
    table = []
    for a, b in zip(ts, ts[1:] + [None]):
        bound = 1e9 if b is None else math.sqrt(a * b) * K / E   # geometric midpoint in tokens per expert
        fields = {k: best[a][k] for k in asdict(MoeTritonConfig()) if k != "split_k"}
        table.append({"max_per_expert": bound, **fields})
    tiles_out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {tiles_out}")
print(f"\ncopy {copy:.0f} GB/s, read {read_gbps:.0f} GB/s, gemm {tf:.0f} TFLOP/s; total {time.time() - t0:.0f} s")
print(f"{'T':>5} {'best':8s} {'us':>8} {'%copy':>6} {'%gemm':>6} {'base_us':>8} {'mma_us':>8} {'max_err':>8}")
for T, b in best.items():
    rs = [r for r in rows if r["tokens"] == T]
    get = lambda n: next((f"{r['time_us']:8.1f}" for r in rs if r["variant"] == n), "       -")  # noqa: E731
    print(f"{T:5d} {b['variant']:8s} {b['time_us']:8.1f} {b['pct_copy']:6.1f} {b['pct_gemm']:6.1f} "
          f"{get('base')} {get('mma')} {max(r['rel_err'] for r in rs):8.1e}")
