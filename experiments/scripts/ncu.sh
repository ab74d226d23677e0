#!/usr/bin/env bash
# A script's profiled region (cudaProfilerStart/Stop) under Nsight Compute, summarized per kernel by
# `experiments.scripts.decode_ncu summary`: duration, DRAM bytes, occupancy, issue use, stalls.
# usage: bash experiments/scripts/ncu.sh NAME MODULE [ARGS...]
#   bash experiments/scripts/ncu.sh decode experiments.scripts.decode_ncu run 1 3   # one c=1 decode step, 3 layers
#   bash experiments/scripts/ncu.sh moe experiments.scripts.moe_ncu run 1,8,128,512,4096   # the Marlin MoE at each T
# Writes experiments/results/<NAME>_ncu_<stamp>.csv (+ the raw ncu CSV), copied to $OUT/<NAME>. 1-3 minutes.
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
name=$1
shift
dir=experiments/results
mkdir -p "$dir"
stamp=$(date -u +%Y%m%d-%H%M)
raw="$dir/${name}_ncu_raw_$stamp.csv"
timeout 400 ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \
  --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
  --page raw --csv --log-file "$raw" python3 -m "$@" || echo "FAILED ncu"
python3 -m experiments.scripts.decode_ncu summary "$raw" "$dir/${name}_ncu_$stamp.csv" || echo "FAILED ncu summary"
if [ -n "$OUT" ]; then mkdir -p "$OUT/$name"; cp "$raw" "$dir/${name}_ncu_$stamp.csv" "$OUT/$name/" 2>/dev/null; fi
