"""The CUDA-graph decode step with each launch-saving option switched off in turn (H200,
K2.6 TP-8 rank-0 shard), so each option's gain is measured in the step it is for.

python3 scripts/gpu/decode_variants.py [OUT_DIR] [CONCURRENCY,...] [OPTION,...]: builds the rank-0 shard
with random weights once, prefills 128 tokens, then for each variant re-captures the step
graph from the same state and times 40 back-to-back replays (after 20 untimed ones). A
variant sets module attributes (`VARIANTS`); `default` changes none, `all off` all of them (all
OPTIONS, or those named in the third argument).
`same_tokens`: the variant's 20 greedy tokens equal default's (options that change the
rounding order may flip a token of the random-weight model; informational). Writes
OUT_DIR/decode_variants.csv. About 2-3 minutes (init, compiles).
"""
import csv
import importlib
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ddbench.decode import build_model  # noqa: E402
from engine.config import preset  # noqa: E402
from engine.decode import Decoder  # noqa: E402
from engine.parallel import SimComm  # noqa: E402

OPTIONS = {  # option -> [(module, attribute, value that switches it off), ..]
    "pdl": [("kernels.pdl", "ENABLED", False)],
    "pdl trigger": [("kernels.pdl", "TRIGGER", False)],
    "fused route": [("kernels.skinny", "FUSE_ROUTE", False)],
    "fused moe act": [("kernels.moe_gemv", "FUSE_ACT", False)],
    "shared expert stream": [("engine.model", "SIDE_STREAM", False)],
    "attention chunks 32 capped": [("kernels.mla_attn", "MIN_CHUNK", 64), ("kernels.mla_attn", "MAX_CHUNKS", 0)],
    "attention one launch": [("kernels.mla_attn", "FUSE_COMBINE", False)],
    "moe one launch": [("kernels.moe_gemv", "FUSE_W2", False)],
    "moe one launch w2 256 columns": [("kernels.moe_gemv", "W2_WORDS", 4096)],
}
pick = sys.argv[3].split(",") if len(sys.argv) > 3 else list(OPTIONS)
present = {k: v for k, v in OPTIONS.items()
           if k in pick and all(hasattr(importlib.import_module(m), a) for m, a, _ in v)}
for k in set(pick) & OPTIONS.keys() - present.keys():
    print(f"note: option {k!r} ({OPTIONS[k]}) not in this tree, skipped")
VARIANTS = {"default": [], **{f"no {k}": [k] for k in present}, "all off": list(present)}

out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
concs = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "1,10").split(",")]
out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
cfg = preset("k2.6", tp=8, rank=0)
model, _ = build_model(cfg, SimComm(8, 0, lambda n: 0.0), None, "triton", "triton", 0, dev, "auto")
defaults = {(m, a): getattr(importlib.import_module(m), a) for v in present.values() for m, a, _ in v}


def apply(off: list[str]) -> None:
    for k, triples in present.items():
        for m, a, v in triples:
            setattr(importlib.import_module(m), a, v if k in off else defaults[(m, a)])


rows = []
for conc in concs:
    dec = Decoder(model, conc, 256)
    dec.prefill(torch.randint(0, cfg.vocab, (conc, 128), device=dev))
    start = dec._save()
    ref = None
    for name, off in VARIANTS.items():
        apply(off)
        dec._restore(start)
        dec.graph = None
        try:
            dec.capture()
        except Exception as e:  # noqa: BLE001 - report the variant and go on
            print(f"FAILED variant {name!r} at c={conc}: {type(e).__name__}: {e}", flush=True)
            continue
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
        ref = toks if ref is None else ref
        rows.append(dict(concurrency=conc, variant=name, step_us=round(statistics.median(us), 1),
                         step_us_min=round(min(us), 1), step_us_max=round(max(us), 1),
                         same_tokens=bool(torch.equal(toks, ref))))
        print(rows[-1], flush=True)
    dec.graph = None
    del dec
    torch.cuda.empty_cache()
apply([])
with open(out / "decode_variants.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
print(f"\n{'c':>3} {'variant':<26} {'step us':>9} {'min':>8} {'max':>8} same tokens")
for r in rows:
    print(f"{r['concurrency']:>3} {r['variant']:<26} {r['step_us']:>9.1f} {r['step_us_min']:>8.1f} "
          f"{r['step_us_max']:>8.1f} {r['same_tokens']}")
