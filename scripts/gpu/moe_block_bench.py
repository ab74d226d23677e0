"""kernels.moe_block alone at K2.6 TP-8 rank-0 shapes (H200): time a launch in a CUDA graph of
back-to-back launches (with and without PDL; three weight sets in turn, so a launch does not
find its dense weights in L2), and where each program's time goes (the kernel's clock64 marks,
`times=`), against the bytes a launch reads.

python3 scripts/gpu/moe_block_bench.py [OUT_DIR]  -> OUT_DIR/moe_block_bench.csv (one row per
phase: median and max over programs, us at the SM clock measured here). About 30 s.
"""
import csv
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ddbench.timing import bench  # noqa: E402
from engine.config import preset  # noqa: E402
from kernels import moe_block  # noqa: E402
from kernels.moe import random_marlin_moe  # noqa: E402

MARKS = ["launch -> weights issued", "-> PDL wait over", "-> norm", "-> router + shared gate/up",
         "-> barrier 1", "-> top-k + first pieces issued", "-> w13", "-> barrier 2", "-> act", "-> w2 + shared w2"]
out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
cfg = preset("k2.6", tp=8, rank=0)
h, e, k, inter, si = cfg.hidden, cfg.n_experts, cfg.top_k, cfg.moe_inter_local, cfg.shared_inter_local
g = torch.Generator(device=dev).manual_seed(0)


def rnd(*s, scale=1.0):
    return (torch.randn(*s, generator=g, device=dev) * scale).to(torch.bfloat16)


experts = random_marlin_moe(e, h, inter, top_k=k, device=dev, seed=1)
sets = [dict(a=rnd(h), res=rnd(h), nw=rnd(h, scale=0.1) + 1, eps=1e-6, gate=rnd(e, h, scale=h ** -0.5),
             bias=0.1 * torch.randn(e, generator=g, device=dev), top_k=k, scaling=cfg.routed_scaling,
             sw13=rnd(2 * si, h, scale=h ** -0.5), sw2=rnd(h, si, scale=si ** -0.5), w=experts) for _ in range(3)]
c = moe_block.config(h, e, k, inter, si, cfg.group_size, torch.cuda.get_device_properties(dev).multi_processor_count)
grid = c.pop("grid")
dense = 2 * h * (e + 3 * si)                                                  # router, shared w13 + w2
routed = k * (2 * inter * h // 2 + 2 * inter * h // cfg.group_size * 2       # w13 words + scales
              + inter * h // 2 + inter // cfg.group_size * h * 2)            # w2 words + scales
copy_gbs = 4272.0                                                             # docs/BENCHMARKS.md decode, session 12
print(f"config {c}, grid {grid}; bytes a launch {(dense + routed) / 1e6:.1f} MB "
      f"(dense {dense / 1e6:.1f}, routed {routed / 1e6:.1f}) -> floor {(dense + routed) / copy_gbs / 1e3:.2f} us")


def graph_us(n: int, pdl: bool) -> float:
    """us a launch: graphs of n launches (weight sets in turn), replayed (ddbench.timing)."""
    turn = itertools.count()
    return bench(lambda: moe_block.moe_block(**sets[next(turn) % 3], pdl=pdl), device=dev, graph=True,
                 graph_ops=n, reps=20).median_us


rows = []
for pdl in (False, True):
    us = graph_us(30, pdl)
    print(f"graph of 30 launches, pdl={pdl}: {us:.2f} us a launch")
    rows.append({"what": f"launch in a graph, pdl={int(pdl)}", "median_us": round(us, 2), "max_us": ""})

# clock64 marks of 6 launches in a row (a graph with PDL; the first launch has no predecessor)
times = torch.zeros(6, grid, 11, dtype=torch.int64, device=dev)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    for i in range(6):
        moe_block.moe_block(**sets[i % 3], pdl=True, times=times[i])
for _ in range(3):
    graph.replay()
torch.cuda.synchronize()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
torch.cuda._sleep(2_000_000)
end.record()
torch.cuda.synchronize()
ghz = 2_000_000 / (start.elapsed_time(end) * 1e6)                              # _sleep spins on clock64
print(f"SM clock ~{ghz:.2f} GHz (clock64 ticks / event time)")
d = (times[1:, :, 1:] - times[1:, :, :-1]).double() / (ghz * 1e3)            # [launches, programs, 10] us
w2_programs = h // 64
print(f"\nwhere a launch's time goes (launches 2-6, programs < {w2_programs} for the last two marks), us")
print(f"{'mark':34s} {'median':>8s} {'max':>8s}")
for i, name in enumerate(MARKS):
    v = d[:, :w2_programs, i] if i >= 8 else d[:, :, i]
    med, mx = v.median().item(), v.max().item()
    print(f"{name:34s} {med:8.2f} {mx:8.2f}")
    rows.append({"what": name, "median_us": round(med, 2), "max_us": round(mx, 2)})
with open(out / "moe_block_bench.csv", "w", newline="") as f:
    wr = csv.DictWriter(f, fieldnames=["what", "median_us", "max_us"])
    wr.writeheader()
    wr.writerows(rows)
