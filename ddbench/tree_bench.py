"""`ddbench tree-bench`: time the DDTree kernels (DESIGN §5) over budgets, streams, prefix
lengths and heads; one tidy CSV row per measurement.

kernel     what is timed                                                   timing
topk       `topk_from_logits` on drafter logits [streams, positions, vocab]  CUDA graph
build      `build_tree` (builder + visibility) for one budget               CUDA graph
attn       `mla_attention`, T = 1 (decode) or budget + 1 (tree verify)      CUDA graph, cold KV
accept     `greedy_accept` on a built tree, planted accepted paths          CUDA graph
commit     `commit_kv` on one layer's cache, and on all layers folded       CUDA graph
accept_commit  accept then commit (one layer), the pair the engine runs     CUDA graph

Attention is timed as the engine runs it: a CUDA graph replaying calls that each read
one of 4 cache copies (more than the L2), so no host launch time and no warm cache are in
the number (`attn_bench`). Eager timing with an L2 flush measured the host's ~110-170 us
of Python launch work instead whenever that exceeded the flush (`docs/notes/tree.md`).

Attention rows carry the KV bytes read (streams x (prefix + T) x (latent + rope) x dtype
bytes), the achieved GB/s on them, the device copy bandwidth measured in this run
(`ddbench.timing.copy_bandwidth_gbps`, bytes read + written) and the percentage, plus
FLOPs (all T x H query rows against all prefix + T positions) and TFLOP/s. Without a GPU
the command runs a tiny preset under the Triton interpreter, and says so: those times
say nothing about a GPU.
"""
from __future__ import annotations

import os

import torch

from ddbench import UserError

