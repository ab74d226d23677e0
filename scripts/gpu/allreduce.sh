#!/usr/bin/env bash
# ddbench allreduce on one H200 (world size 1: the NCCL path and its launch overhead;
# the multi-GPU measurement is a separate issue). Steps, each independent:
#   1. the GPU tests of tests/test_allreduce.py (nccl, 1 rank, eager + graph)
#   2. the launcher: --gpus 1, eager + CUDA graph, 8 B .. 256 MiB + TP decode messages, --model
#   3. the torchrun path: torch.distributed.run --nproc-per-node 1, eager + graph, up to 1 MiB
#   4. ddbench report on these CSVs (busbw and time-vs-size plots)
# Writes results/<gpu>/allreduce/<UTC stamp>_1gpu and _torchrun_1gpu (CSV + JSON sidecar), plots under
# results/report/allreduce/, logs/allreduce_gpu_<stamp>.log; the run's files are copied to $OUT if set.
# Expected runtime: about 1-2 minutes (well under 4).
cd "$(dirname "$0")/../.."
. scripts/gpu/lib.sh
set -o pipefail  # a step fails when its command fails, not its tee
stamp=$(date -u +%Y%m%d-%H%M%S)
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
dir=$RES/allreduce
mkdir -p "$dir" logs
log() { tee -a "logs/allreduce_gpu_$stamp.log"; }

timeout 240 python3 -m pytest -q -m gpu tests/test_allreduce.py 2>&1 | log || echo "FAILED allreduce gpu tests"

timeout 240 python3 -m ddbench allreduce --backend nccl --gpus 1 --max-bytes 256M --tokens 1,16,160,512 \
  --mode both --model --name ${stamp}_1gpu --out "$dir" 2>&1 | log || echo "FAILED allreduce 1-gpu sweep"

timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m ddbench allreduce \
  --backend nccl --max-bytes 1M --tokens 1,16 --reps 10 --name ${stamp}_torchrun_1gpu --out "$dir" 2>&1 | log \
  || echo "FAILED allreduce under torchrun"

timeout 120 python3 -m ddbench report "$dir" --out results/report/allreduce 2>&1 | log || echo "FAILED allreduce report"

[ -n "$OUT" ] && mkdir -p "$OUT/allreduce" && cp "$dir/$stamp"_* "logs/allreduce_gpu_$stamp.log" "$OUT/allreduce/"

STAMP=$stamp python3 - <<'PY' || echo "FAILED allreduce summary"
import glob, json, os
import pandas as pd
for f in sorted(glob.glob(f"{os.environ['RES']}/allreduce/{os.environ['STAMP']}_*.csv")):
    d = pd.read_csv(f)
    print(f"\n== {f}: {len(d)} rows, wrong total {int(d.wrong.sum())}")
    pick = d[(d.tokens > 0) | d.size_bytes.isin([8, 2**16, 2**20, 2**24, 2**28])]
    print(pick[["mode", "size_bytes", "tokens", "time_us", "time_us_p20", "time_us_p80", "algbw_gbps",
                "wrong"]].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    meta = json.load(open(f[:-4] + ".json"))
    for name, m in (meta.get("model") or {}).items():
        print(f"model {name}: lat {m['lat_us']:.2f} us, busbw {m['busbw_gbps']}, "
              f"decode step us (T=1,16,160) {[round(v, 1) for v in m['decode_step_us'].values()]}")
PY
