"""Last-to-arrive tickets: a job that needs every program's output, run by the last
program of a grid (or of a group of programs) instead of a kernel launch of its own.

Each program stores its part, then calls `last_to_arrive` on its group's counter; exactly one
program, the last, gets True and then sees every other program's stores (a release/acquire
atomic at GPU scope after a block barrier; read them with `.cg` loads, past L1). That program
resets the counter, so a counter is zero again when the kernel ends, ready for the next
launch (graph replays included). Counters come from `counters(device, key, n)`: one zeroed
int32 buffer per (device, key), so kernels that could run at the same time use different keys.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_COUNTERS = 1 << 16   # per key; fixed, so a captured CUDA graph's pointer stays valid
_BUFFERS: dict[tuple, torch.Tensor] = {}


def counters(device: torch.device, key: str, n: int) -> torch.Tensor:
    """n zeroed int32 counters for the kernels of `key` on `device` (one buffer, kept)."""
    if n > MAX_COUNTERS:
        raise ValueError(f"{n} ticket counters asked for {key!r}, at most {MAX_COUNTERS}")
    buf = _BUFFERS.get((str(device), key))
    if buf is None:
        buf = _BUFFERS[(str(device), key)] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return buf[:n]


@triton.jit
def last_to_arrive(counter_ptr, total):
    """Call once per program, after its stores; True in the one program of the `total`
    sharing `counter_ptr` that arrives last."""
    tl.debug_barrier()                                # all of this program's stores are issued
    t = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = t == total - 1
    tl.store(counter_ptr, 0, mask=last)               # ready for the next launch
    return last
