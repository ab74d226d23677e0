#!/usr/bin/env bash
# A newcomer's commands and the engine-path GPU tests in one call on one H200 (from the repo root:
# bash scripts/gpu/newcomer.sh):
# 1. GPU tests of the engine path (speculative step, kernel choice, PDL chain);
# 2. `ddbench decode` at the standard shape (K2.6 TP-8 rank 0, c = 1 and 10), uniform routing
#    (the default with random weights) and the router's own choice (the committed runs' routing);
# 3. `ddbench e2e --concurrency 10` exactly as a user types it (defaults: fit note, TP-8 rank 0,
#    uniform routing, the two named acceptance profiles, --budget auto).            ~6-8 min
# Results land in results/<gpu>/{decode,e2e}/ (<gpu> = h200, h100, ... from nvidia-smi); logs in logs/; with $OUT set both come back as a tarball.
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
STAMP=$(date -u +%Y%m%d-%H%M%S)
. scripts/gpu/lib.sh
mkdir -p logs
LOG=logs/newcomer_$STAMP.log
DEC="--preset k2.6 --tp 8 --simulate-rank 0 --concurrency 1,10 --prompt-len 128 --new-tokens 64 --allreduce-model nvlink-h200"
pack() { [ -n "$OUT" ] && tar czf "$OUT/newcomer_$STAMP.tar.gz" $RES logs 2>/dev/null; }
step() { echo "== $*" | tee -a "$LOG"; }
step "gpu tests"
timeout "${CAP_TESTS:-150}" python3 -m pytest -q -m gpu tests/test_spec_gpu.py tests/test_select.py \
  tests/test_pdl.py 2>&1 | tail -6 | tee -a "$LOG"
step "decode, uniform routing"
timeout -s INT "${CAP_DECODE:-150}" python3 -m ddbench decode $DEC --routing uniform --out $RES/decode --name "${STAMP}_uniform" 2>&1 | tail -12 | tee -a "$LOG"
pack
step "decode, router's routing"
timeout -s INT "${CAP_DECODE:-150}" python3 -m ddbench decode $DEC --routing model --out $RES/decode --name "${STAMP}_model" 2>&1 | tail -12 | tee -a "$LOG"
pack
step "e2e --concurrency 10 (defaults)"
timeout -s INT "${CAP_E2E:-200}" python3 -m ddbench e2e --concurrency 10 --out $RES/e2e --name "${STAMP}_default" 2>&1 | tail -30 | tee -a "$LOG"
pack
