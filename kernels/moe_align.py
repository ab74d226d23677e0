"""Sorting (token, slot) assignments by expert for the Triton MoE kernels (`kernels.moe_triton`
and `kernels.moe_gemv`): counts, padded expert starts, the expert of each row block, and the
Marlin scale-column permutation both kernels read. No host syncs."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, rank_ptr, n, BLOCK: tl.constexpr):
    """counts[e] = assignments of expert e; rank[i] = i's slot inside its expert."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    e = tl.load(ids_ptr + i, mask=m, other=0)
    r = tl.atomic_add(counts_ptr + e, 1, mask=m)
    tl.store(rank_ptr + i, r, mask=m)


@triton.jit
def _scatter_kernel(
    # in: routing and the counts from _count_kernel
    ids_ptr, rank_ptr, counts_ptr,
    # out: sorted assignments, expert of each row block, padded start of each expert
    sorted_ptr, block_expert_ptr, expert_start_ptr,
    # sizes
    n, n_experts, n_blocks,
    BM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    ex = tl.arange(0, BLOCK_E)
    cnt = tl.load(counts_ptr + ex, mask=ex < n_experts, other=0)
    padded = (cnt + BM - 1) // BM * BM
    end = tl.cumsum(padded, 0)                              # [E] padded end of each expert
    if pid == 0:
        tl.store(expert_start_ptr + ex, end - padded, mask=ex < n_experts)
    # assignments -> sorted position = padded start of its expert + its rank
    i = pid * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    e = tl.load(ids_ptr + i, mask=m, other=0)
    rk = tl.load(rank_ptr + i, mask=m, other=0)
    start = tl.sum(tl.where(ex[None, :] < e[:, None], padded[None, :], 0), 1)  # [BLOCK]
    tl.store(sorted_ptr + start + rk, i, mask=m)
    # row blocks -> expert whose padded range holds the block (-1 past the last one)
    b = pid * BLOCK + tl.arange(0, BLOCK)
    before = tl.sum((end[None, :] <= (b * BM)[:, None]).to(tl.int32), 1)       # [BLOCK]
    tl.store(block_expert_ptr + b, tl.where(before < n_experts, before, -1), mask=b < n_blocks)


def align_tokens(topk_ids: torch.Tensor, n_experts: int, block_m: int):
    """Sort (token, slot) assignments by expert, each expert's rows padded to `block_m`.

    topk_ids `[T, k]` -> (sorted int32 `[n_blocks*BM]` (assignment t*k + j; padding rows
    undefined), block_expert int32 `[n_blocks]` (-1 = unused block), expert_start int32
    `[E]`, counts int32 `[E]`). `n_blocks = cdiv(T*k, BM) + min(E, T*k)` bounds the padded
    total, so nothing is read back to the host.
    """
    n = topk_ids.numel()
    dev = topk_ids.device
    n_blocks = triton.cdiv(n, block_m) + min(n_experts, n)
    ids = topk_ids.reshape(-1).to(torch.int32)
    counts = torch.zeros(n_experts, dtype=torch.int32, device=dev)
    rank = torch.empty(n, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(n_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    expert_start = torch.empty(n_experts, dtype=torch.int32, device=dev)
    _count_kernel[(triton.cdiv(n, 256),)](ids, counts, rank, n, BLOCK=256)
    block = 32
    grid = (max(triton.cdiv(n, block), triton.cdiv(n_blocks, block)),)
    _scatter_kernel[grid](ids, rank, counts, sorted_ids, block_expert, expert_start,
                          n, n_experts, n_blocks, BM=block_m, BLOCK=block,
                          BLOCK_E=triton.next_power_of_2(n_experts), num_warps=8)
    return sorted_ids, block_expert, expert_start, counts



@triton.jit
def _scale_col(n, PER_CHANNEL: tl.constexpr):
    """Stored column of logical column n in Marlin's permuted scales: an 8x8 transpose per
    64 columns, or (one group spanning K) the per-channel permutation of each 32."""
    if PER_CHANNEL:
        m = n % 32
        return (n // 32) * 32 + ((m % 8) // 2) * 8 + (m // 8) * 2 + m % 2
    else:
        return (n // 64) * 64 + (n % 8) * 8 + (n % 64) // 8


@triton.jit
def _block_rows(block_expert_ptr, expert_start_ptr, counts_ptr, sorted_ptr, BM: tl.constexpr, r):
    """This program's expert (-1: nothing to do), and for row indices r (any shape, values
    0..: `tl.arange(0, BM)`, or a row per lane) its sorted assignments and their validity."""
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m)
    e_safe = tl.maximum(e, 0)
    start = tl.load(expert_start_ptr + e_safe)
    cnt = tl.where(e >= 0, tl.load(counts_ptr + e_safe), 0)
    pos = pid_m * BM + r
    valid = (pos - start < cnt) & (r < BM)
    assign = tl.load(sorted_ptr + pos, mask=valid, other=0)
    return e, assign, valid
