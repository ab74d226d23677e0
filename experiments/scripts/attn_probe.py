"""mla_attention at T = 1 (decode), 8 heads, over min_chunk and pdl choices (H200, CUDA graphs, cold KV).

python3 -m experiments.scripts.attn_probe [OUT_DIR] [VARIANTS]: shapes (streams x prefix) 1x160 (the decode
benchmark), 1x8k, 10x1k, 10x8k; cache capacity 32k as the engine allocates it; checks each
call against mla_attention_ref; prints us and % of copy bandwidth on the KV bytes; writes
OUT_DIR/attn_probe.csv. About 20 s.
"""
import csv
import sys
from pathlib import Path

import torch

from ddbench.timing import copy_bandwidth_gbps
from ddbench.tree_bench import attn_bench
from ddbench.kernels.mla_attn import mla_attention, mla_attention_ref

out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
copy = copy_bandwidth_gbps(dev)
S, H, L, R = 32768, 8, 512, 64
# min_chunk:launch, e.g. "64:pdl" (both launches with programmatic dependent launch)
VARIANTS = (sys.argv[2] if len(sys.argv) > 2 else "32:plain,64:plain,128:plain").split(",")
rows = []
for b, prefix in ((1, 160), (1, 8192), (10, 1024), (10, 8192)):
    q = torch.randn(b, 1, H, L, device=dev, dtype=torch.bfloat16)
    qr = torch.randn(b, 1, H, R, device=dev, dtype=torch.bfloat16)
    plen = torch.full((b,), prefix, dtype=torch.int32, device=dev)
    vis = torch.ones(b, 1, 1, dtype=torch.bool, device=dev)

    def cache():
        return (torch.randn(b, S, L, device=dev, dtype=torch.bfloat16), torch.randn(b, S, R, device=dev, dtype=torch.bfloat16))
    kv_bytes = b * (prefix + 1) * (L + R) * 2
    ckv, kpe = cache()
    ref = mla_attention_ref(q, qr, ckv[:, :prefix + 1], kpe[:, :prefix + 1], plen, vis, 0.07).float()
    for mc, pdl in [(int(m), p == "pdl") for m, p in (v.split(":") for v in VARIANTS)]:
        err = ((mla_attention(q, qr, ckv, kpe, plen, vis, 0.07, min_chunk=mc, use_pdl=pdl).float() - ref).norm()
               / ref.norm()).item()
        st = attn_bench(lambda c, k: mla_attention(q, qr, c, k, plen, vis, 0.07, min_chunk=mc, use_pdl=pdl), cache,
                        device=dev, reps=10, use_graph=True, copies=3)
        rows.append(dict(streams=b, prefix=prefix, min_chunk=mc, pdl=pdl, time_us=round(st.median_us, 2),
                         pct_copy=round(100 * kv_bytes / st.median_us / 1e3 / copy, 1), rel_err=f"{err:.1e}"))
        print(rows[-1], flush=True)
    del ckv, kpe
with open(out / "attn_probe.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
print(f"copy {copy:.0f} GB/s")
