"""The CUDA-graph decode step under launch variants (H200, K2.6 TP-8 rank-0 shard).

python3 scripts/gpu/decode_variants.py [OUT_DIR] [CONCURRENCY,...]: builds the rank-0 shard
with random weights once, prefills 128 tokens, then for each variant re-captures the step
graph from the same state and times 40 back-to-back replays (after 20 untimed ones):
  plain          no programmatic dependent launch (kernels.pdl.ENABLED = False)
  pdl            PDL, no weight prefetch before the wait
  pdl+prefetch   PDL with the L2 prefetch of each GEMM's weights (the default)
  pdl, no wide   as the default, but N > K GEMMs (wo) on cuBLAS (skinny.WIDE_MAX_BYTES = 0)
Checks that variants running the same kernels generate the same tokens (plain and
`pdl, no wide` run wo on cuBLAS, the other two on the skinny kernel). Writes
OUT_DIR/decode_variants.csv. About 2 minutes (init, compiles).
"""
import csv
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ddbench.decode import build_model  # noqa: E402
from engine.config import preset  # noqa: E402
from engine.decode import Decoder  # noqa: E402
from engine.parallel import SimComm  # noqa: E402
from kernels import pdl, skinny  # noqa: E402

out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
concs = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "1,10").split(",")]
out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
cfg = preset("k2.6", tp=8, rank=0)
model, _ = build_model(cfg, SimComm(8, 0, lambda n: 0.0), None, "triton", "triton", 0, dev, "auto")
WIDE = skinny.WIDE_MAX_BYTES
VARIANTS = {"plain": dict(ENABLED=False, PREFETCH=True, WIDE=WIDE), "pdl": dict(ENABLED=True, PREFETCH=False, WIDE=WIDE),
            "pdl+prefetch": dict(ENABLED=True, PREFETCH=True, WIDE=WIDE),
            "pdl, no wide": dict(ENABLED=True, PREFETCH=True, WIDE=0)}
rows = []
for conc in concs:
    dec = Decoder(model, conc, 256)
    dec.prefill(torch.randint(0, cfg.vocab, (conc, 128), device=dev))
    start = dec._save()
    ref_tokens = {}   # wo on the skinny kernel? -> tokens of the first such variant
    for name, v in VARIANTS.items():
        pdl.ENABLED, pdl.PREFETCH, skinny.WIDE_MAX_BYTES = v["ENABLED"], v["PREFETCH"], v["WIDE"]
        dec._restore(start)
        dec.graph = None
        dec.capture()
        toks = []
        for _ in range(20):
            dec.advance()
            toks.append(dec.tok[:, 0].clone())
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(40)]
        for s, e in evs:
            s.record()
            dec.advance()
            e.record()
        torch.cuda.synchronize()
        us = [s.elapsed_time(e) * 1e3 for s, e in evs]
        toks = torch.stack(toks).cpu()
        ref = ref_tokens.setdefault(v["ENABLED"] and v["WIDE"] > 0, toks)
        rows.append(dict(concurrency=conc, variant=name, step_us=round(statistics.median(us), 1),
                         step_us_min=round(min(us), 1), step_us_max=round(max(us), 1),
                         same_tokens=bool(torch.equal(toks, ref))))
        print(rows[-1], flush=True)
    del dec
    torch.cuda.empty_cache()
pdl.ENABLED, pdl.PREFETCH, skinny.WIDE_MAX_BYTES = True, True, WIDE
with open(out / "decode_variants.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
print(f"\n{'c':>3} {'variant':<14} {'step us':>9} {'min':>8} {'max':>8} same tokens")
for r in rows:
    print(f"{r['concurrency']:>3} {r['variant']:<14} {r['step_us']:>9.1f} {r['step_us_min']:>8.1f} "
          f"{r['step_us_max']:>8.1f} {r['same_tokens']}")
