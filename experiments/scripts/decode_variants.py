"""The CUDA-graph decode step with each launch-saving option switched off in turn, or with
another launch shape (TRIALS) (H200, K2.6 TP-8 rank-0 shard), so each option's gain is
measured in the step it is for.

python3 -m experiments.scripts.decode_variants [OUT_DIR] [CONCURRENCY,...] [OPTION,...]: builds the rank-0 shard
with random weights once, prefills 128 tokens, then for each variant re-captures the step
graph from the same state and times 40 back-to-back replays (after 20 untimed ones). A
variant sets module attributes (`VARIANTS`); `default` changes none, `all off` all of them (all
OPTIONS, or those named in the third argument, which may also name TRIALS: `try ..` each; `try all`: every trial).
`same_tokens`: the variant's 20 greedy tokens equal default's (options that change the
rounding order may flip a token of the random-weight model; informational). Writes
OUT_DIR/decode_variants.csv. About 2-3 minutes (init, compiles).

Ablations (`skip ..`, also named in the third argument): one launch (kind) of every layer
returns the outputs of its first call without launching (wrong tokens, real timing): the
step's time without it, i.e. what that launch costs on the step's critical path, PDL
overlap and side stream included (a profile's kernel times cannot show that).
"""
import csv
import importlib
import statistics
import sys
from pathlib import Path

import torch

from ddbench.engine.build import build_model
from ddbench.engine import model as em
from ddbench.engine.config import preset
from ddbench.engine.decode import Decoder
from ddbench.engine.parallel import RowParallelLinear, SimComm
from ddbench.kernels import mla_decode, moe_decode, moe_gemv, skinny

OPTIONS = {  # option -> [(module, attribute, value that switches it off), ..]
    "pdl": [("ddbench.kernels.pdl", "ENABLED", False)],
    "pdl trigger": [("ddbench.kernels.pdl", "TRIGGER", False)],
    "fused route": [("ddbench.kernels.skinny", "FUSE_ROUTE", False)],
    "fused moe act": [("ddbench.kernels.moe_gemv", "FUSE_ACT", False)],
    "shared expert stream": [("ddbench.engine.model", "SIDE_STREAM", False)],
    "attention chunks 32 capped": [("ddbench.kernels.mla_attn", "MIN_CHUNK", 64), ("ddbench.kernels.mla_attn", "MAX_CHUNKS", 0)],
    "skinny preload": [("ddbench.kernels.skinny", "PRELOAD", False)],
    "attention merge + value projection": [("ddbench.kernels.mla_attn", "FUSE_PROJ", False)],
    "cuda gemv for wq_b": [("ddbench.kernels.skinny", "CUDA_GEMV", frozenset())],
    "mla decode in one launch": [("ddbench.kernels.mla_decode", "ENABLED", False)],
}
_gemv = importlib.import_module("ddbench.kernels.moe_triton").TILE_TABLE
_row0 = _gemv[0]


def _gemv_row0(**change) -> list:
    """TILE_TABLE with its first row (decode sizes: the CUDA-core MoE) changed."""
    return [(_row0[0], {**_row0[1], **change})] + _gemv[1:]


