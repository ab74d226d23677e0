"""`ddbench allreduce`: all-reduce timing with nccl-tests' columns and formulas (DESIGN §6).

One process per rank. `ddbench allreduce --gpus N` is its own small torchrun: it picks a
free localhost port and starts N copies of `python -m ddbench.allreduce PLAN` with RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set. Started by torchrun instead,
the command finds those variables and runs as one rank itself. NCCL on GPUs (rank r on
cuda:LOCAL_RANK); gloo on CPU processes, so the whole path runs without a GPU.

Per message size and mode every rank
  1. fills the buffer with known rank-dependent small integers, all-reduces it once (in
     graph mode: replays a captured one-op graph) and counts the elements that differ
     from the exact result (`wrong`, summed over ranks);
  2. zeroes the buffer (repeated in-place sums would otherwise grow by n each op and
     overflow; the values do not change the work) and times the op: eager, one event
     pair per op; graph, a CUDA graph of `graph_ops` all-reduces replayed, time / ops.
Each rank's median and p20/p80 are averaged over ranks, as nccl-tests averages its
times. algbw = size / time (decimal GB/s), busbw = algbw * 2(n-1)/n. torch's
all_reduce works in place, so `in_place` is always true.

The latency + bandwidth model (`AllReduceModel`) predicts one all-reduce as
`lat_us + size * 2(n-1)/n / busbw` and a TP-n decode step's all-reduce cost as
2 all-reduces per layer x 61 layers of T x 7168 bf16 values. It is fitted to measured
rows, given as parameters, or taken from a preset; `load_model` builds one from a spec.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddbench import UserError
from ddbench.engine.comm_model import AllReduceModel, PRESETS, bus_factor, fit_model, load_model  # noqa: F401

# --dtype -> (torch dtype name, bytes per element)
DTYPES = {"bf16": ("bfloat16", 2), "fp16": ("float16", 2), "fp32": ("float32", 4)}
REDOPS = ("sum", "max", "min")
MODES = ("eager", "graph")
GIB, MIB = 2**30, 2**20
DEFAULT_MAX = {"nccl": GIB, "gloo": MIB}
STARTUP_S = 90  # allowance for interpreter start, torch import and CUDA init per launch
COLUMNS = ["size_bytes", "count", "dtype", "redop", "in_place", "time_us", "time_us_p20",
           "time_us_p80", "algbw_gbps", "busbw_gbps", "wrong", "n_ranks", "cuda_graph",
           "mode", "backend", "tokens"]


# ----------------------------------------------------------------------------- the plan

@dataclass
class Plan:
    """Everything a rank needs, checked once by the launcher (travels as JSON)."""
    backend: str
    n_ranks: int | None            # None under torchrun: WORLD_SIZE decides
    sizes: list                    # [(size_bytes, tokens)]; tokens 0 for sweep rows
    dtype: str = "bf16"
    op: str = "sum"
    modes: list = field(default_factory=lambda: ["eager", "graph"])
    warmup: int = 5
    reps: int = 20
    graph_ops: int = 10
    timeout: float = 60.0
    out: str = "results"
    name: str = ""
    command: str = ""
    model: bool = False
    hidden: int = 7168
    n_layers: int = 61
    notes: list = field(default_factory=list)


def parse_bytes(text: str | int, what: str) -> int:
    """'8', '64K', '256M', '1G', '1GiB' -> bytes (binary suffixes)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise UserError(f"{what}: cannot read {text!r} as a byte count (e.g. 8, 64K, 256M, 1G)")
    return int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2).upper()]


