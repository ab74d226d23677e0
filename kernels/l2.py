"""L2 prefetch of the weights a later launch of the decode step reads, issued by a kernel that
leaves the DRAM idle while it runs (the attention of one token, `kernels.mla_decode`): each
program pulls its share of the bytes into L2 with bulk prefetches (`l2_prefetch` in
kernels/common.cuh), so that the later GEMV reads them from L2. Earlier tries pulled weights
into L2 from a third stream (its fork and join cost more than they saved) or before each
GEMM's own PDL wait (competing with the kernel before): docs/BENCHMARKS.md, decode session 4.
"""
from __future__ import annotations

import torch

SLOTS = 2    # regions a kernel takes (its arguments: pointer, bytes, pointer, bytes)


def regions(tensors: tuple[torch.Tensor, ...], budget: int) -> list:
    """Kernel arguments [tensor or None, bytes] * SLOTS: the first `budget` bytes of `tensors`
    in turn (each contiguous and 16-byte aligned; others are skipped), at most SLOTS of them."""
    out = []
    for t in tensors:
        if budget < 16 or len(out) == 2 * SLOTS:
            break
        if t.is_contiguous() and t.data_ptr() % 16 == 0:
            n = min(budget, t.numel() * t.element_size()) // 16 * 16
            out += [t, n]
            budget -= n
    return out + [None, 0] * (SLOTS - len(out) // 2)
