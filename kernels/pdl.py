"""Programmatic dependent launch (PDL) for the decode step's chain of small kernels.

At concurrency 1 a decode step is about 900 kernels back to back, each a few microseconds.
With PDL (Hopper and later) kernel i+1 is launched while kernel i still runs: its programs
become resident as SMs free up and wait in `griddepcontrol.wait` until kernel i has
completed and its writes are visible, so the launch overlaps kernel i's tail.

The rules every kernel launched with `args` follows, so that the chain is correct
whatever overlaps:
1. each program calls `enter` (wait; then, in mode 2, let the next kernel launch) before it
   reads any input that a kernel writes, writes anything, or exits (static weights may be
   read before it: kernels.skinny loads its first weight tile there);
2. so a kernel is let in only after every program of its predecessor passed `enter`, i.e.
   after the kernel before that completed: its launch overlaps its predecessor and nothing
   older. A kernel without PDL in the chain (cuBLAS, torch) starts after its predecessor ends.

Modes (`mode`): 0 off, 1 wait only (the next kernel launches when this one's programs end),
2 wait then trigger (the next kernel's programs may become resident while this one runs).
An L2 prefetch of each GEMM's weights before the wait was measured slower (docs/notes/decode.md).
Which mode runs is part of the kernel choice (`kernels.select`, `pdl=on|wait|off`): the
engine hands the mode to each launch; a kernel called without one runs mode 2 where PDL exists.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MODES = {"off": 0, "wait": 1, "on": 2}   # the kernel choice's names of the modes


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def hopper(t: torch.Tensor) -> bool:
    """Whether t is on a CUDA GPU of compute capability 9 or more (cached per device)."""
    return t.is_cuda and _hopper(t.device.index if t.device.index is not None else torch.cuda.current_device())


def on(t: torch.Tensor, mode: int = 2) -> int:
    """The PDL mode of kernels on t's device asked for `mode`: `mode` on CUDA sm_90+, else 0."""
    if mode not in (0, 1, 2):
        raise ValueError(f"PDL mode {mode!r}: 0 (off), 1 (wait) or 2 (wait and trigger)")
    return mode if mode and hopper(t) else 0


def args(mode: int) -> dict:
    """Launch arguments of a Triton kernel with a `PDL: tl.constexpr` (for `enter`) in PDL
    mode `mode`: the constexpr, and the launch attribute when on."""
    return {"PDL": mode, "launch_pdl": True} if mode else {"PDL": 0}


@triton.jit
def enter(PDL: tl.constexpr):
    """Rule 1: wait for the previous kernel (its writes visible); in mode 2 let the next launch."""
    if PDL > 0:
        tl.extra.cuda.gdc_wait()
    if PDL > 1:
        tl.extra.cuda.gdc_launch_dependents()