def human_bytes(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def make_plan(*, gpus: int | None, backend: str, min_bytes: str, max_bytes: str | None,
              tokens: list[int], dtype: str, op: str, mode: str, warmup: int, reps: int,
              graph_ops: int, timeout: float, out: Path, name: str | None, model: bool,
              hidden: int, n_layers: int) -> Plan:
    """Check the command's input and build the Plan; UserError on anything wrong."""
    from ddbench.results import check_name, run_location

    notes = []
    if backend not in ("auto", "nccl", "gloo"):
        raise UserError(f"--backend {backend!r}: choose nccl, gloo or auto")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose {', '.join(DTYPES)}")
    if op not in REDOPS:
        raise UserError(f"--op {op!r}: choose {', '.join(REDOPS)}")
    if mode not in ("eager", "graph", "both"):
        raise UserError(f"--mode {mode!r}: choose eager, graph or both")
    for flag, value, low in (("--warmup", warmup, 0), ("--reps", reps, 1), ("--graph-ops", graph_ops, 1)):
        if value < low:
            raise UserError(f"{flag} must be at least {low}, got {value}")
    if not timeout > 0:
        raise UserError(f"--timeout must be positive, got {timeout}")
    if gpus is not None and gpus < 1:
        raise UserError(f"--gpus must be at least 1, got {gpus}")
    if any(t < 1 for t in tokens):
        raise UserError(f"--tokens must be positive, got {tokens}")
    check_name(name)

    torchrun = under_torchrun()
    if backend == "auto":
        backend = "nccl" if visible_gpus() > 0 else "gloo"
        if backend == "gloo":
            notes.append("no CUDA GPU visible: using the gloo backend on CPU processes")
    if torchrun:
        world = int(os.environ["WORLD_SIZE"])
        if gpus is not None and gpus != world:
            raise UserError(f"--gpus {gpus} but torchrun started WORLD_SIZE={world} processes")
    else:
        world = gpus if gpus is not None else (visible_gpus() if backend == "nccl" else 2)
    if backend == "nccl":
        have = visible_gpus()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if torchrun else world
        if have == 0:
            raise UserError("backend nccl needs CUDA GPUs and none is visible (use --backend gloo)")
        if local > have:
            raise UserError(f"--gpus {local} but only {have} CUDA GPU(s) are visible (backend nccl)")

    esize = DTYPES[dtype][1]
    lo = parse_bytes(min_bytes, "--min-bytes")
    if max_bytes is None:
        hi = DEFAULT_MAX[backend]
        if backend == "gloo":
            notes.append(f"gloo on CPU: the sweep stops at {human_bytes(hi)} by default "
                         f"(nccl: {human_bytes(DEFAULT_MAX['nccl'])}); set --max-bytes to change it")
    else:
        hi = parse_bytes(max_bytes, "--max-bytes")
    for flag, v in (("--min-bytes", lo), ("--max-bytes", hi)):
        if v <= 0 or v % esize:
            raise UserError(f"{flag} {v} is not a positive multiple of the {dtype} size ({esize} bytes)")
    if lo > hi:
        raise UserError(f"--min-bytes {lo} is larger than --max-bytes {hi}")
    sweep = []
    s = lo
    while s <= hi:
        sweep.append((s, 0))
        s *= 2
    sizes = sweep + [(t * hidden * esize, t) for t in tokens]

    modes = ["eager", "graph"] if mode == "both" else [mode]
    if backend != "nccl" and "graph" in modes:
        modes.remove("graph")
        notes.append(f"graph mode skipped: CUDA graphs need CUDA tensors and the nccl backend "
                     f"(backend {backend})")
    loc = (Path(out), name) if name else run_location(out, "allreduce")
    return Plan(backend=backend, n_ranks=None if torchrun else world, sizes=sizes, dtype=dtype,
                op=op, modes=modes, warmup=warmup, reps=reps, graph_ops=graph_ops,
                timeout=float(timeout), out=str(loc[0]), name=loc[1],
                command=" ".join(["ddbench", *sys.argv[1:]]), model=model, hidden=hidden,
                n_layers=n_layers, notes=notes)


def run(**kwargs) -> Path:
    """`ddbench allreduce`: check input, then run as a torchrun rank or start N ranks."""
    from ddbench.results import check_output

    plan = make_plan(**kwargs)
    csv_path = check_output(Path(plan.out), plan.name) / f"{plan.name}.csv"
    if under_torchrun():
        worker(plan)
    else:
        argv = [sys.executable, "-m", "ddbench.allreduce", json.dumps(dataclasses.asdict(plan))]
        launch(argv, plan.n_ranks, setup_timeout=plan.timeout)
    return csv_path


# ----------------------------------------------------------------------------- launcher

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list[str], n: int, setup_timeout: float, startup_s: float = STARTUP_S) -> None:
    """Run `argv` as n ranks on this host (torchrun's environment) and wait for all.

    Each rank's stderr goes to a file. When one rank fails the others are stopped at once
    (they would block in a collective), its message becomes a UserError and a crash's log
    is echoed. Ranks that have not all reached READY_DIR within `setup_timeout +
    startup_s` seconds are stopped too, so nothing is left hanging. Stopped itself (Ctrl-C,
    SIGTERM) it sends the ranks SIGTERM, which rank 0 answers by finishing its CSV; killed
    outright, the ranks get SIGTERM from the kernel (`ranks.die_with_parent`).
    """
    root = str(Path(__file__).resolve().parents[1])
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ddbench-ar-") as tmp:
        ready = Path(tmp, "ready")
        ready.mkdir()
        base = dict(os.environ)
        base.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
        base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n),
                    LOCAL_WORLD_SIZE=str(n), PYTHONUNBUFFERED="1", DDBENCH_READY_DIR=str(ready),
                    DDBENCH_PARENT_PID=str(os.getpid()),
                    PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        procs, logs = [], []
        try:
            for r in range(n):
                log = open(Path(tmp, f"rank{r}.log"), "w+")
                logs.append(log)
                procs.append(subprocess.Popen(argv, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                                              stderr=log))
            _wait(procs, logs, ready, time.monotonic() + setup_timeout + startup_s, setup_timeout)
        except KeyboardInterrupt:
            for p in procs:  # a Ctrl-C reached them too, a SIGTERM only this process
                if p.poll() is None:
                    p.terminate()
            _stop(procs, grace=10.0)  # rank 0 finishes its CSV and sidecar
            raise
        finally:
            _stop(procs, grace=3.0)
            for log in logs:
                log.close()


