"""experiments.dataflow on the 4-layer K2.6 TP-8 dense chain of experiments/scripts/chain_probe.py (H200):
where a program's consumer time goes, and a run for Nsight Compute.

python3 -m experiments.scripts.dataflow_profile [free | tiny] [marks] [split2] [publisher]
  free:  every phase reads the input (no dependencies: the kernel's stream alone)
  split2: consumer teams of two warps
  publisher: a lane publishes the program's finished phases (the teams do not wait for it)
  tiny:  the chain of 48 dependent 256 x 256 phases instead (what a dependency costs)
  marks: a build that counts where a program's waits go a phase (experiments.dataflow.MARKS); prints
         their means a phase of the layer (us at 1.98 GHz, the SM clock ncu reads under load)

Under ncu, three launches, the third profiled:
ncu --clock-control none --kernel-name dataflow --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section SourceCounters \
    python3 -m experiments.scripts.dataflow_profile [free]
"""
import sys

import torch

from ddbench.engine.config import preset
from experiments import chain, dataflow

free, with_marks = "free" in sys.argv[1:], "marks" in sys.argv[1:]
split = 2 if "split2" in sys.argv[1:] else dataflow.SPLIT
publisher = "publisher" in sys.argv[1:]
tiny = "tiny" in sys.argv[1:]
shapes = ([(256, 256, p - 1) for p in range(48)] if tiny
          else chain.layers(preset("k2.6", tp=8).dense_shapes(), 4, free))
programs = torch.cuda.get_device_properties(0).multi_processor_count
pl = dataflow.plan(chain.build(shapes, "cuda", programs))
marks = torch.zeros(programs, len(shapes), len(dataflow.MARKS), dtype=torch.int64, device="cuda") if with_marks else None
for _ in range(3):
    if marks is not None:
        marks.zero_()
    dataflow.run(pl, split=split, publisher=publisher, marks=marks)
torch.cuda.synchronize()
print("gave up:", dataflow.gave_up(pl))
if marks is not None:
    m = marks.cpu().double()
    m[:, :, :-1] /= 1980.0                                              # us
    m[:, :, 2] /= dataflow.TEAMS                                        # every team waits for x
    m[:, :, 3:-1] /= m[:, :, -1:].clamp(1, dataflow.TEAMS)             # the teams that had tiles
    per = 1 if tiny else len(chain.LAYER_SRC)
    print(f"{'phase':<11} {'programs':>8} " + " ".join(f"{h:>10}" for h in dataflow.MARKS)
          + "  (us a program, mean; consumer columns a team; tiles a program)")
    for i, name in enumerate(["256x256"] if tiny else chain.LAYER_SRC):
        v = m[:, i::per]
        v = v[v[:, :, -1] > 0]                                           # (program, layer) with tiles
        print(f"{name:<11} {len(v) / (len(shapes) // per):>8.0f} " + " ".join(f"{x:>10.2f}" for x in v.mean(0).tolist()))
