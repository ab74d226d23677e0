#!/usr/bin/env bash
# ddbench pack on the GPU: one K2.6 MoE layer, TP-8 rank 0 and TP-1, verified bit-exact.
# Writes the packed layers to /tmp (about 1.2 GB and 9.4 GB) and keeps the manifests.
# Expected runtime: under 90 s.
cd "$(dirname "$0")/../.."
. scripts/gpu/lib.sh
mkdir -p $RES/pack
for tp in 8 1; do
  python3 -m ddbench pack --preset k2.6 --tp $tp --rank 0 --layers 1 --verify --device cuda --out /tmp/ddbench-pack \
    || echo "FAILED pack tp$tp"
  d=$(ls -dt /tmp/ddbench-pack/pack_k2.6_tp${tp}_r0_* 2>/dev/null | head -1)
  [ -n "$d" ] && cp "$d/manifest.json" "$RES/pack/manifest_tp${tp}.json"
  rm -rf /tmp/ddbench-pack
done
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["RES"] + "/pack/manifest_tp*.json")):
    m = json.load(open(f)); L = m["layers"]["1"]
    gb = sum(t["bytes"] for t in L["tensors"].values()) / 1e9
    print(f"pack tp={m['tp']}: {gb:.2f} GB Marlin, generate {L['generate_s']} s, pack {L['pack_s']} s, "
          f"verify {L['verify_s']} s, write {L['write_s']} s, verified={L['verified']}")
PY