def _wait(procs, logs, ready: Path, setup_deadline: float, setup_timeout: float) -> None:
    n = len(procs)
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            r, code = failed[0]
            _stop(procs, grace=3.0)
            logs[r].seek(0)
            text = logs[r].read().strip()
            last = text.splitlines()[-1] if text else ""
            if code != 2 and text:  # a crash: show its traceback
                print(text, file=sys.stderr)
            message = last.removeprefix("error: ") or "no message"
            raise UserError(f"rank {r} of {n} failed (exit code {code}): {message}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > setup_deadline and len(list(ready.iterdir())) < n:
            _stop(procs, grace=0.0)
            raise UserError(f"process-group setup did not finish: {len(list(ready.iterdir()))} of {n} "
                            f"ranks ready after {setup_timeout:g} s (+{STARTUP_S} s to start); all stopped")
        time.sleep(0.05)


def _stop(procs, grace: float) -> None:
    """Wait `grace` seconds for ranks to exit, then terminate, then kill what is left."""
    end = time.monotonic() + grace
    while time.monotonic() < end and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=3)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ----------------------------------------------------------------------------- one rank

def known_values(count: int, rank: int, dtype, device):
    """Rank r's buffer: ((i + r) % 5) - 2, small integers that every dtype sums exactly."""
    import torch

    base = torch.arange(count, dtype=torch.int32, device=device) % 5
    return ((base + rank) % 5 - 2).to(dtype)


def expected_values(count: int, n: int, op: str, dtype, device):
    """The exact all-reduce of `known_values` over ranks 0..n-1."""
    import torch

    base = torch.arange(count, dtype=torch.int32, device=device) % 5
    acc = None
    for r in range(n):
        v = (base + r) % 5 - 2
        if acc is None:
            acc = v
        elif op == "sum":
            acc = acc + v
        else:
            acc = torch.maximum(acc, v) if op == "max" else torch.minimum(acc, v)
    return acc.to(dtype)


def count_wrong(x, n: int, op: str) -> int:
    """Elements of an all-reduced buffer that differ from the exact result."""
    return int((x != expected_values(x.numel(), n, op, x.dtype, x.device)).sum())


