#!/usr/bin/env bash
# DDTree kernels on one H200 (issue 5). Steps, each independent:
#   1. GPU tests: bf16/fp32 builder == heap reference at budgets 64/512/1024 (with ties),
#      topk -> build -> accept -> commit captured in one CUDA graph, attention == reference
#      at K2.6 dims (512 + 64) for T = 1..65, 8 and 64 heads, and attention captured in a CUDA
#      graph with a 32k cache replayed after prefix_len changes (split re-derived on the device).
#   2. ddbench tree-bench sweep: budgets 16..1024 x streams 1/10/32; attention over
#      streams x prefix 1k/8k/32k x heads 8/64 x T (1 and budget + 1), capped at 3 TFLOP a call,
#      timed in a CUDA graph over 4 cold cache copies (as the engine runs it).
#   3. ddbench tree-bench --tune: knob variants of attention (10 streams x 8k, CUDA graph, cold
#      KV; last: pdl=True, the merge launched with programmatic dependent launch, never run on
#      a GPU before; its GPU test is test_gpu_pdl_merge_equals_reference) and builder warps.
#   4. summary of the targets: builder budget 512 x 10 streams; attention 8 heads x 10 streams
#      x 8k at >= 60% of copy bandwidth (T = 1); accept + commit < 20 us for 10 streams.
# Expected runtime: about 4 minutes (tests ~70 s incl. Triton compiles, sweep ~80 s + 0.2 s of warm-up
# replays per CUDA-graph row since 4d887ef, tune ~50 s);
# each step has its own timeout (80 + 130 + 55 s), so at most 4.5 minutes.
# Writes results/<gpu>/tree-bench/<UTC stamp>.{csv,json}, <UTC stamp>_tune.{csv,json} and
# logs/tree_<stamp>.log; copies them to $OUT/tree/ if $OUT is set. Run from the repo root: bash scripts/gpu/tree.sh
cd "$(dirname "$0")/../.." || exit 1
. scripts/gpu/lib.sh
set -o pipefail  # a step fails when its command fails, not its tee
PY=${PYTHON:-python3}
STAMP=$(date -u +%Y%m%d-%H%M%S)
DIR=$RES/tree-bench
mkdir -p "$DIR" logs
LOG=logs/tree_$STAMP.log
NAME=$STAMP
TUNE=${STAMP}_tune

echo "== 1. GPU tests ==" | tee "$LOG"
timeout 80 $PY -m pytest -q -m gpu tests/test_ddtree.py tests/test_mla_attn.py -p no:cacheprovider 2>&1 \
  | tail -25 | tee -a "$LOG" || echo "FAILED step: gpu tests" | tee -a "$LOG"

echo "== 2. tree-bench sweep ==" | tee -a "$LOG"
timeout 130 $PY -m ddbench tree-bench --budgets 16,64,256,512,1024 --reps 10 --out "$DIR" --name "$NAME" 2>&1 \
  | tail -45 | tee -a "$LOG" || echo "FAILED step: tree-bench sweep" | tee -a "$LOG"

echo "== 3. tree-bench --tune ==" | tee -a "$LOG"
timeout 55 $PY -m ddbench tree-bench --tune --out "$DIR" --name "$TUNE" 2>&1 \
  | tail -40 | tee -a "$LOG" || echo "FAILED step: tree-bench --tune" | tee -a "$LOG"

echo "== 4. summary ==" | tee -a "$LOG"
for f in "$DIR/$NAME.csv" "$DIR/$TUNE.csv"; do
  [ -f "$f" ] || { [ -f "$f.partial" ] && echo "(step timed out: summary of the rows written)" && f="$f.partial"; }
  if [ -f "$f" ]; then
    $PY -c "from ddbench.tree_bench import summary; summary('$f')" 2>&1 | tee -a "$LOG" \
      || echo "FAILED step: summary of $f" | tee -a "$LOG"
  else
    echo "FAILED: no $f" | tee -a "$LOG"
  fi
done

if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT/tree"
  for f in "$LOG" "$DIR/$NAME".csv "$DIR/$NAME".json "$DIR/$TUNE".csv "$DIR/$TUNE".json \
           "$DIR/$NAME".csv.partial "$DIR/$TUNE".csv.partial; do
    [ -f "$f" ] && cp "$f" "$OUT/tree/"
  done
fi
