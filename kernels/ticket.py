"""Last-to-arrive tickets: a job that needs every program's output, run by the last
program of a grid (or of a group of programs) instead of a kernel launch of its own.

Each program stores its part, then calls `last_to_arrive` on its group's counter; exactly one
program, the last, gets True and then sees every other program's stores (a release/acquire
atomic at GPU scope after a block barrier; read them with `.cg` loads, past L1). That program
resets the counter, so a counter is zero again when the kernel ends, ready for the next
launch (graph replays included). Counters come from `counters(device, key, n)`: one zeroed
int32 buffer per (device, key), so kernels that could run at the same time use different keys.
A key's buffer grows only outside CUDA-graph capture, and a grown-out buffer stays allocated,
so a graph captured on it keeps valid pointers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_COUNTERS = 1 << 16   # a key's first buffer holds at least this many
_BUFFERS: dict[tuple, list[torch.Tensor]] = {}   # (device, key) -> its buffers, the newest last


def counters(device: torch.device, key: str, n: int, size: int = MAX_COUNTERS) -> torch.Tensor:
    """n zeroed int32 counters for the kernels of `key` on `device`: the key's buffer (at least
    `size` counters), grown to max(n, twice its size) outside CUDA-graph capture when n outgrows it."""
    device = torch.device(device)
    bufs = _BUFFERS.setdefault((str(device), key), [])
    if not bufs or bufs[-1].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"ticket counters {key!r}: {n} asked for during CUDA-graph capture, "
                               f"{bufs[-1].numel() if bufs else 0} held; call once outside capture first")
        grown = max(n, size, 2 * bufs[-1].numel() if bufs else 0)
        bufs.append(torch.zeros(grown, dtype=torch.int32, device=device))
    return bufs[-1][:n]


@triton.jit
def last_to_arrive(counter_ptr, total):
    """Call once per program, after its stores; True in the one program of the `total`
    sharing `counter_ptr` that arrives last."""
    tl.debug_barrier()                                # all of this program's stores are issued
    t = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = t == total - 1
    tl.store(counter_ptr, 0, mask=last)               # ready for the next launch
    return last