def worker(plan: Plan) -> None:
    """One rank: join the process group (with a timeout), run the sweep, leave."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    kwargs = {}
    if plan.backend == "nccl":
        have = visible_gpus()
        if local >= have:
            raise UserError(f"LOCAL_RANK {local} but only {have} CUDA GPU(s) are visible")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # NCCL connects now, inside the timeout
    else:
        device = torch.device("cpu")
    try:
        dist.init_process_group(plan.backend, init_method="env://", rank=rank, world_size=n,
                                timeout=datetime.timedelta(seconds=plan.timeout), **kwargs)
    except Exception as e:  # noqa: BLE001 - store timeouts and NCCL errors alike
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise UserError(f"process-group setup ({plan.backend}, {n} ranks) failed within "
                        f"{plan.timeout:g} s: {type(e).__name__}: {first}") from None
    if os.environ.get("DDBENCH_READY_DIR"):
        Path(os.environ["DDBENCH_READY_DIR"], str(rank)).touch()
    try:
        _sweep(plan, rank, n, device)
    finally:
        dist.destroy_process_group()


def _sweep(plan: Plan, rank: int, n: int, device) -> None:
    import torch
    import torch.distributed as dist

    from ddbench.results import ResultWriter, run_metadata

    dtype = getattr(torch, DTYPES[plan.dtype][0])
    esize = DTYPES[plan.dtype][1]
    op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[plan.op]
    buf = torch.empty(max(s for s, _ in plan.sizes) // esize, dtype=dtype, device=device)
    steps = [(m, s, t) for m in plan.modes for s, t in plan.sizes]
    lead = rank == 0
    if lead:
        from rich.console import Console

        console = Console()
        for note in plan.notes:
            console.print(f"[yellow]note:[/] {note}")
        meta = run_metadata("allreduce", backend=plan.backend, n_ranks=n, dtype=plan.dtype,
                            redop=plan.op, modes=plan.modes, warmup=plan.warmup, reps=plan.reps,
                            graph_ops=plan.graph_ops, timeout_s=plan.timeout, hidden=plan.hidden,
                            n_layers=plan.n_layers, notes=plan.notes,
                            nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"))
        meta["command"] = plan.command
        writer = ResultWriter(Path(plan.out), "allreduce", meta=meta, name=plan.name)
    progress = _Progress(lead, len(steps))
    try:
        for mode, size, tokens in steps:
            x = buf[: size // esize]
            if mode == "graph":
                wrong, st = _measure_graph(x, op, plan, rank, n, device)
            else:
                wrong, st = _measure_eager(x, op, plan, rank, n, device)
            # average each rank's median/p20/p80 over ranks; sum the wrong counts
            agg = torch.tensor([st.median_us, st.p20_us, st.p80_us, wrong], dtype=torch.float64,
                               device=device)
            dist.all_reduce(agg)
            t_us, p20, p80 = (v / n for v in agg[:3].tolist())
            algbw = size / (t_us * 1e3)  # bytes / us / 1e3 = GB/s
            row = {"size_bytes": size, "count": size // esize, "dtype": plan.dtype, "redop": plan.op,
                   "in_place": True, "time_us": t_us, "time_us_p20": p20, "time_us_p80": p80,
                   "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(n),
                   "wrong": int(agg[3].item()), "n_ranks": n, "cuda_graph": mode == "graph",
                   "mode": mode, "backend": plan.backend, "tokens": tokens}
            if lead:
                writer.write({k: row[k] for k in COLUMNS})
                progress.advance(mode, size)
    except BaseException as e:
        if lead:
            progress.stop()
            writer.close(completed=False, error=f"{type(e).__name__}: {e}")
        raise
    if lead:
        progress.stop()
        extra = _finish(plan, writer.rows, n, console)
        writer.close(completed=True, **extra)
        console.print(f"wrote {writer.path if writer.rows else writer.sidecar}")


def _barrier(device) -> None:
    import torch.distributed as dist

    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def _measure_eager(x, op, plan: Plan, rank: int, n: int, device):
    import torch.distributed as dist

    from ddbench.timing import bench

    _barrier(device)
    x.copy_(known_values(x.numel(), rank, x.dtype, device))
    dist.all_reduce(x, op=op)
    wrong = count_wrong(x, n, plan.op)
    x.zero_()
    _barrier(device)
    st = bench(lambda: dist.all_reduce(x, op=op), device=device, warmup=plan.warmup,
               reps=plan.reps, flush=False)
    return wrong, st


def _measure_graph(x, op, plan: Plan, rank: int, n: int, device):
    """Check a captured one-op graph, then time replays of a graph of `graph_ops` ops."""
    import torch
    import torch.distributed as dist

    from ddbench.timing import summarize

    def fn():
        dist.all_reduce(x, op=op)

    def capture(ops: int):
        g = torch.cuda.CUDAGraph()
        # thread_local: NCCL's watchdog thread may query events while we capture
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            for _ in range(ops):
                fn()
        return g

    _barrier(device)
    x.zero_()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(1, plan.warmup)):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)  # no eager work still pending when the capture starts
    check, timed = capture(1), capture(plan.graph_ops)
    x.copy_(known_values(x.numel(), rank, x.dtype, device))
    check.replay()
    wrong = count_wrong(x, n, plan.op)
    x.zero_()
    timed.replay()
    torch.cuda.synchronize(device)
    _barrier(device)
    samples = []
    for _ in range(plan.reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        timed.replay()
        e.record()
        e.synchronize()
        samples.append(s.elapsed_time(e) * 1e3 / plan.graph_ops)
    del check, timed
    return wrong, summarize(samples, cuda_graph=True)


class _Progress:
    """A rich progress bar on rank 0; nothing on the other ranks."""

    def __init__(self, lead: bool, total: int):
        self.bar = None
        if lead:
            from rich.progress import Progress

            self.bar = Progress(transient=True)
            self.bar.start()
            self.task = self.bar.add_task("all-reduce", total=total)

    def advance(self, mode: str, size: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=f"all-reduce {mode} {human_bytes(size)}")

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _finish(plan: Plan, rows: list[dict], n: int, console) -> dict:
    """Rank 0's summary table, and with --model the fit and its predictions."""
    from ddbench.table import print_table

    if not rows:
        console.print("no rows measured")
        return {}
    print_table([{"size": human_bytes(r["size_bytes"]), "tokens": r["tokens"] or "", "mode": r["mode"],
                  "time_us": r["time_us"], "p20..p80": f"{r['time_us_p20']:.1f}..{r['time_us_p80']:.1f}",
                  "algbw GB/s": r["algbw_gbps"], "busbw GB/s": r["busbw_gbps"], "wrong": r["wrong"]}
                 for r in rows], key=("size", "mode", "time_us", "busbw GB/s", "wrong"),
                title=f"all-reduce, {n} rank(s), {plan.backend}, {plan.dtype}, {plan.op}", console=console,
                where=f"{plan.name}.csv")
    bad = sum(r["wrong"] for r in rows)
    if bad:
        console.print(f"[red]{bad} wrong element(s): the all-reduce results are not correct[/]")
    if not plan.model:
        return {}
    fits = {}
    for mode in plan.modes:
        pts = [(r["size_bytes"], r["time_us"]) for r in rows if r["mode"] == mode and not r["wrong"]]
        try:
            fits[mode] = fit_model(pts, n, source=f"fit: {plan.name} {mode}")
        except UserError as e:
            console.print(f"[yellow]note:[/] no {mode} model: {e}")
    models = {**{f"measured {m}": f for m, f in fits.items()},
              **{f"preset {k}": load_model(k) for k in PRESETS}}
    print_model_table(models, [1, 16, 160], plan.hidden, plan.n_layers, DTYPES[plan.dtype][1], console)
    if n == 1:
        console.print("[yellow]note:[/] 1 rank moves no bus traffic: the fit measures launch and latency only")
    return {"model": {name: {**m.to_dict(), "decode_step_us": {
        t: m.decode_step_us(t, plan.hidden, plan.n_layers, DTYPES[plan.dtype][1]) for t in (1, 16, 160)}}
        for name, m in models.items()}}


