#!/usr/bin/env bash
# Every GPU test and benchmark in one call (run from the repo root on the GPU machine):
#   bash scripts/gpu_check.sh [area ...]     areas: pack moe allreduce tree decode e2e (default: all)
# Each area's script writes CSVs + sidecars under results/h200/ and prints a summary; this
# script keeps each area's log, runs the GPU-marked tests, and prints all summaries last.
# When $OUT is set (the device tool), results and logs come back as two tarballs.
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
areas=${*:-pack moe allreduce tree decode e2e}
final_out=${OUT:-}
export OUT=/tmp/ddbench-gpu-out
mkdir -p "$OUT" logs
python3 -m ddbench env --json logs/env.json > logs/env.log 2>&1
for a in $areas; do
  start=$(date +%s)
  if [ -f "scripts/gpu/$a.sh" ]; then
    bash "scripts/gpu/$a.sh" > "logs/$a.log" 2>&1; rc=$?
  else
    echo "no scripts/gpu/$a.sh" > "logs/$a.log"; rc=127
  fi
  echo "== $a: rc=$rc in $(( $(date +%s) - start )) s" | tee -a logs/summary.log
done
python3 -m pytest -q -m gpu tests > logs/pytest_gpu.log 2>&1
echo "== pytest -m gpu: $(tail -1 logs/pytest_gpu.log)" | tee -a logs/summary.log
if [ -n "$final_out" ]; then
  tar czf "$final_out/results_h200.tar.gz" results/h200 2>/dev/null
  tar czf "$final_out/logs.tar.gz" logs "$OUT" 2>/dev/null
fi
for a in $areas; do echo "---- $a (last lines)"; tail -n 15 "logs/$a.log"; done
cat logs/summary.log
