"""Last-to-arrive tickets: a job that needs every program's output, run by the last
program of a grid (or of a group of programs) instead of a kernel launch of its own; and
flags: programs of one launch that wait for other programs of the same launch.

Each program stores its part, then calls `last_to_arrive` on its group's counter; exactly one
program, the last, gets True and then sees every other program's stores (a release/acquire
atomic at GPU scope after a block barrier; read them with `.cg` loads, past L1). That program
resets the counter, so a counter is zero again when the kernel ends, ready for the next
launch (graph replays included).

Flags (`signal`, `wait_for`, `release`) let one launch hold a producer phase and a consumer
phase (e.g. a GEMM and the GEMM that reads its output): producers `signal` after their
stores, consumers spin in `wait_for` until the expected number have, and the last consumer
to leave (`release`) resets the flag. No deadlock as long as every producer has a lower
program id than every consumer of a 1-D grid: the GPU makes programs resident in id order,
so a spinning consumer never holds a slot a producer is still waiting for (and the
interpreter runs programs in id order, so producers are done before any consumer starts).
Counters come from `counters(device, key, n)`: one zeroed
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


@triton.jit
def signal(flag_ptr):
    """Call once per producer program, after its stores: flag += 1 (release, GPU scope)."""
    tl.debug_barrier()
    tl.atomic_add(flag_ptr, 1, sem="release", scope="gpu")


@triton.jit
def wait_for(flag_ptr, target):
    """Spin until `target` producers have signalled the flag; their stores are then visible
    to this program's `.cg` loads."""
    n = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    while n < target:
        n = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def release(flag_ptr, counter_ptr, waiters):
    """Call once per consumer program after `wait_for(flag_ptr, ..)`: the last of `waiters`
    consumers resets the flag (and the counter, `last_to_arrive`) for the next launch."""
    tl.store(flag_ptr, 0, mask=last_to_arrive(counter_ptr, waiters))
