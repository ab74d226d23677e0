"""What one dependency between two SMs costs through global memory, alone (`kernels/hop_probe.cu`):
two programs pass a token back and forth, with a bare flag, a release/acquire flag or the
dataflow kernel's counter (and then, as its x loader, a bulk copy of x into shared memory), idle
or under a DRAM stream from every other SM; or one program's token answered by the adds of
`fan` others to one counter, the all-to-all shape in which a dataflow phase completes. The
floor under any software dependency of a persistent decode kernel (`kernels/dataflow.py`), to
set against a PDL launch's ~1.1 us. `scripts/gpu/hop_probe.py` prints the table.
"""
from __future__ import annotations

import functools

import torch

MODES = {"relaxed": 0, "release-acquire": 1, "counter": 2, "counter + x": 3, "all to one": 4}   # hop_probe.cu MODE
WARM = 16                                                   # rounds not timed (hop_probe.cu)
SHARED = 160 * 1024                                         # dynamic shared memory a program: one an SM


@functools.lru_cache(maxsize=None)
def _kernel(mode: int, device: torch.device):
    from kernels.cuda import Kernel
    return Kernel("hop_probe.cu", "hop", {"MODE": mode}, device)


def hop_ns(mode: str, rounds: int = 10000, stream: torch.Tensor | None = None, x_bytes: int = 1024,
           fan: int = 131) -> tuple[float, int, bool]:
    """One hop's time in ns (mean over `rounds` round trips, two hops each, after WARM), the
    token at the end (2 x rounds when every hop happened) and whether a wait gave up. stream:
    a uint8 CUDA buffer that every other SM reads over and over meanwhile (None: idle); x_bytes:
    what "counter + x" copies a hop (a multiple of 16, at most SHARED); fan: the programs that
    answer in "all to one" (its token at the end: fan x rounds)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    if rounds <= WARM:
        raise ValueError(f"{rounds} rounds: more than the {WARM} untimed ones")
    if x_bytes % 16 or not 16 <= x_bytes <= SHARED:
        raise ValueError(f"x_bytes {x_bytes}: a multiple of 16 from 16 to {SHARED}")
    if mode == "all to one" and stream is not None:
        raise ValueError("all to one runs on every program it has: no stream beside it")
    device = torch.device("cuda", torch.cuda.current_device()) if stream is None else stream.device
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if mode == "all to one" and not 1 <= fan < sms:
        raise ValueError(f"fan {fan}: 1 to {sms - 1} (one program an SM, all resident)")
    grid = fan + 1 if mode == "all to one" else 2 if stream is None else sms   # every program resident: one an SM
    span = 0 if stream is None else stream.numel() // 16 // (grid - 2)
    flag = torch.zeros(4, dtype=torch.int32, device=device)
    out = torch.zeros(4, dtype=torch.int64, device=device)
    buf = stream if stream is not None else flag
    x = torch.randn(x_bytes // 4, device=device)
    _kernel(MODES[mode], device)(grid, 256, SHARED, [flag, rounds, buf, span, x, x_bytes, out])
    ns, token = out[:2].tolist()
    gave_up = flag[3].item()
    return ns / (2 * (rounds - WARM)), token, bool(gave_up)
