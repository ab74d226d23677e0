"""Three launches of kernels.dataflow on the 4-layer K2.6 TP-8 dense chain of
scripts/gpu/chain_probe.py, for Nsight Compute (H200):

ncu --clock-control none --kernel-name dataflow --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section SourceCounters \
    python3 scripts/gpu/dataflow_profile.py [free]

`free`: every phase reads the input (no dependencies: the kernel's stream alone).
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.config import preset  # noqa: E402
from kernels import chain, dataflow  # noqa: E402

SRC = {"wqkv_a": -1, "wq_b": 0, "wo": 1, "router": 2, "shared_w13": 2, "shared_w2": 4}   # as chain_probe.py
LAYER = [(*preset("k2.6", tp=8).dense_shapes()[name], src) for name, src in SRC.items()]
free = sys.argv[1:] == ["free"]
shapes = []
for layer in range(4):
    base = len(shapes)
    for n, k, src in LAYER:
        shapes.append((n, k, -1 if free else (base - 1 if layer else -1) if src < 0 else base + src))
pl = dataflow.plan(chain.build(shapes, "cuda", torch.cuda.get_device_properties(0).multi_processor_count))
for _ in range(3):
    dataflow.run(pl)
torch.cuda.synchronize()
print("gave up:", dataflow.gave_up(pl))
