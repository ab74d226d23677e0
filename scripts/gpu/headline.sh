#!/usr/bin/env bash
# The two headline numbers in one call on one H200 (from the repo root: bash scripts/gpu/headline.sh):
# 1. GPU tests of the MoE kernel and of the routing hook (kernels/moe_marlin, kernels/route_draw);
# 2. `ddbench moe-sweep` at the K2.6 TP-8 shard, uniform routing, CUDA graphs (% of copy bandwidth);
# 3. `ddbench e2e` honest: TP-8 rank 0 projected, uniform routing, c = 1 and 10, budgets 8, 16,
#    32, 128 and auto, acceptance: the DFlash K2.5 GSM8K (paper) and MT-Bench (small sibling)
#    rank profiles and synthetic:6, AR beside.                                   <= ~9.5 min
# FALLBACK=DIR: where the MoE tests fail, steps 2-3 run the tree in DIR (e.g. a snapshot of the
# last commit) instead, so the e2e numbers never come from a kernel that failed its tests.
# Each step stops with SIGINT at its cap (CAP_TESTS, CAP_SWEEP, CAP_E2E seconds), keeping its rows.
# Results: results/<gpu>/{moe-sweep,e2e}/<UTC stamp>_headline* (<gpu>: h200, h100, ... from nvidia-smi);
# log logs/headline_<stamp>.log;
# with $OUT set, all of it comes back as one tarball.
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
HERE=$PWD
STAMP=$(date -u +%Y%m%d-%H%M%S)
. scripts/gpu/lib.sh
mkdir -p logs $RES/moe-sweep $RES/e2e
LOG=$HERE/logs/headline_$STAMP.log
pack() { [ -z "$OUT" ] || tar czf "$OUT/headline_$STAMP.tar.gz" -C "$HERE" $RES logs 2>/dev/null; }
step() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }
step "gpu tests: MoE kernel, routing hook"
timeout "${CAP_TESTS:-150}" python3 -m pytest -q -m gpu tests/test_moe_marlin.py tests/test_routing.py 2>&1 | tail -8 | tee -a "$LOG"
ok=${PIPESTATUS[0]}
TREE=$HERE
if [ "$ok" != 0 ] && [ -n "$FALLBACK" ]; then step "tests failed (rc $ok): steps 2-3 run $FALLBACK"; TREE=$HERE/$FALLBACK; fi
cd "$TREE" || exit 1
step "moe-sweep tp8 (tree $TREE)"
timeout -s INT "${CAP_SWEEP:-100}" python3 -m ddbench moe-sweep --preset k2.6 --tp 8 --backends triton --routing uniform \
  --out "$HERE/$RES/moe-sweep" --name "${STAMP}_headline_tp8" 2>&1 | tail -18 | tee -a "$LOG"
pack
ACC=rank:dflash-k25-gsm8k-paper,rank:dflash-k25-mtbench-small,synthetic:6
step "e2e honest c=1,10 (tree $TREE)"
timeout -s INT "${CAP_E2E:-330}" python3 -m ddbench e2e --preset k2.6 --tp 8 --simulate-rank 0 --prompt-len 128 \
  --new-tokens 64 --routing uniform --concurrency 1,10 --budget 8,16,32,128,auto --acceptance "$ACC" \
  --out "$HERE/$RES/e2e" --name "${STAMP}_headline" 2>&1 | tail -40 | tee -a "$LOG"
pack
