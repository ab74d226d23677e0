"""Local tensor-parallel runs: one spawned process per rank (NCCL on GPU `rank`, gloo on
the CPU); rank 0 sends its result rows to the parent, any rank's failure stops all, and
the ranks die with the parent (`die_with_parent`)."""
from __future__ import annotations

import datetime
import os
import socket


def check_layout(tp: int, gpus: int | None, simulate_rank: int | None, cuda: bool) -> bool:
    """Check --tp/--gpus/--simulate-rank (UserError on bad input) -> True for a real TP run."""
    from ddbench import UserError

    if tp < 1:
        raise UserError(f"--tp {tp}: must be >= 1")
    if simulate_rank is not None and not 0 <= simulate_rank < tp:
        raise UserError(f"--simulate-rank {simulate_rank} is not a rank of --tp {tp}")
    distributed = tp > 1 and simulate_rank is None
    if distributed:
        if (gpus or tp) != tp:
            raise UserError(f"--gpus {gpus} must equal --tp {tp} (one process per rank)")
        if cuda:
            import torch

            if torch.cuda.device_count() < tp:
                raise UserError(f"--tp {tp} needs {tp} GPUs, found {torch.cuda.device_count()}")
    elif gpus not in (None, 1):
        raise UserError(f"--gpus {gpus}: a single or simulated-rank run uses one device")
    return distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, tp: int, port: int, device_kind: str, timeout_s: float):
    """Join the process group (NCCL on GPU `rank` or gloo on the CPU) -> this rank's device."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = device_kind == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=tp,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return torch.device("cuda", rank) if cuda else torch.device("cpu")


def _entry(worker, rank: int, tp: int, port: int, queue, kw: dict, parent_pid: int) -> None:
    """Run `worker(rank, tp, port, report, kw)` in a rank process, then leave the group;
    the process ends when its parent does (kill -9 included)."""
    import torch.distributed as dist

    die_with_parent(parent_pid)
    try:
        report = (lambda row: queue.put(("row", row))) if rank == 0 else (lambda row: None)
        worker(rank, tp, port, report, kw)
        dist.barrier()
        dist.destroy_process_group()
        queue.put(("done", rank))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails loudly
        queue.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))
        raise SystemExit(1)


def run_ranks(worker, tp: int, kw: dict, on_row, what: str) -> None:
    """Start `tp` processes of the module-level `worker`, hand rank 0's rows to `on_row`,
    and raise RuntimeError naming `what` if any rank fails or dies."""
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(worker, r, tp, port, q, kw, os.getpid()), daemon=True)
             for r in range(tp)]
    for p in procs:
        p.start()
    done, error, finished = set(), None, False
    try:
        while len(done) < tp and error is None:
            try:
                kind, msg = q.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    error = f"rank process exited with code {dead[0].exitcode}"
                continue
            if kind == "row":
                on_row(msg)
            elif kind == "done":
                done.add(msg)
            else:
                error = msg
        finished = error is None
    finally:  # after an error or an interrupt the ranks are stopped at once
        for p in procs:
            p.join(timeout=5 if finished else 0)
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if error:
        raise RuntimeError(f"tensor-parallel {what} failed: {error}")


def die_with_parent(parent_pid: int) -> None:
    """Make this rank process get SIGTERM when `parent_pid` (its launcher) dies, kill -9
    included: Linux's PR_SET_PDEATHSIG, else a watchdog thread polling the parent id."""
    import ctypes
    import signal
    import threading
    import time

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGTERM, 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
            raise OSError(ctypes.get_errno(), "prctl failed")
    except (OSError, AttributeError):
        def watch():
            while os.getppid() == parent_pid:
                time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=watch, daemon=True, name="ddbench-parent-watch").start()
    if os.getppid() != parent_pid:  # the parent died before the request took hold
        os.kill(os.getpid(), signal.SIGTERM)