# Launch shapes to try against the defaults of this tree (each knob's current value is the one
# the trials in experiments/results/decode_trials_*.csv chose; those CSVs name the trials of
# their day, some of which were the later defaults).
TRIALS = {  # trial -> [(module, attribute, value), ..]
    "skinny 1 program/SM": [("ddbench.kernels.skinny", "PROGRAMS_PER_SM", 1)],
    "skinny 3 programs/SM": [("ddbench.kernels.skinny", "PROGRAMS_PER_SM", 3)],
    "skinny 4 programs/SM": [("ddbench.kernels.skinny", "PROGRAMS_PER_SM", 4)],
    "skinny tile 2k": [("ddbench.kernels.skinny", "TILE_VALUES", 2048)],
    "skinny tile 8k": [("ddbench.kernels.skinny", "TILE_VALUES", 8192)],
    "skinny tile 16k": [("ddbench.kernels.skinny", "TILE_VALUES", 16384)],
    "skinny 3 stages": [("ddbench.kernels.skinny", "NUM_STAGES", 3)],
    "skinny 5 stages": [("ddbench.kernels.skinny", "NUM_STAGES", 5)],
    "skinny 6 stages": [("ddbench.kernels.skinny", "NUM_STAGES", 6)],
    "skinny 8 warps": [("ddbench.kernels.skinny", "NUM_WARPS", 8)],
    "skinny for wo (N = 7K)": [("ddbench.kernels.skinny", "MAX_N_OVER_K", 8)],
    "cuda gemv": [("ddbench.kernels.skinny", "CUDA_GEMV", frozenset({"linear", "head", "add", "rope", "norm"}))],
    "cuda gemv linear": [("ddbench.kernels.skinny", "CUDA_GEMV", frozenset({"linear"}))],
    "cuda gemv head": [("ddbench.kernels.skinny", "CUDA_GEMV", frozenset({"head"}))],
    "cuda gemv rope + linear": [("ddbench.kernels.skinny", "CUDA_GEMV", frozenset({"rope", "linear"}))],
    "cuda gemv rope + linear + add": [("ddbench.kernels.skinny", "CUDA_GEMV", frozenset({"rope", "linear", "add"}))],
    "cuda gemv add": [("ddbench.kernels.skinny", "CUDA_GEMV", frozenset({"add"}))],
    "cuda gemv linear + add": [("ddbench.kernels.skinny", "CUDA_GEMV", frozenset({"linear", "add"}))],
    "cuda gemv rope": [("ddbench.kernels.skinny", "CUDA_GEMV", frozenset({"rope"}))],
    "cuda gemv rope + linear at 118 KB": [("ddbench.kernels.skinny", "CUDA_GEMV", frozenset({"rope", "linear"})),
                                                 ("ddbench.kernels.gemv", "SHARED_BUDGET", 118 * 1024)],
    "cuda gemv rope + add": [("ddbench.kernels.skinny", "CUDA_GEMV", frozenset({"rope", "add"}))],
    "cuda gemv rope + norm": [("ddbench.kernels.skinny", "CUDA_GEMV", frozenset({"rope", "norm"}))],
    "cuda gemv rope + norm + add": [("ddbench.kernels.skinny", "CUDA_GEMV", frozenset({"rope", "norm", "add"}))],
    "cuda gemv rope + linear + add + norm": [("ddbench.kernels.skinny", "CUDA_GEMV",
                                              frozenset({"rope", "linear", "add", "norm"}))],
    "cuda gemv norm": [("ddbench.kernels.skinny", "CUDA_GEMV", frozenset({"norm"}))],
    "skinny up to 16 rows": [("ddbench.kernels.skinny", "MAX_ROWS", 16)],
    "gemv 4 stages": [("ddbench.kernels.moe_triton", "TILE_TABLE", _gemv_row0(num_stages=4))],
    "gemv 6 stages": [("ddbench.kernels.moe_triton", "TILE_TABLE", _gemv_row0(num_stages=6))],
    "gemv 2 warps": [("ddbench.kernels.moe_triton", "TILE_TABLE", _gemv_row0(num_warps=2))],
    "gemv 8 warps": [("ddbench.kernels.moe_triton", "TILE_TABLE", _gemv_row0(num_warps=8))],
    "gemv block_m 2": [("ddbench.kernels.moe_triton", "TILE_TABLE", _gemv_row0(block_m=2))],
    "gemv block_m 4": [("ddbench.kernels.moe_triton", "TILE_TABLE", _gemv_row0(block_m=4))],
    "gemv block_m 8": [("ddbench.kernels.moe_triton", "TILE_TABLE", _gemv_row0(block_m=8))],
    "attention projection 8 rows": [("ddbench.kernels.mla_attn", "PROJ_BLOCK_V", 8)],
    "attention projection 32 rows": [("ddbench.kernels.mla_attn", "PROJ_BLOCK_V", 32)],
    "gemv w13 128 columns": [("ddbench.kernels.moe_triton", "TILE_TABLE", _gemv_row0(block_n13=128))],
    "gemv w13 256 columns": [("ddbench.kernels.moe_triton", "TILE_TABLE", _gemv_row0(block_n13=256))],
    "gemv w13 512 columns": [("ddbench.kernels.moe_triton", "TILE_TABLE", _gemv_row0(block_n13=512))],
    "gemv w13 512 columns + splits <= 28": [("ddbench.kernels.moe_triton", "TILE_TABLE", _gemv_row0(block_n13=512)),
                                            ("ddbench.kernels.moe_gemv", "MAX_SPLITS", 28)],
    "gemv w2 128 columns": [("ddbench.kernels.moe_triton", "TILE_TABLE", _gemv_row0(block_n2=128))],
    "gemv w2 512 columns": [("ddbench.kernels.moe_triton", "TILE_TABLE", _gemv_row0(block_n2=512))],
    "gemv splits 1/SM": [("ddbench.kernels.moe_gemv", "SPLIT_PROGRAMS_PER_SM", 1)],
    "gemv splits 2/SM": [("ddbench.kernels.moe_gemv", "SPLIT_PROGRAMS_PER_SM", 2)],
    "gemv splits 3/SM": [("ddbench.kernels.moe_gemv", "SPLIT_PROGRAMS_PER_SM", 3)],
    "gemv splits 8/SM": [("ddbench.kernels.moe_gemv", "SPLIT_PROGRAMS_PER_SM", 8)],
    "gemv splits <= 28": [("ddbench.kernels.moe_gemv", "MAX_SPLITS", 28)],
    "attention 2 waves": [("ddbench.kernels.mla_attn", "DECODE_WAVES", 2.0)],
    "attention 4 waves": [("ddbench.kernels.mla_attn", "DECODE_WAVES", 4.0)],
    "attention 64-position tiles": [("ddbench.kernels.mla_attn", "DECODE_BLOCK_N", 64)],
    "attention 2 stages": [("ddbench.kernels.mla_attn", "DECODE_STAGES", 2)],
    "attention 4 stages": [("ddbench.kernels.mla_attn", "DECODE_STAGES", 4)],
    "attention 2 warps": [("ddbench.kernels.mla_attn", "DECODE_WARPS", 2)],
    "attention 8 warps": [("ddbench.kernels.mla_attn", "DECODE_WARPS", 8)],
}

