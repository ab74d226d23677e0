"""`ddbench moe-sweep`: the INT4 MoE GEMM (w13 -> SiLU*up -> w2 -> weighted sum) over token counts.

Answers: at the verify batch shape, is the INT4 MoE memory-bound enough that more tokens
per weight read are nearly free, and how close to the hardware limit is each backend?

Per token count T and routing it builds the routing (synthetic or K2.6's router on a
random router weight), then times each backend for the whole layer and for each GEMM
(`stage` = layer | w13 | w2) and writes one tidy row per measurement with the roofline
columns: bytes_moved (the touched experts' packed weights and scales plus the activations
in and out: the bytes floor; intermediates are the kernel's overhead), flops
(2 * T * k * 3 * H * I for the layer), and both floors from the machine's copy bandwidth and
bf16 GEMM rate measured at the start of the same run.

Timing (DESIGN §6): on a GPU the triton backend is timed eager (L2 flushed before each
repeat) and, with --graphs, in a CUDA graph of `ROT` calls over rotated inputs and
routings so that small-T replays do not find their experts in L2. The torch reference
syncs with the host (unique experts), so it is eager only.
"""
from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import torch

from ddbench import UserError
from ddbench.results import run_location
from ddbench.timing import pick_device

BACKENDS = ("torch", "triton")
ROUTINGS = ("uniform", "skewed", "balanced", "router")
DEFAULT_TOKENS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096"
ROT = 10  # rotated inputs per CUDA graph


