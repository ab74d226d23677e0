#!/usr/bin/env bash
# Every GPU test and benchmark in one call (run from the repo root on the GPU machine):
#   bash scripts/gpu_check.sh [area ...]     areas: pack moe allreduce tree decode e2e (default: all)
# Each area's script (scripts/gpu/AREA.sh) runs its GPU tests and benchmarks, writes CSVs +
# sidecars under results/h200/ and prints a summary; this script caps each area at CAP_AREA
# seconds (default 300), keeps each area's log, and prints all summaries last.
# When $OUT is set (the device tool), results and logs come back as two tarballs, refreshed
# after every area so a call cut short still returns what was done.
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
areas=${*:-pack moe allreduce tree decode e2e}
final_out=${OUT:-}
export OUT=/tmp/ddbench-gpu-out
mkdir -p "$OUT" logs
python3 -m ddbench env --json logs/env.json > logs/env.log 2>&1
for a in $areas; do
  start=$(date +%s)
  cap_var="CAP_$a"; cap=${!cap_var:-300}; [ "$a" = decode ] && cap=${CAP_decode:-420}
  if [ -f "scripts/gpu/$a.sh" ]; then
    timeout -s INT -k 15 "$cap" bash "scripts/gpu/$a.sh" > "logs/$a.log" 2>&1; rc=$?
  else
    echo "no scripts/gpu/$a.sh" > "logs/$a.log"; rc=127
  fi
  echo "== $a: rc=$rc in $(( $(date +%s) - start )) s (cap $cap s)" | tee -a logs/summary.log
  if [ -n "$final_out" ]; then
    tar czf "$final_out/results_h200.tar.gz" results/h200 2>/dev/null
    tar czf "$final_out/logs.tar.gz" logs "$OUT" 2>/dev/null
  fi
done
for a in $areas; do echo "---- $a (last lines)"; tail -n 15 "logs/$a.log"; done
cat logs/summary.log