def skipped(fn, when=None):
    """fn, except for the calls where `when(*args, **kw)` (default: all): those return the
    outputs of the first such call with the same tensor shapes, launching nothing (the first
    comes in the eager warm-up before the graph capture)."""
    first = {}

    def stub(*args, **kw):
        if when is not None and not when(*args, **kw):
            return fn(*args, **kw)
        key = tuple((tuple(a.shape), a.dtype) for a in (*args, *kw.values()) if torch.is_tensor(a))
        if key not in first:
            first[key] = fn(*args, **kw)
        return first[key]
    return stub


def _skip(owner, attr: str, when=None) -> list:
    """An ablation's setting: owner.attr replaced by `skipped(owner.attr, when)`."""
    return [(owner, attr, skipped(getattr(owner, attr), when))]


def _skip_wo(m) -> list:
    wo = {id(blk.attn.wo) for blk in m.layers}
    return _skip(RowParallelLinear, "forward", lambda lin, *a, **k: id(lin) in wo)


ABLATIONS = {  # name -> (model -> [(owner, attribute, stub), ..]); a MoE layer's launches in order
    "skip wqkv_a + attn norm": lambda m: _skip(em.Ops, "norm_linear", lambda *a, glu=False: not glu),
    "skip mla_a_post": lambda m: _skip(m.ops, "mla_a_post"),
    "skip wq_b + rope": lambda m: _skip(em.Ops, "rope_linear"),
    "skip q absorption": lambda m: _skip(em, "heads_linear"),
    "skip attention + value projection": lambda m: [s for blk in m.layers for s in _skip(blk.attn, "attend")],
    "skip mla decode (one launch)": lambda m: _skip(mla_decode, "mla_decode"),
    "skip wo": _skip_wo,
    "skip router + ffn norm + top-k": lambda m: _skip(skinny, "norm_linear", lambda *a, route=None, **k: route is not None),
    "skip shared expert gate/up": lambda m: _skip(em.Ops, "glu_linear"),
    "skip MoE w13 + act": lambda m: _skip(moe_gemv, "gemv_w13"),
    "skip MoE w2": lambda m: _skip(moe_gemv, "gemv_w2"),
    "skip MoE w2 (CUDA)": lambda m: _skip(moe_decode, "decode_w2"),
    "skip shared expert down + k-sum": lambda m: _skip(em.MLP, "down", lambda *a, add_rows=1, **k: add_rows > 1),
    "skip lm_head": lambda m: _skip(m.head, "forward"),
}
pick = sys.argv[3].split(",") if len(sys.argv) > 3 else list(OPTIONS)
if "skip all" in pick:
    pick = [k for k in pick if k != "skip all"] + list(ABLATIONS)