COLUMNS = ["kernel", "streams", "budget", "nodes", "t", "prefix", "heads", "topk", "positions",
           "layers", "dtype", "time_us", "time_us_p20", "time_us_p80", "cuda_graph", "kv_bytes",
           "bw_gbps", "copy_bw_gbps", "pct_copy_bw", "flops", "tflops", "max_abs_err",
           "variant", "device"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KERNELS = ("topk", "build", "attn", "accept", "commit")
TINY = dict(budgets=[8, 16], streams=[1, 2], prefixes=[32, 64], heads=[2], topk=4, positions=4,
            vocab=256, dtype="fp32", reps=3, layers=2, latent=64, rope=16)


def plan_attention(budgets, streams, prefixes, heads, max_gflop, latent=512, rope=64):
    """[(streams, budget, t, prefix, heads)] with T = 1 (budget 0) and budget + 1, under the FLOP cap."""
    jobs, skipped = [], 0
    for b in streams:
        for p in prefixes:
            for h in heads:
                for budget in [0, *budgets]:
                    t = budget + 1
                    if attn_flops(b, t, h, p, latent, rope) > max_gflop * 1e9:
                        skipped += 1
                        continue
                    jobs.append((b, budget, t, p, h))
    # cheapest first, so a run cut off by a time limit keeps most rows
    jobs.sort(key=lambda j: attn_flops(j[0], j[2], j[4], j[3], latent, rope))
    return jobs, skipped


def attn_flops(b, t, h, prefix, dl, dr) -> float:
    """QK (latent + rope) and PV FLOPs of every query row against every visible-range position."""
    return 2.0 * b * t * h * (prefix + t) * (dl + dr + dl)


def attn_bench(call, make_cache, *, device, reps, use_graph, copies=4):
    """Time `call(ckv, kpe)` with the KV cold, the way the engine runs it: on CUDA a graph
    of `copies` calls is replayed, each call reading the next of the fresh cache copies (made
    by `make_cache()`; more bytes than the L2, so each call streams its KV from HBM); no
    host launch time is in the number. Eager (no graph): CUDA events around each call after
    an L2 flush. Returns ddbench.timing Stats per call."""
    from ddbench.timing import bench

    if not use_graph:
        ckv, kpe = make_cache()
        return bench(lambda: call(ckv, kpe), device=device, warmup=1, reps=reps, flush=True)
    caches = [make_cache() for _ in range(copies)]
    i = iter(range(10**9))

    def step():
        ckv, kpe = caches[next(i) % copies]
        call(ckv, kpe)
    return bench(step, device=device, warmup=copies, reps=reps, graph=True, graph_ops=copies)


def _kernel_record(device) -> dict:
    """The kernel choice these calls run under (every default: `mla_attention` with its
    default PDL mode and tiles), resolved on `device`."""
    from ddbench.kernels.select import KernelChoice, resolve

    return resolve(KernelChoice(), device)


def planted_argmax(tree, gen, n_pos):
    """Target argmax per node that accepts a random-depth path (up to the tree's depth)."""
    b, n = tree.parent.shape
    am = torch.randint(0, 2**30, (b, n), generator=gen, device="cpu")
    par, tok, dep = tree.parent.cpu(), tree.token.cpu(), tree.depth.cpu()
    for s in range(b):
        want = int(torch.randint(0, n_pos + 1, (1,), generator=gen))
        deep = (dep[s] <= want).nonzero().flatten()
        leaf = int(deep[dep[s][deep].argmax()])
        while leaf > 0:
            am[s, par[s, leaf]] = tok[s, leaf]
            leaf = int(par[s, leaf])
    return am.to(tree.parent.device)


def run(*, budgets, streams, prefixes, heads, topk, positions, dtype, kernels, max_attn_gflop,
        reps, layers, preset, override, seed, out, name):
    from rich.console import Console
    from rich.progress import Progress

    from ddbench.table import print_table

    console = Console()
    cuda = torch.cuda.is_available()
    if not cuda:
        # Triton kernels need the interpreter without a GPU; must be set before kernels import
        os.environ["TRITON_INTERPRET"] = "1"
    from ddbench.results import ResultWriter, run_metadata
    from ddbench.timing import bench, copy_bandwidth_gbps
    from ddbench.engine.config import parse_overrides, preset as make_preset
    from ddbench.kernels.ddtree import build_tree, commit_kv, greedy_accept, max_nodes, topk_from_logits
    from ddbench.kernels.mla_attn import mla_attention, mla_attention_ref

    bad = [k for k in kernels if k not in KERNELS]
    if bad:
        raise UserError(f"--kernels {bad}: choose from {', '.join(KERNELS)}")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose bf16, fp16 or fp32")
    if not max_attn_gflop > 0:
        raise UserError(f"--max-attn-gflop {max_attn_gflop}: must be positive")
    for what, values in [("--budgets", budgets), ("--streams", streams), ("--prefixes", prefixes),
                         ("--heads", heads), ("--reps", [reps]), ("--topk", [topk]),
                         ("--positions", [positions]), ("--layers", [layers])]:
        if any(v < 1 for v in values):
            raise UserError(f"{what} must be >= 1")
    too_big = [b for b in budgets if b > min(max_nodes(positions, topk), 2046)]
    if too_big:
        raise UserError(f"--budgets {too_big}: at most {min(max_nodes(positions, topk), 2046)} nodes "
                        f"for {positions} positions x top-{topk}")
    cfg = make_preset(preset, **parse_overrides(override))
    latent, rope, vocab = cfg.kv_lora_rank, cfg.qk_rope_dim, cfg.vocab
    if not cuda:
        console.print("[yellow]no CUDA GPU: running the tiny CPU preset under the Triton interpreter "
                      "(budgets 8,16; streams 1,2; prefixes 32,64; 2 heads; fp32). These times say "
                      "nothing about a GPU.[/yellow]")
        budgets, streams, prefixes, heads = TINY["budgets"], TINY["streams"], TINY["prefixes"], TINY["heads"]
        topk, positions, vocab = TINY["topk"], TINY["positions"], TINY["vocab"]
        dtype, reps = TINY["dtype"], TINY["reps"]
        layers, latent, rope = TINY["layers"], TINY["latent"], TINY["rope"]
    too_big = [b for b in budgets if b > min(max_nodes(positions, topk), 2046)]
    if too_big:
        raise UserError(f"--budgets {too_big}: at most {min(max_nodes(positions, topk), 2046)} nodes "
                        f"for {positions} positions x top-{topk}")
    if topk > vocab:
        raise UserError(f"--topk {topk} > vocab {vocab}")
    dev = torch.device("cuda" if cuda else "cpu")
    dt = DTYPES[dtype]
    gen = torch.Generator(device="cpu").manual_seed(seed)          # small host-side draws
    dgen = torch.Generator(device=dev).manual_seed(seed)           # bulk data, drawn on the device

    def randn(*shape):
        return torch.randn(*shape, generator=dgen, device=dev).to(dt)
    graph = cuda
    device_name = torch.cuda.get_device_name(dev) if cuda else "cpu (Triton interpreter)"

    copy_bw = copy_bandwidth_gbps(dev) if cuda else copy_bandwidth_gbps(dev, 2**24)
    attn_jobs, skipped = ([], 0)
    if "attn" in kernels:
        attn_jobs, skipped = plan_attention(budgets, streams, prefixes, heads, max_attn_gflop, latent, rope)
    if skipped:
        console.print(f"attn: skipping {skipped} configs above --max-attn-gflop {max_attn_gflop}")
    n_jobs = (len(streams) * ("topk" in kernels) + len(streams) * len(budgets) * (("build" in kernels)
              + 2 * ("accept" in kernels) + ("commit" in kernels)) + len(attn_jobs))
    meta = run_metadata("tree_bench", preset=cfg.name, seed=seed, dtype=dtype, cpu_tiny=not cuda,
                        copy_bw_gbps=copy_bw, latent=latent, rope=rope, vocab=vocab,
                        attn_skipped_above_gflop=skipped, kernels=_kernel_record(dev))
    base = {c: "" for c in COLUMNS}
    base.update(dtype=dtype, topk=topk, positions=positions, device=device_name, copy_bw_gbps=round(copy_bw, 1))

    def timed(fn, use_graph):
        return bench(fn, device=dev, warmup=2 if cuda else 1, reps=reps, flush=not use_graph,
                     graph=use_graph and graph, graph_ops=10)

    with ResultWriter(out, "tree_bench", meta=meta, name=name) as rw, Progress(console=console) as prog:
        task = prog.add_task("tree-bench", total=n_jobs)

        def emit(**row):
            st = row.pop("stats")
            rw.write({**base, **row, **st.row(), "cuda_graph": st.cuda_graph})
            prog.advance(task)

        for b in streams:
            logits = randn(b, positions, vocab) * 4
            if "topk" in kernels:
                emit(kernel="topk", streams=b, stats=timed(lambda: topk_from_logits(logits, topk), True))
            lp, ids = topk_from_logits(logits, topk)
            for budget in budgets:
                n = budget + 1
                common = dict(streams=b, budget=budget, nodes=n)
                if "build" in kernels:
                    emit(kernel="build", **common, stats=timed(lambda: build_tree(lp, ids, budget), True))
                tree = build_tree(lp, ids, budget)
                am = planted_argmax(tree, gen, positions)
                if "accept" in kernels or "commit" in kernels:
                    acc, _, _ = greedy_accept(tree.parent, tree.token, am, positions)
                    s_len = 64 + n
                    prefix = torch.full((b,), 64, device=dev, dtype=torch.int32)
                    ckv = randn(b, s_len, latent)
                    kpe = randn(b, s_len, rope)
                if "accept" in kernels:
                    emit(kernel="accept", **common,
                         stats=timed(lambda: greedy_accept(tree.parent, tree.token, am, positions), True))

                    def step():
                        a, _, _ = greedy_accept(tree.parent, tree.token, am, positions)
                        commit_kv(ckv, kpe, prefix, a)
                    emit(kernel="accept_commit", **common, layers=1, stats=timed(step, True))
                if "commit" in kernels:
                    emit(kernel="commit", **common, layers=1,
                         stats=timed(lambda: commit_kv(ckv, kpe, prefix, acc), True))
                    # all layers folded into the stream dim, as engine.kv_cache.KVCache.commit does
                    ckv_all = randn(layers * b, s_len, latent)
                    kpe_all = randn(layers * b, s_len, rope)
                    pre_all, acc_all = prefix.repeat(layers), acc.repeat(layers, 1)
                    emit(kernel="commit", **common, layers=layers,
                         stats=timed(lambda: commit_kv(ckv_all, kpe_all, pre_all, acc_all), True))
                    del ckv_all, kpe_all

        for b, budget, t, p, h in attn_jobs:
            # the cache is allocated at p + T here; the kernel sizes its work from prefix_len
            # on the device, so a larger capacity (the engine's max_len) reads the same bytes
            ckv, kpe = randn(b, p + t, latent), randn(b, p + t, rope)
            q_lat, q_rope = randn(b, t, h, latent), randn(b, t, h, rope)
            plen = torch.full((b,), p, device=dev, dtype=torch.int32)
            if budget:
                lp_t, ids_t = topk_from_logits(randn(b, positions, vocab) * 4, topk)
                vis = build_tree(lp_t, ids_t, budget).visible
            else:
                vis = torch.ones(b, 1, 1, dtype=torch.bool, device=dev)
            scale = (cfg.qk_nope_dim + cfg.qk_rope_dim) ** -0.5
            err = ""
            if b * t * h * (p + t) <= 2e7:
                ref = mla_attention_ref(q_lat, q_rope, ckv, kpe, plen, vis, scale)
                got = mla_attention(q_lat, q_rope, ckv, kpe, plen, vis, scale)
                err = float((ref.float() - got.float()).abs().max())
                del ref, got
            st = attn_bench(lambda c, k: mla_attention(q_lat, q_rope, c, k, plen, vis, scale),
                            lambda: (randn(b, p + t, latent), randn(b, p + t, rope)),
                            device=dev, reps=reps, use_graph=graph)
            kv_bytes = b * (p + t) * (latent + rope) * ckv.element_size()
            fl = attn_flops(b, t, h, p, latent, rope)
            bw = kv_bytes / (st.median_us * 1e-6) / 1e9
            emit(kernel="attn", streams=b, budget=budget, nodes=t, t=t, prefix=p, heads=h,
                 kv_bytes=kv_bytes, bw_gbps=round(bw, 1), pct_copy_bw=round(100 * bw / copy_bw, 1),
                 flops=fl, tflops=round(fl / (st.median_us * 1e-6) / 1e12, 2), max_abs_err=err, stats=st)
        rows = rw.rows

    if not rows:
        console.print(f"no rows measured (nothing to time for --kernels {','.join(kernels)}); no CSV written")
        return None
    shown = [r for r in rows if not (r["kernel"] == "attn" and r["t"] not in (1, 17, 65) and cuda)]
    print_table(shown, ("kernel", "streams", "budget", "t", "prefix", "heads", "layers", "time_us", "pct_copy_bw",
                        "tflops", "time_us_p20", "time_us_p80", "bw_gbps", "max_abs_err"),
                key=("kernel", "streams", "budget", "t", "prefix", "heads", "time_us"), console=console,
                title=f"tree-bench on {device_name} (copy {copy_bw:.0f} GB/s)"
                      + ("  [CPU tiny preset, interpreter]" if not cuda else "")
                      + (f"; attention at T = 1, 17, 65 of {sum(r['kernel'] == 'attn' for r in rows)} rows"
                         if len(shown) < len(rows) else ""),
                where=rw.path.name)
    console.print(f"wrote {rw.path}")
    return rw.path


# --tune: knob variants of the two kernels whose defaults were picked without a GPU sweep
ATTN_VARIANTS = {   # (T, heads) at 10 streams x 8k prefix -> mla_attention keyword overrides
    # use_pdl=False: both launches without programmatic dependent launch (on by default on Hopper)
    (1, 8): [{}, dict(waves=1.5), dict(block_n=64, num_stages=2), dict(block_n=16, num_stages=6), dict(use_pdl=False)],
    (17, 8): [{}, dict(block_m=64, num_warps=8)],
    (65, 8): [{}],
    (1, 64): [{}, dict(use_pdl=False)],
}
BUILD_WARPS = (1, 2, 4, 8, 16)


def run_tune(*, topk, positions, reps, seed, out, name, time_limit_s=40.0):
    """Time knob variants (GPU only): attention at 10 streams x 8k prefix bf16, builder warps
    at budgets 64/512 x 10 streams, within about time_limit_s + 12 s (compiles included).
    Rows carry `variant`; the default is `{}`."""
    import time

    from rich.console import Console

    from ddbench.results import ResultWriter, run_metadata
    from ddbench.timing import bench, copy_bandwidth_gbps
    from ddbench.kernels.ddtree import build_tree, topk_from_logits
    from ddbench.kernels.mla_attn import mla_attention, mla_attention_ref

    if not torch.cuda.is_available():
        raise UserError("--tune needs a CUDA GPU")
    console = Console()
    dev, dt, b, p = torch.device("cuda"), torch.bfloat16, 10, 8192
    t0 = time.time()
    copy_bw = copy_bandwidth_gbps(dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    base = {c: "" for c in COLUMNS}
    base.update(dtype="bf16", topk=topk, positions=positions, device=torch.cuda.get_device_name(dev),
                copy_bw_gbps=round(copy_bw, 1))
    meta = run_metadata("tree_bench", seed=seed, dtype="bf16", tune=True, copy_bw_gbps=copy_bw,
                        kernels=_kernel_record(dev))
    ckv = torch.randn(b, p + 65, 512, device=dev, generator=g).to(dt)
    kpe = torch.randn(b, p + 65, 64, device=dev, generator=g).to(dt)
    plen = torch.full((b,), p, device=dev, dtype=torch.int32)
    with ResultWriter(out, "tree_bench", meta=meta, name=name) as rw:
        for (t, h), variants in ATTN_VARIANTS.items():
            q_lat = torch.randn(b, t, h, 512, device=dev, generator=g).to(dt)
            q_rope = torch.randn(b, t, h, 64, device=dev, generator=g).to(dt)
            vis = torch.tril(torch.ones(t, t, dtype=torch.bool, device=dev)).expand(b, t, t).contiguous()
            c, k = ckv[:, :p + t], kpe[:, :p + t]
            kv_bytes = b * (p + t) * 576 * 2
            fl = attn_flops(b, t, h, p, 512, 64)
            ref = mla_attention_ref(q_lat, q_rope, c, k, plen, vis, 0.07)
            for var in variants:
                if time.time() - t0 > time_limit_s:
                    console.print("tune: time limit reached, stopping")
                    break
                tag = ",".join(f"{a}={v}" for a, v in var.items()) or "default"
                try:
                    err = float((mla_attention(q_lat, q_rope, c, k, plen, vis, 0.07, **var).float()
                                 - ref.float()).abs().max())
                    st = attn_bench(lambda c, k: mla_attention(q_lat, q_rope, c, k, plen, vis, 0.07, **var),
                                    lambda: (torch.randn(b, p + t, 512, device=dev, generator=g).to(dt),
                                             torch.randn(b, p + t, 64, device=dev, generator=g).to(dt)),
                                    device=dev, reps=reps, use_graph=True)
                except Exception as e:  # a variant that does not compile is a result too
                    console.print(f"attn T={t} H={h} {tag}: FAILED {type(e).__name__}: {str(e)[:200]}")
                    continue
                bw = kv_bytes / (st.median_us * 1e-6) / 1e9
                rw.write({**base, "kernel": "attn", "streams": b, "budget": t - 1, "nodes": t, "t": t,
                          "prefix": p, "heads": h, "kv_bytes": kv_bytes, "bw_gbps": round(bw, 1),
                          "pct_copy_bw": round(100 * bw / copy_bw, 1), "flops": fl,
                          "tflops": round(fl / (st.median_us * 1e-6) / 1e12, 2), "max_abs_err": err,
                          "variant": tag, **st.row(), "cuda_graph": st.cuda_graph})
                console.print(f"attn T={t:3d} H={h:2d} {tag:40s} {st.median_us:8.1f} us  "
                              f"{100 * bw / copy_bw:5.1f}% copy")
        logits = torch.randn(b, positions, 163840, device=dev, generator=g).to(dt) * 4
        lp, ids = topk_from_logits(logits, topk)
        for budget in (64, 512):
            for nw in BUILD_WARPS:
                if time.time() - t0 > time_limit_s + 12:
                    break
                try:
                    st = bench(lambda: build_tree(lp, ids, budget, num_warps=nw), device=dev, reps=reps,
                               graph=True, graph_ops=5, flush=False)
                except Exception as e:
                    console.print(f"build {budget} warps {nw}: FAILED {type(e).__name__}: {str(e)[:200]}")
                    continue
                rw.write({**base, "kernel": "build", "streams": b, "budget": budget, "nodes": budget + 1,
                          "variant": f"num_warps={nw}", **st.row(), "cuda_graph": st.cuda_graph})
                console.print(f"build budget {budget:4d} x {b} warps {nw:2d}: {st.median_us:8.1f} us")
    console.print(f"wrote {rw.path}")
    return rw.path


def summary(csv_path) -> None:
    """Print the issue's three GPU targets from a tree-bench CSV (used by scripts/gpu/tree.sh)."""
    import pandas as pd

    df = pd.read_csv(csv_path)
    if "variant" in df and df.variant.notna().any():          # a --tune run
        print(f"== tree-bench --tune ({csv_path}) ==")
        for r in df.itertuples():
            what = f"T={int(r.t)} H={int(r.heads)}" if r.kernel == "attn" else f"budget {int(r.budget)}"
            extra = f"{r.pct_copy_bw:5.1f}% copy, {r.tflops:6.1f} TFLOP/s" if r.kernel == "attn" else ""
            print(f"{r.kernel:5s} {what:12s} {r.variant:40s} {r.time_us:8.1f} us  {extra}")
        return

    def pick(kernel, **eq):
        g = df[df.kernel == kernel]
        for k, v in eq.items():
            g = g[g[k] == v]
        return g

    print(f"== tree-bench targets ({csv_path}) ==")
    for budget in (64, 256, 512, 1024):
        for r in pick("build", streams=10, budget=budget).itertuples():
            print(f"builder   budget {budget:4d} x 10 streams: {r.time_us:8.1f} us (graph={r.cuda_graph})")
    for r in pick("attn", streams=10, heads=8, prefix=8192).sort_values("t").itertuples():
        ok = "OK " if r.pct_copy_bw >= 60 else "LOW"
        print(f"attn {ok} 8 heads x 10 streams x 8k, T={int(r.t):4d}: {r.time_us:8.1f} us  {r.bw_gbps:7.0f} GB/s "
              f"= {r.pct_copy_bw:5.1f}% of copy {r.copy_bw_gbps:.0f}  {r.tflops:6.1f} TFLOP/s  "
              + (f"max err vs ref {r.max_abs_err:.3g}" if r.max_abs_err == r.max_abs_err else "(too big to check)"))
    for budget in (16, 64, 256, 512):
        for r in pick("accept_commit", streams=10, budget=budget).itertuples():
            ok = "OK " if r.time_us < 20 else "HIGH"
            print(f"accept+commit {ok} 10 streams, budget {budget:4d}: {r.time_us:6.1f} us (graph={r.cuda_graph})")
        for r in pick("commit", streams=10, budget=budget).itertuples():
            print(f"  commit alone, {int(r.layers)} layer(s): {r.time_us:6.1f} us")
