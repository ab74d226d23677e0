"""The dense GEMVs of K2.6 TP-8 decode layers (c=1) as one chain: kernel boundaries vs grid barriers (H200).

python3 -m experiments.scripts.chain_probe [OUT_DIR] [LAYERS] [BK,...] [PROGRAMS_PER_SM,...]
[SLOTS[xKB][sSPLIT][rRB][vVECS][f][p],...]: per layer the six one-row products of a rank-0
shard, each reading the one before (wqkv_a 2112x7168 -> wq_b 1536x1536 -> wo 7168x1024 ->
router 384x7168 and shared w13 512x7168 (both from wo's output) -> shared w2 7168x256 -> the
next layer's wqkv_a), 66 MB of bf16 weights a layer, LAYERS layers (default
4: 264 MB, more than L2, so every replay reads DRAM). Variants, each a CUDA graph replayed back
to back: `skinny` the engine's kernels (kernels.skinny, cuBLAS where N > K; PDL), `cuda` /
`cuda-nopdl` kernels.gemv (CUDA: up to ~100 KB of weights a program loaded before the PDL wait), then
experiments.chain's kernel as `launch` (one launch a phase, PDL), `preload` (the same, first chunk
loaded before the PDL wait), `barrier` (one persistent launch, grid barriers), `prefetch`
(barriers, the next phase's first chunk loaded while waiting), each with 1 and 2 programs an
SM (all resident: the barrier needs it), and `dataflow` (experiments.dataflow: one persistent CUDA
launch whose weight stream runs ahead of the dependencies through a ring of shared memory,
a completion counter a phase; a ring spec SLOTS[xKB][sSPLIT][rRB][vVECS][f][p]: slots (of
KB), warps a consumer team, rows it multiplies at once, vectors of each it loads first, f:
tiles as full as a slot instead of spread over every team, p: a publisher lane; also on the
same phases without dependencies, each reading the input: its stream
alone). Checks
each against the fp32 torch chain; prints us a layer, GB/s and the ratio to the bytes floor
(weights / measured copy bandwidth). Last, the cost of a dependency alone: a chain of 48 tiny
phases (256 x 256), us a phase, each variant. Writes OUT_DIR/chain_probe.csv. About 30 s.
"""
import csv
import re
import sys
from pathlib import Path

import torch

from ddbench.timing import bench, copy_bandwidth_gbps
from ddbench.engine.config import preset
from ddbench.kernels import gemv
from experiments import chain, dataflow
from ddbench.kernels.device import sm_count
from ddbench.kernels.skinny import linear

out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
out.mkdir(parents=True, exist_ok=True)
layers = int(sys.argv[2]) if len(sys.argv) > 2 else 4
bks = [int(b) for b in (sys.argv[3] if len(sys.argv) > 3 else "256,512").split(",")]
per_sm = [int(b) for b in (sys.argv[4] if len(sys.argv) > 4 else "1,2").split(",")]
ring = (sys.argv[5] if len(sys.argv) > 5 else str(dataflow.SLOTS)).split(",")   # dataflow: SLOTS[xKB][sSPLIT][rRB][vVECS][f][p]
RING = re.compile(r"(\d+)(?:x(\d+))?(?:s(\d))?(?:r(\d))?(?:v(\d+))?(f?)(p?)")
if any(RING.fullmatch(n) is None for n in ring):
    raise SystemExit(f"ring specs {ring}: each SLOTS[xKB][sSPLIT][rRB][vVECS][f][p], in that order")
dev = torch.device("cuda")
copy = copy_bandwidth_gbps(dev)
dense = preset("k2.6", tp=8).dense_shapes()
shapes = chain.layers(dense, layers)


def skinny_chain(c: chain.Chain):
    """The same chain through the engine's GEMM kernels (bf16 activations)."""
    x_in = c.input().to(torch.bfloat16)[None]
    ws = [c.weight(p) for p in range(len(c.shapes))]

    def fn():
        outs = []
        for (n, k, src), w in zip(c.shapes, ws):
            outs.append(linear((x_in if src < 0 else outs[src])[:, :k], w))
        return outs[-1][0]
    return fn


def cuda_chain(c: chain.Chain, pdl: bool):
    """The same chain through kernels.gemv (CUDA: weights loaded before the PDL wait)."""
    x_in = c.input()[None].contiguous()
    ws = [c.weight(p) for p in range(len(c.shapes))]

    def fn():
        outs = []
        for (n, k, src), w in zip(c.shapes, ws):
            outs.append(gemv.gemv(w, (x_in if src < 0 else outs[src])[:, :k], pdl=pdl))
        return outs[-1][0]
    return fn