if "try all" in pick:
    pick = [k for k in pick if k != "try all"] + list(TRIALS)
unknown = [k for k in pick if k not in OPTIONS and k not in TRIALS and k not in ABLATIONS]
if unknown:
    sys.exit(f"unknown option or trial {unknown}: options {list(OPTIONS)}, trials {list(TRIALS)}, "
             f"ablations {list(ABLATIONS)} ('skip all', 'try all': each)")
present = {k: v for k, v in OPTIONS.items()
           if k in pick and all(hasattr(importlib.import_module(m), a) for m, a, _ in v)}
for k in set(pick) & OPTIONS.keys() - present.keys():
    print(f"note: option {k!r} ({OPTIONS[k]}) not in this tree, skipped")
VARIANTS = {"default": [], **{f"no {k}": [k] for k in present}, **({"all off": list(present)} if present else {}),
            **{f"try {k}": [k] for k in pick if k in TRIALS}, **{k: [k] for k in pick if k in ABLATIONS}}

out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
concs = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "1,10").split(",")]
out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
cfg = preset("k2.6", tp=8, rank=0)
model, _ = build_model(cfg, SimComm(8, 0, lambda n: 0.0), None, "triton", "triton", 0, dev, "auto")
SETTINGS = {k: [(importlib.import_module(m) if isinstance(m, str) else m, a, v) for m, a, v in settings]
            for k, settings in {**present, **{k: v for k, v in TRIALS.items() if k in pick},
                                **{k: ABLATIONS[k](model) for k in pick if k in ABLATIONS}}.items()}
# every attribute a variant sets, with its value now (an instance's own or its class's)
defaults = {(id(o), a): (o, a, getattr(o, a)) for v in SETTINGS.values() for o, a, _ in v}
own = {(id(o), a) for v in SETTINGS.values() for o, a, _ in v if a in vars(o)}


def apply(chosen: list[str]) -> None:
    """Set the chosen options off / trials and ablations on, everything else to its default."""
    for key, (o, a, v) in defaults.items():
        if key in own:
            setattr(o, a, v)
        elif a in vars(o):
            delattr(o, a)   # an instance attribute set by a variant: the class's shows again
    for k in chosen:
        for o, a, v in SETTINGS[k]:
            setattr(o, a, v)


rows = []


def save() -> None:
    """The rows so far to OUT_DIR/decode_variants.csv (after each variant: a run cut short keeps them)."""
    with open(out / "decode_variants.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


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
        save()
    dec.graph = None
    del dec
    torch.cuda.empty_cache()
apply([])
print(f"\n{'c':>3} {'variant':<26} {'step us':>9} {'min':>8} {'max':>8} same tokens")
for r in rows:
    print(f"{r['concurrency']:>3} {r['variant']:<26} {r['step_us']:>9.1f} {r['step_us_min']:>8.1f} "
          f"{r['step_us_max']:>8.1f} {r['same_tokens']}")
