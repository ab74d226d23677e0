"""Where one decode step's GPU time goes, kernel by kernel (H200, K2.6 TP-8 rank-0 shard).

python3 -m experiments.scripts.decode_profile [OUT_DIR] [CONCURRENCY] [LAYERS]: builds the rank-0
shard with random weights (LAYERS blocks, default all 61), prefills 128 tokens, then
profiles 3 eager decode steps with torch.profiler: per kernel name, GPU time per step and
launches per step, largest first, and the sum of kernel time against the eager and
CUDA-graph step times (the difference is launch gaps). Writes OUT_DIR/decode_profile_c<C>.csv.
The profiled steps run without programmatic dependent launch (kernels.pdl), so that a kernel's
time is its own and not its wait for the previous one; the graph step time is with the default.
About 60-90 s on an H200 (init, Triton compiles, profile).
"""
import csv
import sys
from collections import defaultdict
from pathlib import Path

import torch

from ddbench.engine.build import build_model
from ddbench.timing import bench
from ddbench.engine.config import preset
from ddbench.engine.decode import Decoder
from ddbench.engine.parallel import SimComm
from ddbench.kernels import pdl

out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
conc = int(sys.argv[2]) if len(sys.argv) > 2 else 1
layers = int(sys.argv[3]) if len(sys.argv) > 3 else None
out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
cfg = preset("k2.6", tp=8, rank=0, **({"n_layers": layers} if layers else {}))
model, _ = build_model(cfg, SimComm(8, 0, lambda n: 0.0), None, "triton", "triton", 0, dev, "auto")
dec = Decoder(model, conc, 256, use_graph=False)
prompts = torch.randint(0, cfg.vocab, (conc, 128), device=dev)
dec.prefill(prompts)
for _ in range(3):
    dec.step()
torch.cuda.synchronize()
eager = bench(dec.advance, device=dev, reps=10, warmup=2, flush=False)
steps = 3
pdl_default, pdl.ENABLED = pdl.ENABLED, False
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(steps):
        dec.advance()
    torch.cuda.synchronize()
pdl.ENABLED = pdl_default
per = defaultdict(lambda: [0.0, 0])
for ev in prof.events():
    if ev.device_type == torch.autograd.DeviceType.CUDA:
        per[ev.name][0] += ev.device_time / steps
        per[ev.name][1] += 1 / steps
dec.use_graph = True
graph = bench(dec.advance, device=dev, reps=10, warmup=2, flush=False)
rows = sorted(({"kernel": k[:120], "us_per_step": round(v[0], 2), "launches_per_step": round(v[1], 1),
                "us_per_launch": round(v[0] / max(v[1], 1e-9), 2)} for k, v in per.items()),
              key=lambda r: -r["us_per_step"])
path = out / f"decode_profile_c{conc}.csv"
with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
total = sum(r["us_per_step"] for r in rows)
launches = sum(r["launches_per_step"] for r in rows)
print(f"\nK2.6 TP-8 rank 0, {cfg.n_layers} layers, concurrency {conc}: kernel time {total:.0f} us/step in "
      f"{launches:.0f} launches; eager step {eager.median_us:.0f} us, CUDA-graph step {graph.median_us:.0f} us")
print(f"{'us/step':>9} {'launches':>8} {'us/launch':>9}  kernel")
for r in rows[:30]:
    print(f"{r['us_per_step']:9.1f} {r['launches_per_step']:8.1f} {r['us_per_launch']:9.2f}  {r['kernel'][:90]}")
print(f"wrote {path}")