def variant(c: chain.Chain, mode: str):
    """The chain run as `mode`: skinny, cuda / cuda-nopdl, dataflow, or one of chain.MODES."""
    if mode == "skinny":
        return skinny_chain(c)
    if mode.startswith("cuda"):
        return cuda_chain(c, mode == "cuda")
    if mode.startswith("dataflow"):   # "dataflow SLOTS[xKB][sSPLIT][rRB][vVECS][f][p]": slots (KB), warps
        # a team, rows at once, vectors a row in flight, f: full tiles, p: a publisher lane
        spec = RING.fullmatch(mode.split()[1] if " " in mode else str(dataflow.SLOTS))
        slots, kb, split = int(spec[1]), spec[2], int(spec[3] or dataflow.SPLIT)
        rb, vecs = int(spec[4] or dataflow.RB), int(spec[5] or dataflow.VECS)
        pl = dataflow.plan(c, int(kb) * 1024 if kb else dataflow.SLOT, spread=not spec[6])

        def fn():
            return dataflow.run(pl, slots=slots, split=split, rb=rb, vecs=vecs, publisher=bool(spec[7]))
        fn.plan = pl   # for dataflow.gave_up
        return fn
    return lambda: chain.run(c, mode)


# the modes of kernels other than experiments.chain's are timed once, at the first BK and programs an
# SM; dataflow last: it writes the outputs without atomics, after which chain.MODES would not
# find the first phase's output zeroed
ORDER = ("skinny", "cuda", "cuda-nopdl") + chain.MODES + tuple(f"dataflow {n}" for n in ring)
rows = []
weight_bytes = sum(n * k * 2 for n, k, _ in shapes)
floor_us = weight_bytes / (copy * 1e3)
print(f"copy {copy:.0f} GB/s; {layers} layers, {weight_bytes / 1e6:.0f} MB of weights; "
      f"floor {floor_us / layers:.1f} us a layer", flush=True)


def record(mode: str, bk, pps, fn, per: int, err: float | None = None) -> None:
    """Time fn (a CUDA graph of one call, replayed back to back); a row with us per `per`
    (layers of the K2.6 chain, with GB/s and x floor; or tiny phases)."""
    st = bench(fn, device=dev, warmup=3, reps=30, graph=True, graph_ops=1)
    big = err is not None
    rows.append(dict(mode=mode, bk=bk, per_sm=pps, layers=layers if big else "",
                     us_per_layer=round(st.median_us / per, 2),
                     p20_us=round(st.p20_us / per, 2), p80_us=round(st.p80_us / per, 2),
                     gbps=round(weight_bytes / (st.median_us * 1e3), 1) if big else "",
                     x_floor=round(st.median_us / floor_us, 3) if big else "",
                     rel_err=f"{err:.1e}" if big else "", copy_gbps=round(copy)))
    print(rows[-1], flush=True)


for bk, pps in [(bk, pps) for bk in bks for pps in per_sm]:
    c = chain.build(shapes, dev, pps * sm_count(dev), bk=bk)
    ref = chain.reference(c)
    for mode in ORDER:
        if mode not in chain.MODES and (bk, pps) != (bks[0], per_sm[0]):
            continue
        fn = variant(c, mode)
        err = ((fn().float() - ref).norm() / ref.norm()).item()
        if err > 2e-2 or (hasattr(fn, "plan") and dataflow.gave_up(fn.plan)):
            print(f"WRONG: {mode} bk {bk} relative error {err:.1e}", flush=True)
        own = mode not in chain.MODES
        record(mode, "" if own else bk, "" if own else pps, fn, layers, err)
# the dataflow kernel's stream alone: the same phases, each reading the input (no dependencies)
free = chain.build(chain.layers(dense, layers, free=True), dev, sm_count(dev), bk=256)
free_ref = chain.reference(free)
for n in ring:
    fn = variant(free, f"dataflow {n}")
    err = ((fn().float() - free_ref).norm() / free_ref.norm()).item()
    record(f"dataflow {n}, no dependencies", "", "", fn, layers, err)
# the cost of a dependency alone: 48 phases of 256 x 256 (128 KB of weights each, L2-resident)
tiny = chain.build([(256, 256, p - 1) for p in range(48)], dev, sm_count(dev), bk=256)
for mode in ORDER:
    record(f"{mode} (256x256 phases)", 256, 1, variant(tiny, mode), 48)
with open(out / "chain_probe.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
print(f"\n| variant | BK | programs / SM | us a layer (a phase: tiny) (p20-p80) | GB/s | "
      f"x floor ({floor_us / layers:.1f} us) |\n|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['mode']} | {r['bk']} | {r['per_sm']} | {r['us_per_layer']} ({r['p20_us']}-{r['p80_us']}) "
          f"| {r['gbps']} | {r['x_floor']} |")
