"""What one dependency between SMs costs through global memory, alone (experiments/hop_probe.py;
H200): a token passed back and forth between two programs, by flag kind and with the dataflow
kernel's hand-offs inside a program (x to a consumer warp, its post through a publisher lane),
idle and under a DRAM stream from every other SM; and one token answered by many programs (all
to one), or every program waiting for all the others (all to all: a dataflow dependency). The
floor under a persistent kernel's software dependency, against a PDL launch (~1.1 us,
`chain_probe.py`'s tiny chain) and the dataflow kernel's hop (~2.2 us).

python3 -m experiments.scripts.hop_probe [OUT_DIR] -> OUT_DIR/hop_probe.csv. A few seconds.
"""
import csv
import statistics
import sys
from pathlib import Path

import torch

from experiments import hop_probe

out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
out.mkdir(parents=True, exist_ok=True)
stream = torch.randint(0, 255, (2 << 30,), dtype=torch.uint8, device="cuda")   # 2 GiB: well past L2
rows = []
CASES = [(m, 1024, 1) for m in hop_probe.MODES if m not in hop_probe.FANS] + [("counter + x", 28 * 1024, 1)]
CASES += [(m, 1024, fan) for m in hop_probe.FANS for fan in (1, 8, 32, 131)]   # x of 256 / 7168 fp32; fan-out
CASES += [("all to all + x to a warp + publisher", 28 * 1024, 131),
          ("all to all, flags + x to a warp + publisher", 28 * 1024, 131)]
for mode, x_bytes, fan in CASES:
    for load, buf in (("idle", None), ("DRAM stream", stream)) if mode not in hop_probe.FANS else (("idle", None),):
        runs = [hop_probe.hop_ns(mode, 20000, buf, x_bytes, fan) for _ in range(3)]
        want = fan * 20000 if mode == "all to one" else (fan + 1) * 20000 if mode in hop_probe.FANS else 2 * 20000
        ok = all(token == want and not gave_up and (error is None or abs(error) < 1e-3)
                 for _, token, gave_up, error in runs)
        ns = [r[0] for r in runs]
        has_x = mode == "counter + x" or mode in hop_probe.CONSUMER
        rows.append({"mode": mode if fan == 1 else f"{mode} ({fan})", "x_bytes": x_bytes if has_x else "",
                     "load": load, "ns_per_hop": round(statistics.median(ns), 1),
                     "min_ns": round(min(ns), 1), "max_ns": round(max(ns), 1), "ok": ok})
        print(rows[-1], flush=True)
with open(out / "hop_probe.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
print("\n| flag | x bytes | load | ns a hop (median of 3, min-max) | every hop |\n|---|---|---|---|---|")
for r in rows:
    print(f"| {r['mode']} | {r['x_bytes']} | {r['load']} | {r['ns_per_hop']} ({r['min_ns']}-{r['max_ns']}) | {r['ok']} |")
