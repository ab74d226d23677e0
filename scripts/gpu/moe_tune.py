"""Tile-variant timing of the Triton INT4 MoE at the K2.6 TP-8 shard (H200), CUDA graphs.

Run from the repo root: python3 scripts/gpu/moe_tune.py [OUT_DIR]. Checks each variant
against the fp32 reference once per token count, times it in a CUDA graph over rotated
routings (so small-T replays do not hit L2), and prints one table of time and % of copy
bandwidth per token count, best variant marked. About 2-3 minutes on an H200.
"""
import csv
import itertools
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ddbench.timing import bench, copy_bandwidth_gbps, gemm_tflops  # noqa: E402
from engine.config import preset  # noqa: E402
from kernels.moe import expected_experts_touched, fused_moe_ref, random_marlin_moe, synthetic_routing  # noqa: E402
from kernels.moe_triton import MoeTritonConfig, default_config, fused_moe_triton  # noqa: E402

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
out_dir.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
cfg = preset("k2.6", tp=8)
E, H, I, K = cfg.n_experts, cfg.hidden, cfg.moe_inter_local, cfg.top_k
t0 = time.time()
w = random_marlin_moe(E, H, I, cfg.group_size, K, device=dev, seed=0)
torch.cuda.synchronize()
print(f"weights built in {time.time() - t0:.1f} s; expert bytes {w.expert_bytes() / 1e6:.3f} MB", flush=True)
copy = copy_bandwidth_gbps(dev)
tf = gemm_tflops(dev)
rd = bench(lambda: w.w13.sum(dtype=torch.int64), device=dev, reps=10, flush=False)  # read-only stream
read_gbps = w.w13.numel() * 4 / (rd.median_us * 1e-6) / 1e9
print(f"copy {copy:.0f} GB/s  read(sum) {read_gbps:.0f} GB/s  bf16 gemm {tf:.0f} TFLOP/s", flush=True)

variants = {
    "heur": None,
    "m16n64n64w4s3": dict(block_m=16, block_n13=64, block_n2=64, num_warps=4, num_stages=3),
    "m16n64n128s4": dict(block_m=16, block_n13=64, block_n2=128, num_warps=4, num_stages=4),
    "m16n128n128": dict(block_m=16, block_n13=128, block_n2=128, num_warps=4, num_stages=3),
    "m16w8": dict(block_m=16, block_n13=64, block_n2=64, num_warps=8, num_stages=3),
    "m16s5": dict(block_m=16, block_n13=64, block_n2=64, num_warps=4, num_stages=5),
    "m16n32": dict(block_m=16, block_n13=32, block_n2=64, num_warps=4, num_stages=4),
    "m16atom": dict(block_m=16, block_n13=64, block_n2=64, atomic_out=True),
    "m32": dict(block_m=32, block_n13=64, block_n2=64, num_warps=4, num_stages=3),
    "m64": dict(block_m=64, block_n13=64, block_n2=64, num_warps=4, num_stages=3),
    "m64n128w8": dict(block_m=64, block_n13=128, block_n2=128, num_warps=8, num_stages=3),
    "m128n128w8": dict(block_m=128, block_n13=128, block_n2=128, num_warps=8, num_stages=3),
}
rows = []
ROT = 10
for T in [1, 4, 16, 64, 256, 1024, 4096]:
    xs = [torch.randn(T, H, device=dev, dtype=torch.bfloat16) for _ in range(ROT)]
    rts = [synthetic_routing("uniform", T, E, K, device=dev, seed=100 * T + r) for r in range(ROT)]
    touched = sum(torch.unique(ids).numel() for ids, _ in rts) / ROT
    nbytes = touched * w.expert_bytes() + 2 * T * H * 2
    flops = 2 * T * K * 3 * H * I
    ref = fused_moe_ref(xs[0].float(), *rts[0], w)
    heur = default_config(T, K, E, I, H, torch.cuda.get_device_properties(dev).multi_processor_count)
    for name, ch in variants.items():
        if ch is not None and ch["block_m"] >= 64 and T < 64:
            continue
        mc = heur if ch is None else replace(default_config(T, K, E, I, H), **ch)
        try:
            y = fused_moe_triton(xs[0], *rts[0], w, mc)
            err = ((y.float() - ref).norm() / ref.norm()).item()
            it = itertools.cycle(range(ROT))

            def fn():
                r = next(it)
                return fused_moe_triton(xs[r], *rts[r], w, mc)

            st = bench(fn, device=dev, graph=True, graph_ops=ROT, reps=15, warmup=2)
        except Exception as e:  # noqa: BLE001 - one bad variant must not stop the sweep
            print(f"T={T} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        row = dict(tokens=T, variant=name, **{k: v for k, v in asdict(mc).items()}, rel_err=err,
                   touched=touched, time_us=st.median_us, p20=st.p20_us, p80=st.p80_us,
                   gbps=nbytes / st.median_us / 1e3, pct_copy=100 * nbytes / st.median_us / 1e3 / copy,
                   pct_read=100 * nbytes / st.median_us / 1e3 / read_gbps,
                   tflops=flops / st.median_us / 1e6, pct_gemm=100 * flops / st.median_us / 1e6 / tf)
        rows.append(row)
        print(f"T={T:5d} {name:14s} err={err:.1e} {st.median_us:9.1f} us {row['gbps']:7.0f} GB/s "
              f"{row['pct_copy']:5.1f}% copy {row['pct_gemm']:5.1f}% gemm", flush=True)
    del xs, rts
with open(out_dir / "moe_tune.csv", "w", newline="") as f:
    wr = csv.DictWriter(f, fieldnames=list(rows[0]))
    wr.writeheader()
    wr.writerows(rows)
print(f"\ncopy {copy:.0f} GB/s, read {read_gbps:.0f} GB/s, gemm {tf:.0f} TFLOP/s; total {time.time() - t0:.0f} s")
print(f"{'T':>5} {'best':14s} {'us':>8} {'%copy':>6} {'%gemm':>6} {'heur_us':>8} {'max_err':>8}")
for T in sorted({r["tokens"] for r in rows}):
    rs = [r for r in rows if r["tokens"] == T]
    b = min(rs, key=lambda r: r["time_us"])
    h = next((r for r in rs if r["variant"] == "heur"), b)
    print(f"{T:5d} {b['variant']:14s} {b['time_us']:8.1f} {b['pct_copy']:6.1f} {b['pct_gemm']:6.1f} "
          f"{h['time_us']:8.1f} {max(r['rel_err'] for r in rs):8.1e}")
