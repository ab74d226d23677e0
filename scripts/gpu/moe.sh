#!/usr/bin/env bash
# INT4 MoE GEMM on one H200: GPU tests of the Triton kernel, then `ddbench moe-sweep` at the
# K2.6 TP-8 rank shard and the whole layer (TP-1), torch reference and triton, with --check.
# Writes results/<gpu>/moe-sweep/<UTC stamp>_tp8, _tp1 and _tp8_routings (.csv + .json sidecar),
# copies them and logs to $OUT if set. Expected runtime: about 3.5-4 minutes (measured 2026-12-02: ~95 s for
# both sweeps with warm kernel caches, plus tests and compiles; most of it the slow torch
# reference and the fp32 checks). MOE_TILES=file.json passes a tile table (--tiles).
cd "$(dirname "$0")/../.." || exit 1
. scripts/gpu/lib.sh
R=$RES/moe-sweep
STAMP=$(date -u +%Y%m%d-%H%M%S)
TMP=$(mktemp -d)
LOG=${OUT:-$TMP}/moe_logs
DST=${OUT:-$TMP}   # the sweep writes here (so a killed run still leaves its rows), then copies to $R
mkdir -p "$R" "$LOG" "$DST"
TILES=()
[ -n "${MOE_TILES:-}" ] && TILES=(--tiles "$MOE_TILES")
export PYTHONUNBUFFERED=1

if [ -z "${MOE_SKIP_TESTS:-}" ]; then
  timeout 150 python3 -m pytest -q -m gpu tests/test_moe_triton.py 2>&1 | tail -8 | tee "$LOG/moe_pytest.log" \
    || echo "FAILED step: moe gpu tests"
fi

sweep() {  # $1 = tp, rest = extra args
  local tp=$1; shift
  timeout "${MOE_SWEEP_TIMEOUT:-200}" python3 -m ddbench moe-sweep --preset k2.6 --tp "$tp" --check --reps 10 --routing uniform \
    "${TILES[@]}" --out "$DST" --name "${STAMP}_tp$tp" "$@" > "$LOG/moe_sweep_tp$tp.log" 2>&1 \
    || echo "FAILED step: moe-sweep tp$tp (see $LOG/moe_sweep_tp$tp.log)"
  for f in "$DST/${STAMP}_tp$tp".csv "$DST/${STAMP}_tp$tp".json "$DST/${STAMP}_tp$tp".csv.partial; do
    [ -f "$f" ] && cp "$f" "$R/"
  done
  tail -22 "$LOG/moe_sweep_tp$tp.log"
}
sweep 8
sweep 1 --torch-max-tokens 64 --tokens 1,4,16,64,256,1024,4096

# routings other than uniform (triton only, TP-8): experts touched and time per routing (about 30 s)
sweep_r() {
  timeout 90 python3 -m ddbench moe-sweep --preset k2.6 --tp 8 --backends triton --reps 10 \
    --routing skewed,balanced,router --tokens 1,16,64,256,1024 --out "$DST" --name "${STAMP}_tp8_routings" \
    > "$LOG/moe_sweep_tp8_routings.log" 2>&1 || echo "FAILED step: moe-sweep routings"
  for f in "$DST/${STAMP}_tp8_routings".csv "$DST/${STAMP}_tp8_routings".json; do [ -f "$f" ] && cp "$f" "$R/"; done
}
sweep_r

STAMP=$STAMP python3 - <<'PY' || echo "FAILED step: moe summary"
import os
import pandas as pd
for tp in (8, 1):
    try:
        df = pd.read_csv(f"{os.environ['RES']}/moe-sweep/{os.environ['STAMP']}_tp{tp}.csv")
    except OSError:
        print(f"tp{tp}: no CSV"); continue
    lay = df[df.stage == "layer"]
    tri = lay[(lay.backend == "triton") & (lay.cuda_graph.astype(str) == "True")].set_index("tokens")
    tor = lay[lay.backend == "torch"].set_index("tokens")
    print(f"\nMoE tp{tp} (triton in CUDA graphs): T, us, %copy, %gemm, rel_err, speedup vs torch")
    for t, r in tri.iterrows():
        sp = f"{tor.loc[t, 'time_us'] / r.time_us:.1f}x" if t in tor.index else "-"
        print(f"{t:5d} {r.time_us:9.1f} {r.pct_of_copy_bw:6.1f} {r.pct_of_gemm_peak:6.1f} {r.rel_err} {sp}")
PY
