#!/usr/bin/env bash
# Honest e2e projections (issue 33) on one H200, one command from the repo root:
#   bash scripts/gpu/e2e_honest.sh
# 1. K2.6 TP-8 rank 0 (projected TP-8: measured rank compute + modelled NVLink all-reduce),
#    uniform expert routing (each token's experts drawn after the router ran), c = 1 and 10,
#    budgets 8..256 and `auto` (cost model fitted on that grid, best predicted budget measured),
#    acceptance: rank profiles of the DFlash K2.5 drafter (GSM8K, MT-Bench; paper / small
#    sibling gain) and synthetic:6, AR beside. One process: the model is built once.  <= ~6 min
# 2. the same at c=10, budgets 32 and 128, with the router's own choice (--routing model),
#    to show what random weights route.                                               <= ~2 min
# 128 new tokens a stream (NEW_TOKENS): enough steps at c=10 with every stream still generating
# for the steady rate (`steady_tok_per_s`, what the cost model predicts) to average over ~20.
# Each step is stopped with SIGINT at its cap (CAP1, CAP2 seconds), so its CSV keeps the rows measured.
# Writes results/<gpu>/e2e/<UTC stamp>_honest(.csv, .json) and _honest_model; logs/e2e_honest_<stamp>.log.
cd "$(dirname "$0")/../.." || exit 1
. scripts/gpu/lib.sh
set -o pipefail
PY=${PYTHON:-python3}
STAMP=$(date -u +%Y%m%d-%H%M%S)
E2E=$RES/e2e
mkdir -p "$E2E" logs
LOG=logs/e2e_honest_$STAMP.log
ACC=rank:dflash-k25-gsm8k-paper,rank:dflash-k25-gsm8k-small,rank:dflash-k25-mtbench-paper
ACC=$ACC,rank:dflash-k25-mtbench-small,synthetic:6
COMMON="--preset k2.6 --tp 8 --simulate-rank 0 --prompt-len 128 --new-tokens ${NEW_TOKENS:-128} --out $E2E"
rc=0
echo "== e2e uniform routing, c=1,10, budgets 8..256 + auto ==" | tee "$LOG"
timeout -s INT "${CAP1:-390}" "$PY" -m ddbench e2e $COMMON --routing uniform --concurrency 1,10 \
    --budget 8,16,32,64,128,256,auto --acceptance "$ACC" --name "${STAMP}_honest" 2>&1 | tee -a "$LOG" || rc=1
echo "== e2e router's own routing (random weights), c=10 ==" | tee -a "$LOG"
timeout -s INT "${CAP2:-150}" "$PY" -m ddbench e2e $COMMON --routing model --concurrency 10 --budget 32,128 \
    --acceptance rank:dflash-k25-gsm8k-paper,synthetic:6 --name "${STAMP}_honest_model" 2>&1 | tee -a "$LOG" || rc=1
if [ -n "$OUT" ]; then cp "$E2E/${STAMP}"_honest* "$LOG" "$OUT"/ 2>/dev/null; fi
exit $rc
