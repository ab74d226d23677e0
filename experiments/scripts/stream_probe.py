"""How fast a grid's programs pull weights from DRAM, by copy kind, programs an SM and threads
(experiments/stream_probe.cu; H200). The question behind it: can one program an SM, the shape a
persistent decode kernel needs, stream as fast as the launches it would replace? (The one-launch
MoE block's programs got 10-15 GB/s: docs/notes/decode.md, session 13.)

python3 -m experiments.scripts.stream_probe [OUT_DIR] -> OUT_DIR/stream_probe.csv. Two sizes a config:
`stream`, 1 GiB in one launch (the steady rate), and `burst`, 256 KB an SM (about what the MoE
block's programs read; a CUDA graph of 20 launches over different parts of the buffer, so
none reads from L2). About 30 s.
"""
import csv
import itertools
import sys
from pathlib import Path

import torch

from ddbench.timing import bench
from experiments.cuda import kernel

KIB = 1024
# (kind, programs an SM, threads, defines)
CONFIGS = [("ld", 1, 256, {"UNROLL": 8}), ("ld", 1, 512, {"UNROLL": 8}), ("ld", 1, 1024, {"UNROLL": 4}),
           ("ld", 2, 256, {"UNROLL": 8}), ("ld", 2, 512, {"UNROLL": 4}), ("ld", 4, 256, {"UNROLL": 4}),
           ("cp.async", 1, 256, {"STAGES": 16, "CHUNK": 8 * KIB}), ("cp.async", 1, 512, {"STAGES": 16, "CHUNK": 8 * KIB}),
           ("cp.async", 2, 256, {"STAGES": 8, "CHUNK": 8 * KIB}),
           ("tma", 1, 256, {"STAGES": 64, "CHUNK": 512}), ("tma", 1, 256, {"STAGES": 48, "CHUNK": 2 * KIB}),
           ("tma", 1, 256, {"STAGES": 16, "CHUNK": 8 * KIB}), ("tma", 1, 256, {"STAGES": 6, "CHUNK": 32 * KIB}),
           ("tma", 2, 256, {"STAGES": 8, "CHUNK": 8 * KIB})]
MODES = {"ld": 0, "cp.async": 1, "tma": 2}

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
out_dir.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
sms = torch.cuda.get_device_properties(dev).multi_processor_count
buf = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device=dev)
sink = torch.zeros(4 * sms, dtype=torch.int32, device=dev)


rows = []
print(f"{'kind':9s} {'prog/SM':>7s} {'threads':>7s} {'chunk':>6s} {'stages':>6s} {'size':>6s} {'us':>9s} {'GB/s':>7s} {'GB/s/SM':>8s}")
for kind, per_sm, threads, defines in CONFIGS:
    d = {"MODE": MODES[kind], "THREADS": threads, "UNROLL": 1, "STAGES": 1, "CHUNK": 16, **defines}
    fn = kernel("stream_probe.cu", "stream", d, dev)
    grid, shared = sms * per_sm, (d["STAGES"] * d["CHUNK"] if kind != "ld" else 0)
    unit = max(d["CHUNK"], 16 * threads)
    for size, span in (("stream", (1 << 30) // grid // unit * unit), ("burst", 256 * KIB // per_sm)):
        total = span * grid
        parts = (1 << 30) // total

        turn = itertools.count()

        def launch(span=span, total=total, parts=parts, turn=turn):
            fn(grid, threads, shared, [buf[next(turn) % parts * total:], span, sink])
        us = bench(launch, device=dev, graph=True, graph_ops=1 if size == "stream" else 20, reps=5).median_us
        gbs = total / us / 1e3
        row = {"kind": kind, "programs_per_sm": per_sm, "threads": threads, "chunk": d["CHUNK"] if kind != "ld" else "",
               "stages": d["STAGES"] if kind != "ld" else "", "unroll": d["UNROLL"] if kind == "ld" else "",
               "size": size, "bytes": total, "us": round(us, 2), "gb_s": round(gbs, 1), "gb_s_per_sm": round(gbs / sms, 2)}
        rows.append(row)
        print(f"{kind:9s} {per_sm:7d} {threads:7d} {row['chunk']!s:>6s} {row['stages']!s:>6s} {size:>6s} "
              f"{us:9.2f} {gbs:7.0f} {gbs / sms:8.2f}")
with open(out_dir / "stream_probe.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
