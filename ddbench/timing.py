"""Device timing (DESIGN §6): warm up, time many repeats, report median and p20/p80.

On CUDA each repeat is bracketed by CUDA events with an L2 flush before it (outside the
timed region), or a CUDA graph of `graph_ops` calls is replayed and the time divided by
the op count. On the CPU a host clock brackets each repeat.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch


def pick_device(device: str) -> torch.device:
    """'auto' (CUDA when there is one), 'cpu' or 'cuda' -> torch.device; UserError otherwise."""
    from ddbench import UserError

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device {device!r}: choose cpu, cuda or auto")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA device is available")
    return torch.device(device)


@dataclass
class Stats:
    median_us: float
    p20_us: float
    p80_us: float
    n: int
    cuda_graph: bool = False

    def row(self, prefix: str = "time_us") -> dict:
        return {prefix: self.median_us, f"{prefix}_p20": self.p20_us, f"{prefix}_p80": self.p80_us}


def summarize(samples_us: list[float], cuda_graph: bool = False) -> Stats:
    s = sorted(samples_us)
    q = statistics.quantiles(s, n=5, method="inclusive") if len(s) > 1 else [s[0]] * 4
    return Stats(statistics.median(s), q[0], q[3], len(s), cuda_graph)


_L2_FLUSH: dict = {}


def flush_l2(device) -> None:
    """Overwrite a buffer larger than L2 (256 MiB) so the next op starts cold."""
    buf = _L2_FLUSH.get(device)
    if buf is None:
        buf = _L2_FLUSH[device] = torch.empty(64 * 2**20, dtype=torch.int32, device=device)
    buf.zero_()


def bench(fn, *, device=None, warmup: int = 3, reps: int = 20, flush: bool = True,
          graph: bool = False, graph_ops: int = 10) -> Stats:
    """Time `fn()`; returns per-call Stats in microseconds."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
        return summarize(samples)
    if graph:
        return _bench_graph(fn, device, warmup, reps, graph_ops)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush:
            flush_l2(device)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize(device)
    return summarize([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)])


def _bench_graph(fn, device, warmup, reps, graph_ops, warm_s: float = 0.2) -> Stats:
    """Replays of a graph of `graph_ops` calls, back to back (no host sync between them, as
    a serving loop runs), after `warm_s` seconds of untimed replays: a GPU that has been idle
    runs its first ~0.1 s slower (10 x 8k decode attention: 38.5 us in the first replays,
    36.3 us after), so short benchmarks otherwise time the clock ramp, not the kernel."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(graph_ops):
            fn()
    g.replay()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    g.replay()
    torch.cuda.synchronize(device)
    one = max(time.perf_counter() - t0, 1e-6)
    for _ in range(min(int(warm_s / one), 5000)):
        g.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        g.replay()
        e.record()
    torch.cuda.synchronize(device)
    return summarize([s.elapsed_time(e) * 1e3 / graph_ops for s, e in zip(starts, ends)], cuda_graph=True)


def copy_bandwidth_gbps(device, nbytes: int = 2 * 2**30) -> float:
    """Measured device-to-device copy bandwidth, bytes read + written, decimal GB/s."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    b = torch.empty_like(a)
    st = bench(lambda: b.copy_(a), device=device, warmup=3, reps=10, flush=False)
    return 2 * nbytes / (st.median_us * 1e-6) / 1e9


def gemm_tflops(device, n: int = 8192, dtype=torch.bfloat16) -> float:
    """Measured dense GEMM rate on random data (n x n x n), TFLOP/s."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    st = bench(lambda: a @ b, device=device, warmup=3, reps=10, flush=False)
    return 2 * n**3 / (st.median_us * 1e-6) / 1e12
