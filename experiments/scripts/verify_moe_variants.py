"""The DDTree step with the verify MoE's row blocks changed (H200, K2.6 TP-8 rank-0 shard).

python3 -m experiments.scripts.verify_moe_variants [CONCURRENCY,...] [BLOCK_M,...] [PER_EXPERT]: builds the
target and drafter once, then for each BLOCK_M sets `kernels.moe_triton.STREAM_TILES` to
[(PER_EXPERT, BLOCK_M)] (default 0.3: a stream's several tokens take the CUDA-core MoE
path up to that many tokens per expert, sorted into blocks of BLOCK_M rows; 1: one row a block)
runs `ddbench e2e`'s measurement (AR, then DDTree budget 8 at synthetic TAU 6, prompt 128,
32 new tokens) from a fresh prefill and prints the step, verify and verify-MoE times. Not
projected: no modelled communication. About 1.5 minutes.
"""
import sys

import torch

import ddbench.kernels.moe_triton as mt
from ddbench.e2e import build_engine, run_concurrency
from ddbench.engine.config import preset
from ddbench.engine.drafter import drafter_config
from ddbench.engine.parallel import SimComm
from ddbench.engine.spec import parse_acceptance

concs = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "1,10").split(",")]
blocks = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,8,16").split(",")]
bound = float(sys.argv[3]) if len(sys.argv) > 3 else 0.3
cfg = preset("k2.6", tp=8, rank=0)
model, drafter, _ = build_engine(cfg, SimComm(8, 0, lambda n: 0.0), None, "triton", "triton", 0,
                                 torch.device("cuda"), "auto")
acc = parse_acceptance("synthetic:6", drafter_config(cfg).depth)
keys = ("step_us", "verify_us", "verify_moe_us", "mean_accepted", "output_tok_per_s")
default = mt.STREAM_TILES
for c in concs:
    for bm in blocks:
        mt.STREAM_TILES = [(bound, bm)]
        rows = []
        run_concurrency(model, drafter, c, [8], [acc], [128], 32, None, True, None, {}, 0, rows.append)
        for r in rows:
            if r["budget"]:
                print(c, bm, {k: r[k] for k in keys}, flush=True)
mt.STREAM_TILES = default
