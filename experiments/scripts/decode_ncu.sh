#!/usr/bin/env bash
# One eager c=1 decode step of a 3-layer K2.6 TP-8 rank-0 shard under Nsight Compute
# (experiments/scripts/decode_ncu.py): per kernel duration, DRAM bytes, occupancy, issue use, stalls.
# Writes experiments/results/decode_ncu_<stamp>.csv (+ the raw ncu CSV), copied to $OUT/decode.
# About 1-2 minutes.
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
dir=experiments/results
mkdir -p "$dir"
stamp=$(date -u +%Y%m%d-%H%M)
raw="$dir/decode_ncu_raw_$stamp.csv"
timeout 400 ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \
  --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
  --page raw --csv --log-file "$raw" python3 -m experiments.scripts.decode_ncu run "${1:-1}" "${2:-3}" \
  || echo "FAILED ncu"
python3 -m experiments.scripts.decode_ncu summary "$raw" "$dir/decode_ncu_$stamp.csv" || echo "FAILED ncu summary"
if [ -n "$OUT" ]; then mkdir -p "$OUT/decode"; cp "$raw" "$dir/decode_ncu_$stamp.csv" "$OUT/decode/" 2>/dev/null; fi
