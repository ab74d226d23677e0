#!/usr/bin/env bash
# Programmatic dependent launch in the decode step (kernels/pdl.py) on one H200:
#   1. the decode step under launch variants (scripts/gpu/decode_variants.py, ~2 min)
#   2. GPU tests of every kernel that now launches with PDL: the PDL chain against plain
#      launches (tests/test_pdl.py), skinny, attention, engine kernels and model, MoE gemv (~2 min)
#   3. ddbench decode --preset k2.6 --tp 8 --simulate-rank 0 at concurrency 1 and 10 (~1.5 min)
# Writes results/h200/decode/, copied to $OUT/decode if set.
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
dir=results/h200/decode
mkdir -p "$dir"
stamp=$(date -u +%Y%m%d-%H%M)
log() { tee -a "$dir/pdl_gpu_$stamp.log"; }
save() { [ -n "$OUT" ] && mkdir -p "$OUT/decode" && cp "$@" "$OUT/decode/"; }

timeout 240 python3 scripts/gpu/decode_variants.py "$dir" 1,10 2>&1 | log || echo "FAILED decode variants"
[ -f "$dir/decode_variants.csv" ] && mv "$dir/decode_variants.csv" "$dir/decode_variants_$stamp.csv" \
  && save "$dir/decode_variants_$stamp.csv"

timeout 200 python3 -m pytest -q -x -m gpu tests/test_pdl.py tests/test_skinny.py tests/test_engine_kernels.py \
  tests/test_engine.py tests/test_mla_attn.py 2>&1 | log || echo "FAILED gpu tests"
timeout 60 python3 -m pytest -q -m gpu tests/test_moe_triton.py -k "gemv or graph" 2>&1 | log || echo "FAILED moe gemv tests"

before=$(ls "$dir"/decode_2*.csv 2>/dev/null)
timeout 200 python3 -m ddbench decode --preset k2.6 --tp 8 --simulate-rank 0 --concurrency 1,10 \
  --prompt-len 128 --new-tokens 64 --allreduce-model nvlink-h200 --out "$dir" 2>&1 | log || echo "FAILED decode"
for f in "$dir"/decode_2*.csv; do
  case " $before " in *" $f "*) ;; *) save "$f" "${f%.csv}.json" ;; esac
done
save "$dir/pdl_gpu_$stamp.log"
