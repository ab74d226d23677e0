#!/usr/bin/env bash
# The launch-saving options of the decode step on one H200 (PDL, kernels/pdl.py; fused route
# and MoE act; attention chunk cap; shared expert on a side stream; or the launch shapes of
# decode_variants.py's TRIALS when named):
#   1. the decode step with each option off in turn (experiments/scripts/decode_variants.py, ~3 min)
#   2. GPU tests of the kernels involved: the PDL chain against plain launches
#      (tests/test_pdl.py), skinny, attention, engine kernels and model, MoE gemv (~2 min)
#   3. ddbench decode --preset k2.6 --tp 8 --simulate-rank 0 at concurrency 1 and 10 (~1.5 min)
#   4. kernel-by-kernel profile of one c=1 step (experiments/scripts/decode_profile.py, ~1 min)
# Usage: decode_options.sh [NAME,...] (step 1 only for those options / trials of decode_variants.py).
# Writes the variants and the profile to experiments/results/, the decode run to
# results/h200/decode/<UTC stamp>_options, the log to logs/; new files are copied to $OUT/decode if set.
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
dir=experiments/results
mkdir -p "$dir" logs results/h200/decode
stamp=$(date -u +%Y%m%d-%H%M)
touch "/tmp/decode_options_$stamp"
log() { tee -a "logs/decode_options_$stamp.log"; }

timeout 300 python3 -m experiments.scripts.decode_variants "$dir" 1,10 ${1:+"$1"} 2>&1 | log || echo "FAILED decode variants"
[ -f "$dir/decode_variants.csv" ] && mv "$dir/decode_variants.csv" "$dir/decode_variants_$stamp.csv"

timeout 240 python3 -m pytest -q -m gpu tests/test_pdl.py tests/test_skinny.py tests/test_engine_kernels.py \
  tests/test_engine.py tests/test_mla_attn.py 2>&1 | tail -15 | log || echo "FAILED gpu tests"
timeout 120 python3 -m pytest -q -m gpu tests/test_moe_triton.py -k "gemv or graph" 2>&1 | tail -5 | log \
  || echo "FAILED moe gemv tests"

timeout 200 python3 -m ddbench decode --preset k2.6 --tp 8 --simulate-rank 0 --concurrency 1,10 \
  --prompt-len 128 --new-tokens 64 --allreduce-model nvlink-h200 --out results/h200/decode --name "$(date -u +%Y%m%d-%H%M%S)_options" 2>&1 | log \
  || echo "FAILED decode"
timeout 150 python3 -m experiments.scripts.decode_profile "$dir" 1 2>&1 | tail -25 | log || echo "FAILED decode profile"
[ -f "$dir/decode_profile_c1.csv" ] && mv "$dir/decode_profile_c1.csv" "$dir/decode_profile_c1_$stamp.csv"

if [ -n "$OUT" ]; then
  mkdir -p "$OUT/decode"
  find "$dir" results/h200/decode logs -maxdepth 1 -type f -newer "/tmp/decode_options_$stamp" -exec cp {} "$OUT/decode/" \;
fi
