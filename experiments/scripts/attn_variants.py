"""mla_attention variants against an older kernel file, on the H200 (issue 5 probe).

python3 -m experiments.scripts.attn_variants OLD_MLA_ATTN_PY: every variant is timed as a CUDA graph
of 8 calls over 4 cold cache copies (graph_us), and per kernel with the torch profiler
(split_us, combine_us); rel_err against mla_attention_ref; pct = KV bytes / graph time
against the copy bandwidth measured first. The runs in docs/notes/tree.md used
`git show b8c7dfd:kernels/mla_attn.py > old.py` as the old kernel. Writes
$OUT/attn_variants.json (or ./). About 2-4 minutes, mostly Triton compiles.
"""
import importlib.util
import json
import os
import sys

import torch

from ddbench.timing import copy_bandwidth_gbps
from ddbench.kernels.mla_attn import mla_attention as NEW, mla_attention_ref

_spec = importlib.util.spec_from_file_location("mla_old", sys.argv[1])
_old = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_old)
OLD = _old.mla_attention
dev = torch.device("cuda")
copy_bw = copy_bandwidth_gbps(dev)
print(f"copy bw {copy_bw:.0f} GB/s", flush=True)
NBUF, ROWS, OUT = 4, [], os.environ.get("OUT", ".")

def make(b, p, h, t, s_len):
    g = torch.Generator(device=dev).manual_seed(b * 7 + p + h + t)
    bufs = [(torch.randn(b, s_len, 512, device=dev, generator=g).to(torch.bfloat16),
             torch.randn(b, s_len, 64, device=dev, generator=g).to(torch.bfloat16)) for _ in range(NBUF)]
    q = torch.randn(b, t, h, 512, device=dev, generator=g).to(torch.bfloat16)
    qr = torch.randn(b, t, h, 64, device=dev, generator=g).to(torch.bfloat16)
    plen = torch.full((b,), p, device=dev, dtype=torch.int32)
    vis = torch.tril(torch.ones(t, t, dtype=torch.bool, device=dev)).expand(b, t, t).contiguous()
    return bufs, q, qr, plen, vis

def graph_us(fn, n=8, reps=15):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(NBUF): fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n): fn(i % NBUF)
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); e.record(); e.synchronize()
        ts.append(a.elapsed_time(e) * 1e3 / n)
    return sorted(ts)[len(ts) // 2]

def prof_us(fn, n=16):
    from torch.profiler import profile, ProfilerActivity
    for i in range(NBUF): fn(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as pr:
        for i in range(n): fn(i % NBUF)
        torch.cuda.synchronize()
    sp = sum(e.device_time_total for e in pr.key_averages() if "split" in e.key)
    cb = sum(e.device_time_total for e in pr.key_averages() if "combine" in e.key)
    return sp / n, cb / n

def case(name, b, p, h, t, variants):
    bufs, q, qr, plen, vis = make(b, p, h, t, p + t + 64)
    kv = (p + t) * b * 1152
    ref = mla_attention_ref(q, qr, bufs[0][0], bufs[0][1], plen, vis, 0.07).float() if b * t * h * p <= 4e7 else None
    for vname, impl, kw in variants:
        fn = lambda i, impl=impl, kw=kw: impl(q, qr, bufs[i][0], bufs[i][1], plen, vis, 0.07, **kw)
        try:
            out = fn(0).float()
            err = float((out - ref).norm() / ref.norm()) if ref is not None else float("nan")
            gr = graph_us(fn); sp, cb = prof_us(fn)
        except Exception as e:
            print(f"{name} {vname}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True); continue
        r = dict(case=name, variant=vname, rel_err=err, graph_us=gr, split_us=sp, combine_us=cb,
                 pct=100 * kv / (gr * 1e3) / copy_bw, split_pct=100 * kv / (sp * 1e3) / copy_bw)
        ROWS.append(r); print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
        json.dump(ROWS, open(f"{OUT}/attn_variants.json", "w"))
    del bufs; torch.cuda.empty_cache()

V = lambda name, **kw: (name, NEW, kw)
main = [("old", OLD, {}), V("new"), V("new merge 4 warps", merge_tile=(32, 32, 4)),
        V("new merge 16 cols 1 warp", merge_tile=(16, 32, 1)), V("new, no pdl", use_pdl=False)]
case("B10 p8k H8 T1", 10, 8192, 8, 1, main + [(n + " again", f, kw) for n, f, kw in main[:2]])
quick = [("old", OLD, {}), V("new")]
for args in [(1, 160, 8, 1), (1, 8192, 8, 1), (10, 1024, 8, 1), (10, 32768, 8, 1), (32, 8192, 8, 1), (10, 8192, 64, 1), (10, 8192, 8, 17)]:
    case(f"B{args[0]} p{args[1]} H{args[2]} T{args[3]}", *args, quick)
print(f"\n{'case':24s} {'variant':26s} {'err':>8s} {'graph':>7s} {'split':>7s} {'comb':>6s} {'%':>5s} {'%split':>6s}")
for r in ROWS:
    print(f"{r['case']:24s} {r['variant']:26s} {r['rel_err']:8.1e} {r['graph_us']:7.1f} {r['split_us']:7.1f} {r['combine_us']:6.1f} {r['pct']:5.1f} {r['split_pct']:6.1f}")
