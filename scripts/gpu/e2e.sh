#!/usr/bin/env bash
# The DDTree speculative engine end to end on one H200 (issue 10), then the targets.
# Run from the repo root:  bash scripts/gpu/e2e.sh
# Expected runtime: at most 5 minutes, each step capped by its own timeout:
#   GPU tests of the loop (tiny, graphs)              <= 75 s (mostly Triton compiles)
#   e2e c=1,  K2.6 TP-8 rank 0, budgets 8,16..256     <= 110 s (incl. ~20-40 s weight init)
#   e2e c=10, K2.6 TP-8 rank 0, budgets 8,16..256     <= 115 s (budgets run in ascending order;
#                                                        if time runs out the largest ones are
#                                                        the ones cut, and the CSV says so)
# Budget 8 is there because at c=1 the bytes floor + modelled comm predicts it best
# (~880 tok/s at TAU=6 vs ~760 at 16: fewer experts touched, chain cut at depth 8).
# Acceptance synthetic TAU = 3, 6, 9 (random weights cannot accept for real), AR beside,
# projected TP-8 numbers (measured rank compute + modelled NVLink all-reduce).
# A timed-out step is stopped with SIGINT, so its CSV keeps the rows already measured.
# Writes results/<gpu>/e2e/<UTC stamp>_c1 and _c10 (.csv + .json sidecar) and logs/e2e_<stamp>.log;
# copies them to $OUT if set.
cd "$(dirname "$0")/../.." || exit 1
. scripts/gpu/lib.sh
set -o pipefail
PY=${PYTHON:-python3}
STAMP=$(date -u +%Y%m%d-%H%M%S)
DIR=$RES/e2e
mkdir -p "$DIR" logs
LOG=logs/e2e_$STAMP.log
ACC=synthetic:3,synthetic:6,synthetic:9
# prompt 128 keeps the context short (tree-verify attention grows with context x tree size;
# docs/notes/tree.md); E2E_PROMPT_LEN / E2E_NEW_TOKENS change it
COMMON="--preset k2.6 --tp 8 --simulate-rank 0 --acceptance $ACC --prompt-len ${E2E_PROMPT_LEN:-128}"
COMMON="$COMMON --new-tokens ${E2E_NEW_TOKENS:-64} --out $DIR"

echo "== GPU tests: DDTree loop (tiny) ==" | tee "$LOG"
timeout -k 10 -s INT 75 $PY -m pytest -q -m gpu tests/test_spec_gpu.py 2>&1 | tail -20 | tee -a "$LOG" \
  || echo "FAILED step: gpu tests (tests/test_spec_gpu.py)" | tee -a "$LOG"

echo "== e2e c=1 ==" | tee -a "$LOG"
timeout -k 10 -s INT 110 $PY -m ddbench e2e $COMMON --concurrency 1 --budget "${E2E_C1_BUDGETS:-8,16,32,64,128,256}" \
  --name "${STAMP}_c1" 2>&1 | tail -30 | tee -a "$LOG" || echo "FAILED step: e2e c=1" | tee -a "$LOG"

echo "== e2e c=10 ==" | tee -a "$LOG"
timeout -k 10 -s INT 115 $PY -m ddbench e2e $COMMON --concurrency 10 --budget "${E2E_C10_BUDGETS:-8,16,32,64,128,256}" \
  --name "${STAMP}_c10" 2>&1 | tail -30 | tee -a "$LOG" || echo "FAILED step: e2e c=10" | tee -a "$LOG"

echo "== summary (issue 10 targets at TAU=6: c=1 >= 700 tok/s, c=10 >= 2000 tok/s, step <= 1.3x floor+comm) ==" \
  | tee -a "$LOG"
CSVS=$(ls "$DIR/${STAMP}_c1.csv" "$DIR/${STAMP}_c10.csv" 2>/dev/null | tr '\n' ' ')
if [ -n "$CSVS" ]; then
  $PY -c "import sys; from ddbench.e2e import summary; summary(sys.argv[1:])" $CSVS 2>&1 | tee -a "$LOG" \
    || echo "FAILED step: summary" | tee -a "$LOG"
else
  echo "FAILED: no e2e CSV under $DIR" | tee -a "$LOG"
fi

if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT/e2e"
  cp "$LOG" "$DIR/${STAMP}"_c1.* "$DIR/${STAMP}"_c10.* "$OUT/e2e/" 2>/dev/null || true
fi
