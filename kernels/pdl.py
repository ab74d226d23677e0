"""Programmatic dependent launch (PDL) for the decode step's chain of small kernels.

At concurrency 1 a decode step is about 900 kernels back to back, each a few microseconds,
and each pays a ramp (launch, first DRAM round trip) and a drain (the last programs finish
while most SMs idle): docs/BENCHMARKS.md, decode. With PDL (Hopper and later) kernel i+1 is
launched while kernel i still runs: its programs become resident as SMs free up, start the
work that does not depend on kernel i (an L2 prefetch of their weight slice), then wait in
`griddepcontrol.wait` until kernel i has completed and its writes are visible.

The rules every kernel launched with `launch_kw(True)` follows, so that the chain is correct
whatever overlaps:
1. each program calls `enter` (wait, then let the next kernel launch) before it reads any
   input of the previous kernel, writes anything, or exits;
2. before `enter` it reads only data its predecessor does not write (weights; routing ids
   of an earlier kernel), through L2 (`.cg`): a kernel is let in only after every program
   of its predecessor passed `enter`, i.e. after the kernel before that completed, so its
   early part overlaps its predecessor and nothing older.
A kernel without PDL in the chain (cuBLAS, torch) simply starts after its predecessor ends.

`ENABLED` (environment `DDBENCH_PDL=0` turns it off) and `PREFETCH` are read at each launch.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("DDBENCH_PDL", "1") != "0"
PREFETCH = True   # kernels prefetch their weights into L2 before the wait (where they can)


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def on(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL (CUDA, sm_90+, ENABLED)."""
    return ENABLED and t.is_cuda and _hopper(t.device.index if t.device.index is not None else
                                             torch.cuda.current_device())


def launch_kw(pdl: bool) -> dict:
    """Extra launch arguments of a Triton kernel launched as a PDL dependent."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def enter(PDL: tl.constexpr):
    """Rule 1: wait for the previous kernel (its writes visible), then let the next launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines holding `ptrs` (any shape); no result, never faults
    on a mapped address. Not in the interpreter: call it under a GPU-only constexpr."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows(rows, n_cols, stride, LINE: tl.constexpr, CHUNK: tl.constexpr):
    """L2 prefetch of columns 0 ..< n_cols of the rows at `rows` (`[R, 1]` pointers, valid
    rows only), one address per LINE columns (a 128-byte line when stride is 1), CHUNK
    lines a row per instruction batch."""
    c = tl.arange(0, CHUNK) * LINE
    for c0 in range(0, n_cols, CHUNK * LINE):
        prefetch_l2(rows + tl.minimum(c0 + c, n_cols - 1).to(tl.int64)[None, :] * stride)
