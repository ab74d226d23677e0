#!/usr/bin/env bash
# The MoE act fused into w13 (kernels.moe_gemv.FUSE_ACT, issue 6) on one H200. Steps, each independent:
#   1. GPU tests of the CUDA-core MoE path (tests/test_moe_triton.py -k gemv: bit-identical to
#      the unfused launches at K2.6 TP-8 shapes, eager and in a replayed CUDA graph)
#   2. the whole MoE layer (K2.6 TP-8 rank shard, bf16, default tiles) at T = 1, 4, 10 tokens,
#      FUSE_ACT off and on, CUDA graph of 10 calls: results/h200/moe_act.csv (+ .json)
# Logs and copies go to $OUT if set. Expected runtime: about 1.5 minutes (well under 4).
cd "$(dirname "$0")/../.." || exit 1
R=results/h200
LOG=${OUT:-$R}/moe_act_logs
mkdir -p "$R" "$LOG"
export PYTHONUNBUFFERED=1

timeout 150 python3 -m pytest -q -m gpu tests/test_moe_triton.py -k gemv 2>&1 | tail -8 | tee "$LOG/moe_act_pytest.log" \
  || echo "FAILED step: moe_act gpu tests"

rm -f "$R/moe_act.csv" "$R/moe_act.json" "$R/moe_act.csv.partial"
timeout 150 python3 - <<'PY' 2>&1 | tee "$LOG/moe_act_bench.log" || echo "FAILED step: moe_act bench"
from pathlib import Path

import torch

from ddbench.results import ResultWriter, run_metadata
from ddbench.timing import bench
from engine.config import preset
from kernels import moe_gemv as mg
from kernels.moe import random_marlin_moe, synthetic_routing
from kernels.moe_triton import default_config, sm_count

cfg = preset("k2.6", tp=8)
dev = torch.device("cuda")
w = random_marlin_moe(cfg.n_experts, cfg.hidden, cfg.moe_inter_local, cfg.group_size, cfg.top_k, device=dev)
sms = sm_count(dev)
print(f"{'tokens':>6} {'fuse_act':>8} {'time_us':>9} {'p20':>9} {'p80':>9}")
with ResultWriter(Path("results/h200"), "moe_act", run_metadata("moe_act", preset="k2.6", tp=8), name="moe_act") as out:
    for tokens in (1, 4, 10):
        x = torch.randn(tokens, cfg.hidden, device=dev, dtype=torch.bfloat16)
        ids, tw = synthetic_routing("uniform", tokens, cfg.n_experts, cfg.top_k, device=dev, seed=tokens)
        mcfg = default_config(tokens, cfg.top_k, cfg.n_experts, cfg.moe_inter_local, cfg.hidden, sms)
        for fuse in (False, True):
            mg.FUSE_ACT = fuse
            s = bench(lambda: mg.fused_moe_gemv(x, ids, tw, w, mcfg, sms), device=dev, graph=True, reps=50)
            row = dict(tokens=tokens, fuse_act=fuse, block_m=mcfg.block_m, block_n13=mcfg.block_n13, **s.row())
            out.write(row)
            print(f"{tokens:>6} {str(fuse):>8} {row['time_us']:>9.2f} {row['time_us_p20']:>9.2f} {row['time_us_p80']:>9.2f}")
PY

[ -n "$OUT" ] && cp "$R"/moe_act.csv "$R"/moe_act.json "$OUT"/ 2>/dev/null
true
