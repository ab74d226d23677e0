"""`ddbench decode`: greedy autoregressive decoding of the K2.6 engine, per-phase step time.

Three ways to run a TP-n model:

- `--tp 1`: the whole model in one process.
- `--tp N --simulate-rank R`: rank R's shard on one device; every all-reduce and
  all-gather is a stand-in whose time comes from the all-reduce model
  (`--allreduce-model`, see `ddbench allreduce`). The measured step is compute only; the
  modelled communication is added for the projected step and tok/s.
- `--tp N` alone: N processes (one per GPU with NCCL, or gloo processes on a CPU), the
  real thing; rank 0 reports.

For each concurrency c: random prompts of `--prompt-len`, prefill, then `--new-tokens`
greedy steps (a CUDA graph per step on GPU), with per-phase times from a second graph of
the step with timing events inside it, or one eager step where that fails (the
`phase_method` column says which; engine/decode.py explains the method). The step is the
engine's one AR decode step (`engine.decode.decode_forward`), the one the AR rows of
`ddbench e2e` run too. One CSV row per c (kind `decode`) with the step
time, per-phase times, tok/s, and the bytes floor: (weight bytes + KV bytes) a step
must read / the measured device copy bandwidth.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ddbench import UserError
from ddbench.engine.build import build_model, check_fits, kernel_record, pick_backends
from ddbench.engine.comm_model import predictor as allreduce_predictor
from ddbench.engine.decode import PHASES as PHASE_COLS
from ddbench.kernels.select import KernelChoice, resolve


def measure_rows(model, concurrency: list[int], prompt_len: int, new_tokens: int, seed: int,
                 graph: bool, copy_bw: float | None, base: dict, on_row, routing=None) -> None:
    """Run `measure_decode` at each concurrency and hand a CSV row to `on_row`. `routing`:
    the model's `engine.routing.Routing` (its measured distinct experts of the decode
    steps go into the row and the bytes floor)."""
    from ddbench.engine.decode import measure_decode, step_bytes

    for c in concurrency:
        if routing is not None:
            routing.reset()
        r = measure_decode(model, c, prompt_len, new_tokens, seed, use_graph=None if graph else False)
        experts = routing.mean_touched(1) if routing is not None else None
        ph = r["phases_us"]
        comm_us = r["comm_modelled_us"] if model.comm.simulated else ph["comm"]
        total = r["step_us"] + (r["comm_modelled_us"] if model.comm.simulated else 0.0)
        b = step_bytes(model, c, r["mean_context"])
        if experts is not None and b["experts_touched"]:      # the floor reads the experts that ran
            b["weight_bytes"] = b["dense_bytes"] + b["routed_bytes"] * experts / b["experts_touched"]
        floor = (b["weight_bytes"] + b["kv_bytes"]) / (copy_bw * 1e3) if copy_bw else None
        row = {**base, "concurrency": c, "prompt_len": prompt_len, "new_tokens": new_tokens,
               "cuda_graph": r["cuda_graph"], "phase_method": r["phase_method"],
               "step_us": round(r["step_us"], 2), "step_us_p20": round(r["step_us_p20"], 2),
               "step_us_p80": round(r["step_us_p80"], 2),
               "comm_us": round(comm_us, 2), "step_total_us": round(total, 2),
               "output_tok_per_s": round(c * 1e6 / total, 2),
               **{f"{p}_us": round(ph[p], 2) for p in PHASE_COLS if p != "comm"},
               "phases_sum_us": round(sum(ph.values()), 2),
               "prefill_s": round(r["prefill_s"], 4),
               "weight_bytes": int(b["weight_bytes"]), "kv_bytes": int(b["kv_bytes"]),
               "experts_touched": round(b["experts_touched"], 2),
               "routing": routing.label if routing is not None else "model",
               "experts_measured": round(experts, 2) if experts is not None else None, "copy_bw_gbps": copy_bw,
               "floor_us": round(floor, 2) if floor else None,
               "floor_ratio": round(r["step_us"] / floor, 3) if floor else None,
               "first_tokens": " ".join(map(str, r["tokens"][0, :8].tolist()))}
        on_row(row)


def _rank_worker(rank: int, tp: int, port: int, report, kw: dict) -> None:
    """One process of a real TP run (see `ddbench.ranks`); rank 0 reports rows."""
    from ddbench.ranks import init_rank
    from ddbench.engine.config import preset as make_preset
    from ddbench.engine.parallel import DistComm

    device = init_rank(rank, tp, port, kw["device"], 120)
    if kw["checkpoint"] is not None:
        from ddbench.engine.checkpoint import read_config
        cfg = read_config(kw["checkpoint"], tp, rank)
    else:
        cfg = make_preset(kw["preset"], tp=tp, rank=rank, **kw["overrides"])
    model, init = build_model(cfg, DistComm(), kw["checkpoint"], kw["moe"], kw["attn"], kw["seed"],
                              device, kw["init"], kw["kernels"])
    from ddbench.engine.routing import install

    routing = install(model, kw["routing"], kw["seed"])
    copy_bw = None
    if device.type == "cuda":
        from ddbench.timing import copy_bandwidth_gbps
        copy_bw = copy_bandwidth_gbps(device)
    base = {**kw["base"], "init": init}
    measure_rows(model, kw["concurrency"], kw["prompt_len"], kw["new_tokens"], kw["seed"], kw["graph"],
                 copy_bw, base, report, routing)


def run(*, preset: str | None, tp: int, simulate_rank: int | None, gpus: int | None, concurrency: list[int],
        prompt_len: int, new_tokens: int, checkpoint: Path | None, allreduce_model: str | None,
        moe_backend: str, attn_backend: str, graph: bool, init: str, seed: int, out: Path,
        override: list[str] | None, name: str | None = None, kernels: KernelChoice | None = None,
        routing: str | None = None) -> Path:
    from rich.console import Console
    from rich.progress import Progress

    from ddbench.results import ResultWriter, run_metadata
    from ddbench.engine.config import parse_overrides, preset as make_preset

    console = Console()
    from ddbench.ranks import check_layout

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if prompt_len < 1 or new_tokens < 2:
        raise UserError("--prompt-len must be >= 1 and --new-tokens >= 2")
    if any(c < 1 for c in concurrency):
        raise UserError("--concurrency values must be >= 1")
    if init not in ("auto", "exact", "shard"):
        raise UserError(f"--init {init!r}: choose auto, exact or shard")
    if checkpoint is not None and not Path(checkpoint).is_dir():
        raise UserError(f"--checkpoint {checkpoint}: no such directory")
    if checkpoint is not None and (override or preset):
        raise UserError("--preset/--override do not apply with --checkpoint (its config.json defines the model)")
    distributed = check_layout(tp, gpus, simulate_rank, cuda)
    if preset is None:
        preset = "k2.6" if cuda else "tiny"
        if not cuda and checkpoint is None:
            console.print("note: no GPU, so the tiny preset (pass --preset to choose)")
    overrides = parse_overrides(override)
    rank = simulate_rank or 0
    if checkpoint is not None:
        from ddbench.engine.checkpoint import read_config
        cfg = read_config(checkpoint, tp, rank)
    else:
        cfg = make_preset(preset, tp=tp, rank=rank, **overrides)
    moe, attn = pick_backends(device, moe_backend, attn_backend)
    kernels = kernels or KernelChoice()

    predict, model_desc = (None, None)
    if simulate_rank is not None and tp > 1:
        predict, model_desc = allreduce_predictor(allreduce_model, tp)
    mode = "distributed" if distributed else ("simulated" if tp > 1 else "single")
    base = {"preset": cfg.name, "tp": tp, "rank": rank if not distributed else "all", "mode": mode,
            "moe_backend": moe, "attn_backend": attn, "kernels": str(kernels), "device": str(device),
            "checkpoint": str(checkpoint) if checkpoint else ""}
    meta = run_metadata("decode", preset=cfg.name, seed=seed, tp=tp, simulate_rank=simulate_rank, mode=mode,
                        allreduce_model=model_desc, config=cfg.to_dict(), moe_backend=moe, attn_backend=attn,
                        kernels=resolve(kernels, device),
                        method="step_us: CUDA-graph replay per step (CUDA events); *_us phases: a second "
                               "graph of the step with timing events at phase boundaries, median of 5 replays "
                               "(phase_method graph) or one eager step with events (phase_method eager); "
                               "comm_us modelled (simulated) or measured (distributed); floor_us = (weight + "
                               "KV bytes a step reads) / measured copy bandwidth")
    total_rows = len(concurrency)
    from ddbench.engine.routing import default_routing, parse_routing

    routing = default_routing(routing, checkpoint)
    parse_routing(routing)
    meta["routing"] = routing
    # before the writer opens: a model that does not fit leaves no files behind
    model_bytes = None if distributed else check_fits(cfg, device, max(concurrency), prompt_len + new_tokens + 4)
    with ResultWriter(out, "decode", meta, name=name) as writer, Progress(console=console) as progress:
        task = progress.add_task(f"decode {cfg.name} tp={tp} {mode}", total=total_rows)
        if distributed:
            kw = dict(device=device.type, preset=preset, overrides=overrides, checkpoint=checkpoint, moe=moe,
                      attn=attn, kernels=kernels, seed=seed, init=init, concurrency=concurrency, prompt_len=prompt_len,
                      new_tokens=new_tokens, graph=graph, base=base, routing=routing)
            from ddbench.ranks import run_ranks

            def on_row(row):
                writer.write(row)
                progress.advance(task)
            run_ranks(_rank_worker, tp, kw, on_row, "decode")
        else:
            from ddbench.engine.parallel import LocalComm, SimComm

            comm = SimComm(tp, rank, predict) if tp > 1 else LocalComm()
            writer.meta["model_bytes"] = model_bytes
            t0 = time.perf_counter()
            progress.update(task, description=f"init {cfg.name} tp={tp} rank {rank}")
            try:
                model, used = build_model(cfg, comm, checkpoint, moe, attn, seed, device, init, kernels)
            except torch.cuda.OutOfMemoryError as e:
                raise UserError(f"out of GPU memory building {cfg.name} tp={tp} rank {rank}: {e}") from None
            init_s = time.perf_counter() - t0
            writer.meta.update(init=used, init_s=round(init_s, 2), kernels=kernel_record(model, concurrency))
            copy_bw = None
            if cuda:
                from ddbench.timing import copy_bandwidth_gbps
                copy_bw = copy_bandwidth_gbps(device)
                writer.meta["gpu_mem_allocated_gib"] = round(torch.cuda.memory_allocated(device) / 2**30, 2)
            progress.update(task, description=f"decode {cfg.name} tp={tp} {mode}")

            def on_row(row):
                writer.write({**row, "init": used})
                progress.advance(task)
            from ddbench.engine.routing import install

            measure_rows(model, concurrency, prompt_len, new_tokens, seed, graph, copy_bw, base, on_row,
                         install(model, routing, seed))
            if cuda:
                writer.meta["gpu_mem_peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    print_table(console, writer.rows)
    console.print(f"wrote {writer.path}")
    return writer.path


def print_table(console, rows: list[dict]) -> None:
    """The rows fitted to the terminal (key columns always; every column is in the CSV)."""
    from ddbench.table import print_table as fit

    fit([{"c": r["concurrency"], "tok/s": r["output_tok_per_s"], "step us": r["step_us"],
          "total us": r["step_total_us"], "x floor": r["floor_ratio"], "comm us": r["comm_us"],
          **{p: r[p + "_us"] for p in ("attention", "moe", "mlp", "lm_head", "other")},
          "floor us": r["floor_us"], "experts": r.get("experts_measured"), "graph": r["cuda_graph"]}
         for r in rows], key=("c", "tok/s", "step us", "total us", "x floor"), console=console,
        title="ddbench decode (step = measured; total = step + modelled comm when simulated)")
