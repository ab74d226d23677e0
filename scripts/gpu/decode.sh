#!/usr/bin/env bash
# ddbench decode on one H200: the engine core. Steps, each independent:
#   (the benchmark runs first so a capped call still measures it)
#   1. engine kernel tests in bf16 + fp32 (tests/test_engine_kernels.py) and the GPU tests of
#      tests/test_engine.py (CUDA-graph decode == eager decode, graph phase timing, bf16 GPU
#      path vs the fp32 torch path, the simulated-rank CLI on the tiny preset), the bf16
#      skinny GEMM tests at K2.6 shapes incl. the fused norm prologue and the SiLU / rope /
#      k-row-sum epilogues and the router top-k side job, fused_moe's x_half / sum_k options,
#      and the decode chain launched with PDL against plain launches (tests/test_pdl.py) (~60 s)
#   2. ddbench decode --preset k2.6 --tp 8 --simulate-rank 0 at concurrency 1 and 10:
#      the full 61-layer TP-8 rank-0 shard (~76 GB: 71 GB INT4 experts + 5 GB bf16) with
#      random weights drawn on the GPU, CUDA graph per step, all-reduces modelled with the
#      nvlink-h200 all-reduce model; prompt 128, 64 new tokens
#   3. ddbench report on the CSV (stacked per-phase step time)
#   (the kernel-by-kernel profile and the skinny-GEMM bench are experiments:
#    experiments/README.md)
# Writes results/<gpu>/decode/<UTC stamp>.{csv,json}, its plot under results/report/decode/ and
# logs/decode_gpu_<stamp>.log; the run's files are copied to $OUT if set.
# Expected runtime: about 3-4 minutes (init ~20 s, Triton compiles ~30-60 s, decode < 30 s).
cd "$(dirname "$0")/../.."
. scripts/gpu/lib.sh
set -o pipefail
export PYTHONUNBUFFERED=1
dir=$RES/decode
stamp=$(date -u +%Y%m%d-%H%M%S)
mkdir -p "$dir" logs
log() { tee -a "logs/decode_gpu_$stamp.log"; }


timeout 300 python3 -m ddbench decode --preset k2.6 --tp 8 --simulate-rank 0 --concurrency 1,10 \
  --prompt-len 128 --new-tokens 64 --allreduce-model nvlink-h200 --out "$dir" --name "$stamp" 2>&1 | log \
  || echo "FAILED decode k2.6 tp8 simulated rank 0"

timeout 150 python3 -m pytest -q tests/test_engine_kernels.py 2>&1 | log || echo "FAILED engine kernel tests"
timeout 150 python3 -m pytest -q -m gpu tests/test_engine.py 2>&1 | log || echo "FAILED engine gpu tests"
timeout 90 python3 -m pytest -q -m gpu tests/test_pdl.py 2>&1 | log || echo "FAILED PDL chain gpu test"
timeout 120 python3 -m pytest -q -m gpu tests/test_skinny.py 2>&1 | log || echo "FAILED skinny gpu tests"
timeout 60 python3 -m pytest -q tests/test_moe_triton.py -k x_half_and_rows 2>&1 | log || echo "FAILED moe x_half/sum_k test"

timeout 60 python3 -m ddbench report "$dir" --out results/report/decode 2>&1 | log || echo "FAILED decode report"

[ -n "$OUT" ] && mkdir -p "$OUT/decode" && cp "$dir/$stamp".* "logs/decode_gpu_$stamp.log" "$OUT/decode/"

STAMP=$stamp python3 - <<'PY' || echo "FAILED decode summary"
import glob, json, os
import pandas as pd
pd.set_option("display.width", 250)
for f in sorted(glob.glob(f"{os.environ['RES']}/decode/{os.environ['STAMP']}.csv")):
    d = pd.read_csv(f)
    meta = json.load(open(f[:-4] + ".json"))
    print(f"\n== {f}: {meta.get('preset')} tp={meta.get('tp')} {meta.get('mode')} init={meta.get('init')} "
          f"init_s={meta.get('init_s')} mem={meta.get('gpu_mem_allocated_gib')}/{meta.get('gpu_mem_peak_gib')} GiB "
          f"completed={meta.get('completed')} {meta.get('error', '')}")
    cols = ["concurrency", "cuda_graph", "phase_method", "step_us", "comm_us", "step_total_us",
            "output_tok_per_s", "attention_us", "moe_us", "mlp_us", "lm_head_us", "other_us", "phases_sum_us",
            "floor_us", "floor_ratio", "moe_backend", "attn_backend"]
    print(d[[c for c in cols if c in d]].to_string(index=False, float_format=lambda v: f"{v:.1f}"))
PY
