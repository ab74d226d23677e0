#!/usr/bin/env bash
# DDTree kernels on one H200: GPU tests (bf16 builder/attention/graph capture) and the
# tree-bench sweep, then a summary of the issue-5 targets. Run from the repo root:
#   bash scripts/gpu/tree.sh
# Expected runtime: about 3 minutes (tests ~60 s incl. Triton compiles, bench ~90 s).
# Writes results/h200/tree_bench_<stamp>.{csv,json}; copies them and the logs to $OUT if set.
cd "$(dirname "$0")/../.." || exit 1
set -o pipefail  # a step fails when its command fails, not its tee
PY=${PYTHON:-python3}
STAMP=$(date -u +%Y%m%d-%H%M%S)
RES=results/h200
mkdir -p "$RES"
LOG=$RES/tree_$STAMP.log
NAME=tree_bench_h200_$STAMP

echo "== GPU tests ==" | tee "$LOG"
timeout 150 $PY -m pytest -q -m gpu tests/test_ddtree.py tests/test_mla_attn.py 2>&1 | tail -25 | tee -a "$LOG" \
  || echo "FAILED step: gpu tests" | tee -a "$LOG"

echo "== tree-bench ==" | tee -a "$LOG"
timeout 200 $PY -m ddbench tree-bench --out "$RES" --name "$NAME" 2>&1 | tail -60 | tee -a "$LOG" \
  || echo "FAILED step: tree-bench" | tee -a "$LOG"

echo "== summary ==" | tee -a "$LOG"
if [ -f "$RES/$NAME.csv" ]; then
  $PY -c "from ddbench.tree_bench import summary; summary('$RES/$NAME.csv')" 2>&1 | tee -a "$LOG" \
    || echo "FAILED step: summary" | tee -a "$LOG"
else
  echo "FAILED: no $RES/$NAME.csv" | tee -a "$LOG"
fi

if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT/tree"
  cp "$LOG" "$RES/$NAME.csv" "$RES/$NAME.json" "$OUT/tree/" 2>/dev/null || true
fi