def parse_choices(text: str, allowed, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise UserError(f"{what}: unknown {', '.join(bad) or 'empty list'}; choose from {', '.join(allowed)}")
    return items


def load_tiles(path: Path | None):
    """`--tiles FILE`: JSON list of {"max_per_expert": x, <MoeTritonConfig fields>} -> table."""
    if path is None:
        return None
    try:
        rows = json.loads(Path(path).read_text())
        table = sorted(((float(r.pop("max_per_expert")), r) for r in rows), key=lambda x: x[0])
        from ddbench.kernels.moe_triton import MoeTritonConfig

        for _, fields in table:
            MoeTritonConfig(**fields)
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        raise UserError(f"--tiles {path}: {e}") from None
    if not table:
        raise UserError(f"--tiles {path}: empty table")
    table[-1] = (float("inf"), table[-1][1])      # the last row covers everything above
    return table


class Case:
    """Inputs for one (T, routing): ROT rotations of x and routing (one on the CPU)."""

    def __init__(self, cfg, w, tokens: int, routing: str, dtype, dev, seed: int, n_rot: int,
                 router=None, hot: int = 16, hot_share: float = 0.5):
        from ddbench.kernels.moe import route, synthetic_routing

        self.tokens = tokens
        self.xs, self.routes = [], []
        for r in range(n_rot):
            g = torch.Generator(device=dev).manual_seed(seed * 7919 + tokens * 31 + r)
            x = torch.randn(tokens, cfg.hidden, generator=g, device=dev).to(dtype)
            if routing == "router":
                ids, tw = route(x, router[0], router[1], cfg.top_k, cfg.routed_scaling)
            else:
                ids, tw = synthetic_routing(routing, tokens, cfg.n_experts, cfg.top_k, device=dev,
                                            seed=seed * 7919 + tokens * 31 + r, hot=hot, hot_share=hot_share)
            self.xs.append(x)
            self.routes.append((ids, tw))
        self.touched = sum(torch.unique(ids).numel() for ids, _ in self.routes) / n_rot

    def cycle(self):
        return itertools.cycle(range(len(self.xs)))


def roofline(cfg, w, tokens: int, touched: float, elt: int) -> dict[str, dict]:
    """Bytes floor and FLOPs per stage (see module docstring)."""
    h, i, k = cfg.hidden, cfg.moe_inter_local, cfg.top_k
    b13 = sum(t[0].numel() * t.element_size() for t in (w.w13, w.w13_scale))
    b2 = sum(t[0].numel() * t.element_size() for t in (w.w2, w.w2_scale))
    act = tokens * k * i * elt
    return {
        "layer": dict(bytes=touched * (b13 + b2) + 2 * tokens * h * elt, flops=2 * tokens * k * 3 * h * i),
        "w13": dict(bytes=touched * b13 + tokens * h * elt + act, flops=2 * tokens * k * 2 * h * i),
        "w2": dict(bytes=touched * b2 + act + tokens * h * elt, flops=2 * tokens * k * h * i),
    }


def stage_fns(backend: str, case: Case, w, mcfg, dtype):
    """{stage: fn()} for one backend, each fn cycling through the case's rotations."""
    from ddbench.kernels import moe

    it = case.cycle()
    if backend == "torch":
        acts = [moe.moe_ref_w13(x, ids, w, dtype) for x, (ids, _) in zip(case.xs, case.routes)]

        def layer():
            r = next(it)
            return moe.fused_moe_ref(case.xs[r], *case.routes[r], w, compute_dtype=dtype)

        def w13():
            r = next(it)
            return moe.moe_ref_w13(case.xs[r], case.routes[r][0], w, dtype)

        def w2():
            r = next(it)
            return moe.moe_ref_w2(acts[r], *case.routes[r], w, dtype)
        return {"layer": layer, "w13": w13, "w2": w2}

    if backend in ("marlin", "wide"):
        return _planned_stage_fns(backend, case, w, mcfg, it)
    if backend == "decode":
        return _decode_stage_fns(case, w, it)
    from ddbench.kernels import moe_triton as mt

    if mcfg.gemv:
        return _gemv_stage_fns(case, w, mcfg, dtype, it)
    k = case.routes[0][0].shape[1]
    aligned = [mt.align_tokens(ids, w.n_experts, mcfg.block_m) for ids, _ in case.routes]
    mids = [mt.triton_w13(x, a, k, w, mcfg) for x, a in zip(case.xs, aligned)]

    def layer():
        r = next(it)
        return mt.fused_moe_triton(case.xs[r], *case.routes[r], w, mcfg)

    def w13():
        r = next(it)
        return mt.triton_w13(case.xs[r], aligned[r], k, w, mcfg)

    def w2():
        r = next(it)
        return mt.triton_w2(mids[r], aligned[r], case.routes[r][1], w, mcfg, dtype)
    return {"layer": layer, "w13": w13, "w2": w2}


def _planned_stage_fns(name: str, case: Case, w, tiles: dict, it):
    """The CUDA kernels that plan, then run w13 and w2 (kernels.moe_marlin, kernels.moe_wide):
    w13 includes the planning launch; w2 the top-k weights and the sum over k."""
    from ddbench.kernels import moe_marlin as mm
    from ddbench.kernels import moe_wide as mw

    if name == "marlin":
        ch, fused, gemm13, gemm2 = 8 * tiles["ng"], mm.fused_moe_marlin, mm.marlin_w13, mm.marlin_w2
    else:
        ch, fused, gemm13, gemm2 = 16 * tiles["mt"], mw.fused_moe_wide, mw.wide_w13, mw.wide_w2
    k = case.routes[0][0].shape[1]
    plans = [mm.plan(ids, w.n_experts, ch) for ids, _ in case.routes]
    acts = [gemm13(x, p, k, w, tiles) for x, p in zip(case.xs, plans)]

    def layer():
        r = next(it)
        return fused(case.xs[r], *case.routes[r], w, tiles)

    def w13():
        r = next(it)
        return gemm13(case.xs[r], mm.plan(case.routes[r][0], w.n_experts, ch), k, w, tiles)

    def w2():
        r = next(it)
        return gemm2(acts[r], plans[r], case.routes[r][1], w, tiles)
    return {"layer": layer, "w13": w13, "w2": w2}


def _decode_stage_fns(case: Case, w, it):
    """The one-token CUDA kernel (kernels.moe_decode): one launch, so the layer only."""
    from ddbench.kernels import moe_decode as md

    def layer():
        r = next(it)
        return md.fused_moe_decode(case.xs[r], *case.routes[r], w)
    return {"layer": layer}


def _gemv_stage_fns(case: Case, w, mcfg, dtype, it):
    """The CUDA-core path's stages (kernels.moe_gemv): w13 includes permuting x; w2 the
    SiLU*up*weight permute and the sum over k."""
    from ddbench.kernels import moe_gemv as mg
    from ddbench.kernels import moe_triton as mt

    sms = mt.sm_count(case.xs[0].device)
    routes = [mg.gemv_routing(ids, w, mcfg) for ids, _ in case.routes]
    mids = [mg.gemv_w13(x, ids, r, w, mcfg, sms) for x, (ids, _), r in zip(case.xs, case.routes, routes)]

    def layer():
        r = next(it)
        return mt.fused_moe_triton(case.xs[r], *case.routes[r], w, mcfg)

    def w13():
        r = next(it)
        return mg.gemv_w13(case.xs[r], case.routes[r][0], routes[r], w, mcfg, sms)

    def w2():
        r = next(it)
        return mg.gemv_w2(mids[r], *case.routes[r], routes[r], w, mcfg, dtype)
    return {"layer": layer, "w13": w13, "w2": w2}


def run(*, preset: str | None, tp: int, tokens: str | None, routing: str, backends: str | None,
        graphs: bool, check: bool, reps: int, warmup: int, torch_max_tokens: int | None,
        tiles: Path | None, hot: int, hot_share: float, device: str, name: str | None,
        seed: int, out: Path, override: list[str] | None, kernel: str = "auto") -> Path:
    from ddbench.args import parse_int_list

    dev = pick_device(device)
    on_gpu = dev.type == "cuda"
    backend_list = parse_choices(backends or ("torch,triton" if on_gpu else "torch"), BACKENDS, "--backends")
    routing_list = parse_choices(routing, ROUTINGS, "--routing")
    token_list = parse_int_list(tokens or DEFAULT_TOKENS, "--tokens")
    from ddbench.kernels.moe import KERNELS, MARLIN_MIN_TOKENS, WIDE_MIN_PER_EXPERT

    parse_choices(kernel, [k for k in KERNELS if k != "torch"], "--kernel")
    if "," in kernel:
        raise UserError(f"--kernel takes one of {', '.join(k for k in KERNELS if k != 'torch')}, got {kernel!r}")
    if any(t <= 0 for t in token_list):
        raise UserError(f"--tokens must be positive, got {min(token_list)}")
    if reps <= 0 or warmup < 0:
        raise UserError("--reps must be positive and --warmup non-negative")
    if not 0 < hot_share < 1:
        raise UserError(f"--hot-share {hot_share} must be in (0, 1)")
    notes = []
    if preset is None:
        preset = "k2.6" if on_gpu else "tiny"
        if not on_gpu:
            notes.append("no GPU: running the tiny preset on the CPU (pass --preset to change)")
    if "triton" in backend_list and not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"   # before kernels.moe_triton imports triton
        notes.append("triton backend on the CPU runs under the Triton interpreter (slow; correctness only)")
    table = load_tiles(tiles)

    from rich.console import Console
    from rich.progress import Progress

    from ddbench import timing
    from ddbench.results import ResultWriter, run_metadata
    from ddbench.engine.config import parse_overrides, preset as make_preset
    from ddbench.kernels import moe

    cfg = make_preset(preset, tp=tp, rank=0, **parse_overrides(override))
    cfg.check_marlin()
    if "triton" in backend_list and cfg.group_size % 32:
        raise UserError(f"triton backend needs a group size that is a multiple of 32, got {cfg.group_size}")
    if torch_max_tokens is None:
        torch_max_tokens = 4096 if cfg.tp >= 8 or not on_gpu else 256
    console = Console(stderr=True)
    for n in notes:
        console.print(f"[yellow]note:[/] {n}")

    dtype = torch.bfloat16 if on_gpu else torch.float32
    elt = torch.tensor([], dtype=dtype).element_size()
    n_rot = ROT if on_gpu else 1
    w = moe.random_marlin_moe(cfg.n_experts, cfg.hidden, cfg.moe_inter_local, cfg.group_size, cfg.top_k,
                              device=dev, seed=seed)
    router = moe.random_router(cfg.hidden, cfg.n_experts, device=dev, seed=seed + 1) if "router" in routing_list else None
    with console.status("measuring copy bandwidth and GEMM rate"):
        if on_gpu:
            copy_gbps, gemm_tf = timing.copy_bandwidth_gbps(dev), timing.gemm_tflops(dev)
        else:
            copy_gbps, gemm_tf = timing.copy_bandwidth_gbps(dev, 2**26), timing.gemm_tflops(dev, 1024, torch.float32)

    meta = run_metadata("moe_sweep", preset=cfg.name, tp=cfg.tp, seed=seed, device=str(dev), dtype=str(dtype),
                        config=cfg.to_dict(), copy_gbps=copy_gbps, gemm_tflops=gemm_tf, notes=notes,
                        expert_bytes=w.expert_bytes(), torch_max_tokens=torch_max_tokens,
                        rotations=n_rot, tiles=str(tiles) if tiles else "default", backends=backend_list,
                        routings=routing_list, bytes_moved="touched experts' packed weights + scales, x in, out",
                        kernel=kernel, kernel_rule=("auto: decode (kernels.moe_decode) for T = 1 where it fits"
                                                    " (sm_90+); marlin (kernels.moe_marlin, tiles by T*k/E:"
                                                    f" moe_marlin.TILES) for T >= {MARLIN_MIN_TOKENS} where it fits"
                                                    " (bf16, sm_90+); wide (kernels.moe_wide, tiles by T*k/E and I:"
                                                    f" moe_wide.TILES) from T*k/E >= {WIDE_MIN_PER_EXPERT} where it"
                                                    " fits; else the Triton default table"
                                                    " (kernels.moe_triton.TILE_TABLE)"))
    if not name:
        out, name = run_location(out, "moe_sweep", tag=f"tp{cfg.tp}")
    n_sms = torch.cuda.get_device_properties(dev).multi_processor_count if on_gpu else 132
    rows = []
    with ResultWriter(out, "moe_sweep", meta, name=name) as writer, Progress(console=console) as progress:
        task = progress.add_task("moe-sweep", total=len(token_list) * len(routing_list))
        for rt in routing_list:
            for t in token_list:
                progress.update(task, description=f"{rt} T={t}")
                case = Case(cfg, w, t, rt, dtype, dev, seed, n_rot, router, hot, hot_share)
                roof = roofline(cfg, w, t, case.touched, elt)
                ref = None
                if check:
                    ref = moe.fused_moe_ref(case.xs[0].float(), *case.routes[0], w).float()
                for backend in backend_list:
                    if backend == "torch" and t > torch_max_tokens:
                        continue
                    mcfg, kname, ktile = None, "torch", ""
                    if backend == "triton":
                        kname, ktile, mcfg = _pick_kernel(kernel, t, cfg, w, dev, dtype, n_sms, table)
                    fns = stage_fns(kname if kname in ("marlin", "wide", "decode") else backend, case, w, mcfg, dtype)
                    err = None
                    if ref is not None:
                        y = fns["layer"]().float()
                        err = ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                    modes = [False] + ([True] if graphs and on_gpu and backend == "triton" else [])
                    for stage in [st for st in ("layer", "w13", "w2") if st in fns]:   # decode: layer only
                        for graph in modes:
                            if stage != "layer" and graph != modes[-1]:
                                continue  # per-GEMM rows in the best mode only
                            # the torch reference is slow at large T: fewer repeats
                            n = reps if backend == "triton" else max(3, reps // 4)
                            st = timing.bench(fns[stage], device=dev, warmup=min(warmup, 1 if backend == "torch" else warmup),
                                              reps=n, graph=graph, graph_ops=n_rot)
                            row = _row(cfg, backend, stage, rt, t, case, roof[stage], st, copy_gbps, gemm_tf,
                                       err if stage == "layer" else None, kname, ktile,
                                       str(dtype).replace("torch.", ""))
                            writer.write(row)
                            rows.append(row)
                progress.advance(task)
    _table(Console(width=max(console.width, 120)), rows, copy_gbps, gemm_tf)
    console.print(f"wrote {writer.path}")
    return writer.path


def _pick_kernel(kernel: str, t: int, cfg, w, dev, dtype, n_sms: int, table):
    """(kernel name, tile string, tiles: the marlin tile dict or a MoeTritonConfig) of one point."""
    from ddbench.kernels.moe import resolve_moe_kernel
    from ddbench.kernels.moe_triton import MoeTritonConfig, default_config

    try:
        name, tiles = resolve_moe_kernel(t, cfg.top_k, w, dev, kernel, dtype=dtype)
    except ValueError as e:
        raise UserError(f"--kernel {kernel}: {e}") from None
    if name == "marlin":
        from ddbench.kernels.moe_marlin import tile_name
        return name, tile_name(tiles), tiles
    if name == "wide":
        from ddbench.kernels.moe_wide import tile_name
        return name, tile_name(tiles), tiles
    if name == "decode":
        return name, "k{w13_splits}p{programs}".format(**tiles), tiles
    mcfg = MoeTritonConfig(**tiles)
    if table is not None:   # --tiles replaces the built-in table
        mcfg = default_config(t, cfg.top_k, cfg.n_experts, cfg.moe_inter_local, cfg.hidden, n_sms, table)
        name = "gemv" if mcfg.gemv else "triton"
    tile = (f"{'gemv-' if mcfg.gemv else ''}m{mcfg.block_m}n{mcfg.block_n13}/"
            f"{mcfg.block_n2}k{mcfg.block_k13}/{mcfg.block_k2}s{mcfg.split_k}"
            f"w{mcfg.num_warps}p{mcfg.num_stages}{'a' if mcfg.atomic_out else ''}"
            f"{'c' if mcfg.acc_scale else ''}{'j' if mcfg.join else ''}")
    return name, tile, mcfg


def _row(cfg, backend, stage, routing, t, case, roof, st, copy_gbps, gemm_tf, err, kernel, tile, dtype) -> dict:
    from ddbench.kernels.moe import expected_experts_touched

    us = st.median_us
    gbps = roof["bytes"] / (us * 1e-6) / 1e9
    tf = roof["flops"] / (us * 1e-6) / 1e12
    return {
        "backend": backend, "kernel": kernel, "tile": tile, "stage": stage, "tp": cfg.tp, "preset": cfg.name, "tokens": t, "routing": routing,
        "experts_touched": round(case.touched, 2),
        "expected_experts_touched": round(expected_experts_touched(t, cfg.n_experts, cfg.top_k), 2),
        "bytes_moved": int(roof["bytes"]), "flops": int(roof["flops"]),
        "time_us": round(us, 3), "time_us_p20": round(st.p20_us, 3), "time_us_p80": round(st.p80_us, 3),
        "achieved_gbps": round(gbps, 2), "pct_of_copy_bw": round(100 * gbps / copy_gbps, 2),
        "tflops": round(tf, 4), "pct_of_gemm_peak": round(100 * tf / gemm_tf, 3),
        "us_per_token": round(us / t, 4), "cuda_graph": st.cuda_graph,
        "floor_bytes_us": round(roof["bytes"] / (copy_gbps * 1e9) * 1e6, 3),
        "floor_compute_us": round(roof["flops"] / (gemm_tf * 1e12) * 1e6, 3),
        "copy_gbps": round(copy_gbps, 1), "gemm_tflops": round(gemm_tf, 2),
        "rel_err": "" if err is None else f"{err:.3e}", "dtype": dtype, "reps": st.n,
    }


def _table(console, rows, copy_gbps, gemm_tf) -> None:
    from ddbench.table import print_table

    print_table([{"backend": r["backend"], "kernel": r["kernel"], "routing": r["routing"], "T": r["tokens"],
                  "graph": r["cuda_graph"],
                  "experts": r["experts_touched"], "time_us": r["time_us"], "GB/s": r["achieved_gbps"],
                  "%copy": r["pct_of_copy_bw"], "TFLOP/s": r["tflops"], "%gemm": r["pct_of_gemm_peak"],
                  "rel_err": r["rel_err"]} for r in rows if r["stage"] == "layer"],
                key=("kernel", "routing", "T", "time_us", "%copy"), console=console,
                title=f"moe-sweep, whole layer (copy {copy_gbps:.0f} GB/s, GEMM {gemm_tf:.3g} TFLOP/s)")


# ---------------------------------------------------------------- plots for `ddbench report`
