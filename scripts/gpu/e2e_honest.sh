#!/usr/bin/env bash
# Honest e2e projections (issue 33) on one H200, one command from the repo root:
#   bash scripts/gpu/e2e_honest.sh
# 1-2. K2.6 TP-8 rank 0 (projected TP-8: measured rank compute + modelled NVLink all-reduce),
#    uniform expert routing (each token's experts drawn after the router ran), c = 1 (384 new
#    tokens, NEW1) and c = 10 (128, NEW10), budgets 8..256 (c=10: 8..128 on an 80 GB card) and
#    `auto` (cost model fitted on that grid, best predicted budget measured), acceptance: rank
#    profiles of the DFlash K2.5 drafter (GSM8K, MT-Bench; paper / small sibling gain) and
#    synthetic:6, AR beside. One run a concurrency: c=1 needs ~70-100 steps for its drawn
#    acceptance to sit within ~5 % of its expectation, c=10 averages 10 streams over ~20 steady
#    steps (`steady_tok_per_s`, every stream still generating: what the cost model predicts).
# 3. c=10, budgets 32 and 128, with the router's own choice (--routing model), to show what
#    random weights route (MODEL=0 skips it).                               <= ~9 min in all
# Each step is stopped with SIGINT at its cap (CAP1, CAP2 seconds), so its CSV keeps the rows measured.
# Writes results/<gpu>/e2e/<UTC stamp>_honest_c1, _honest_c10, _honest_model (.csv, .json); logs/e2e_honest_<stamp>.log.
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
COMMON="--preset k2.6 --tp 8 --simulate-rank 0 --prompt-len 128 --out $E2E"
# budget 256 at c=10 needs more than an H100's 80 GB next to the rank's weights
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
B10=8,16,32,64,128; [ "${MEM:-0}" -gt 100000 ] && B10=$B10,256
rc=0
echo "== e2e uniform routing, c=1, ${NEW1:-384} new tokens, budgets 8..256 + auto ==" | tee "$LOG"
timeout -s INT "${CAP1:-220}" "$PY" -m ddbench e2e $COMMON --new-tokens "${NEW1:-384}" --routing uniform --concurrency 1 \
    --budget 8,16,32,64,128,256,auto --acceptance "$ACC" --name "${STAMP}_honest_c1" 2>&1 | tee -a "$LOG" || rc=1
echo "== e2e uniform routing, c=10, ${NEW10:-128} new tokens, budgets $B10 + auto ==" | tee -a "$LOG"
timeout -s INT "${CAP2:-230}" "$PY" -m ddbench e2e $COMMON --new-tokens "${NEW10:-128}" --routing uniform --concurrency 10 \
    --budget $B10,auto --acceptance "$ACC" --name "${STAMP}_honest_c10" 2>&1 | tee -a "$LOG" || rc=1
if [ "${MODEL:-1}" != 0 ]; then
  echo "== e2e router's own routing (random weights), c=10 ==" | tee -a "$LOG"
  timeout -s INT "${CAP3:-110}" "$PY" -m ddbench e2e $COMMON --new-tokens "${NEW10:-128}" --routing model --concurrency 10 \
      --budget 32,128 --acceptance rank:dflash-k25-gsm8k-paper,synthetic:6 --name "${STAMP}_honest_model" 2>&1 \
      | tee -a "$LOG" || rc=1
fi
if [ -n "$OUT" ]; then cp "$E2E/${STAMP}"_honest* "$LOG" "$OUT"/ 2>/dev/null; fi
exit $rc
