#!/usr/bin/env bash
# One device call for a change to the MoE kernels: their GPU tests (TESTS; none: skipped), then,
# only if they pass, STEPS in the order given, of:
#   probe        experiments/scripts/moe_decode_probe.py (variants PROBE_V, default all)
#   check        scripts/gpu/moe_marlin_check.py at tokens CHECK_T with variants CHECK_V
#   variants     experiments/scripts/moe_marlin_variants.py: source variants MV_V (default addr,f16,addr_f16)
#                against the product kernel at tokens MV_T, bitwise check included
#   ncu          Nsight Compute of moe_wide at tokens NCU_T (experiments.scripts.moe_ncu wide)
#   wgmma        experiments/moe_wgmma.cu: its GPU tests, then (if they pass) experiments.scripts.moe_wgmma_check
#                at tokens WG_T with variants WG_V (STAGES:N1-N2-N3), capped at WG_CAP (300)
#   sweep        moe-sweep TP-8 of this tree (the default rule)
#   sweep_before the same of the tree in .snap (the commit before)
#   tp1          moe-sweep TP-1 of this tree
#   e2e          K2.6 TP-8 rank 0, uniform routing, GSM8K paper profile, c = 1 and 10, budgets 8
#                and 16, of this tree
#   e2e_before   the same of the tree in .snap
# Caps (seconds; a sweep or e2e stopped by SIGINT keeps its rows): TEST_CAP 240, SW_CAP 100,
# E2E_CAP 150, MV_TIMEOUT 240; e2e concurrencies E2E_C (1,10) and budgets E2E_B (8,16).
# Files (<gpu>_<stamp>_<TAG>_<what>.csv / .json) land in $OUT/runs.tgz, packed again after each
# step (a device call returns at most 8 files), beside $OUT/log.txt.
#   rm -rf .snap && mkdir .snap && git archive HEAD~N | tar x -C .snap
#   TAG=wide STEPS="sweep e2e sweep_before e2e_before" bash experiments/scripts/moe_change_run.sh
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
. scripts/gpu/lib.sh
GPU=${RES#results/}
S=$(date -u +%Y%m%d-%H%M%S)_${TAG:-change}
exec > >(tee "$OUT/log.txt") 2>&1
RUNS=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${TESTS:-}" != none ]; then
  timeout ${TEST_CAP:-240} python3 -m pytest -q -m gpu ${TESTS:-tests/test_moe_decode.py tests/test_moe_marlin.py tests/test_moe_wide.py} 2>&1 \
    | grep -E "passed|failed|^E " | head -12
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "GPU tests failed: no benchmarks"; exit 1; }
fi
SW="moe-sweep --preset k2.6 --backends triton --routing uniform --out $RUNS"
E2E="e2e --preset k2.6 --tp 8 --simulate-rank 0 --prompt-len 128 --new-tokens 64 --routing uniform --concurrency ${E2E_C:-1,10} --budget ${E2E_B:-8,16} --acceptance rank:dflash-k25-gsm8k-paper --out $RUNS"
rows() { grep -E "^triton .* y " | head -14; }
for step in ${STEPS:-sweep e2e sweep_before e2e_before}; do
  echo "== $step"
  case $step in
    probe) timeout 120 python3 -m experiments.scripts.moe_decode_probe "$RUNS/${GPU}_${S}_probe.csv" $PROBE_V 2>&1 | tail -7 ;;
    check) timeout 240 python3 scripts/gpu/moe_marlin_check.py "$RUNS/check" "${CHECK_T:-512,1024,2048,4096}" "${CHECK_V:-m2,w4}" 2>&1 | tail -8
           mv "$RUNS/check/moe_marlin_check.csv" "$RUNS/${GPU}_${S}_check.csv" 2>/dev/null; rmdir "$RUNS/check" 2>/dev/null ;;
    variants) timeout ${MV_TIMEOUT:-240} python3 -m experiments.scripts.moe_marlin_variants "$RUNS/${GPU}_${S}_variants.csv" \
                "${MV_T:-8,16,32,64,96,128,256,512}" "${MV_V:-addr,f16,addr_f16}" 2>&1 | tail -10 ;;
    ncu) timeout 300 bash experiments/scripts/ncu.sh wide experiments.scripts.moe_ncu wide "${NCU_T:-4096}" 2>&1 | tail -9 ;;
    wgmma) timeout ${TEST_CAP:-240} python3 -m pytest -q -m gpu experiments/tests/test_moe_wgmma.py 2>&1 | grep -E "passed|failed|^E " | head -12
           [ "${PIPESTATUS[0]}" = 0 ] && timeout ${WG_CAP:-300} python3 -m experiments.scripts.moe_wgmma_check \
             "$RUNS/${GPU}_${S}_wgmma.csv" "${WG_T:-4096,512,96,170,1024,2048,256}" "${WG_V:-4,6,8:16-32-48,12:16-32-48}" 2>&1 | tail -8 ;;
    sweep) timeout -s INT ${SW_CAP:-100} python3 -m ddbench $SW --tp 8 --name "${GPU}_${S}_tp8" 2>&1 | rows ;;
    sweep_before) (cd .snap && timeout -s INT ${SW_CAP:-100} python3 -m ddbench $SW --tp 8 --name "${GPU}_${S}_tp8_before" 2>&1 | rows) ;;
    tp1) timeout -s INT 90 python3 -m ddbench $SW --tp 1 --name "${GPU}_${S}_tp1" 2>&1 | rows ;;
    e2e) timeout -s INT ${E2E_CAP:-150} python3 -m ddbench $E2E --name "${GPU}_${S}_e2e" 2>&1 | tail -2 ;;
    e2e_before) (cd .snap && timeout -s INT ${E2E_CAP:-150} python3 -m ddbench $E2E --name "${GPU}_${S}_e2e_before" 2>&1 | tail -2) ;;
    *) echo "unknown step $step" ;;
  esac
  tar czf "$OUT/runs.tgz" -C "$RUNS" .
done