# ----------------------------------------------------------------------------- the model
# (engine.comm_model; imported here for `--model` and `--predict`)

def print_model_table(models: dict, tokens: list[int], hidden: int = 7168, n_layers: int = 61,
                      dtype_bytes: int = 2, console=None, where: str = "the sidecar") -> None:
    """Each model's parameters and per-op / per-step cost at each token count, fitted to the terminal."""
    from ddbench.table import print_table

    rows = []
    for name, m in models.items():
        row = {"model": name, "ranks": m.n_ranks, "lat_us": m.lat_us,
               "busbw GB/s": None if math.isinf(m.busbw_gbps) else m.busbw_gbps}
        for t in tokens:
            row[f"T={t} op/step us"] = (f"{m.predict_us(t * hidden * dtype_bytes):.1f} / "
                                        f"{m.decode_step_us(t, hidden, n_layers, dtype_bytes):.0f}")
        rows.append(row)
    print_table(rows, key=("model", *(f"T={t} op/step us" for t in tokens)), console=console,
                title=f"all-reduce model: per TP decode step = 2 x {n_layers} layers "
                      f"x all-reduce(T x {hidden} x {dtype_bytes} B)", where=where)


def predict(spec: str, tokens: list[int], hidden: int, n_layers: int, dtype: str) -> None:
    """`--predict SPEC`: print a model's predictions without measuring."""
    from rich.console import Console

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose {', '.join(DTYPES)}")
    m = load_model(spec)
    print_model_table({m.source: m}, tokens, hidden, n_layers, DTYPES[dtype][1], Console(),
                      where=f"the spec {spec!r}")


# ----------------------------------------------------------------------------- plots

# ----------------------------------------------------------------------------- rank entry

def _rank_main(argv: list[str]) -> int:
    """`python -m ddbench.allreduce PLAN_JSON`: one rank started by `launch` (or torchrun)."""
    from ddbench.ranks import die_with_parent
    from ddbench.results import stop_on_signals

    stop_on_signals(include_sigint=True)  # SIGTERM as Ctrl-C: rank 0 finishes its CSV
    if os.environ.get("DDBENCH_PARENT_PID"):
        die_with_parent(int(os.environ["DDBENCH_PARENT_PID"]))
    try:
        worker(Plan(**json.loads(argv[1])))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv))
