"""The benchmark's routing hook in one launch: draw each token's experts from a pool of
uniform top-k rows (or keep the router's) and count the distinct experts of the call.

`engine.routing` replaces a random-weight router's choice by independent uniform draws and
counts what each MoE layer touched. Done with torch ops that was about eleven launches a
layer (hash, gather, bincount, sums) on the decode step's critical path; here it is one
program per call, launched under PDL like the step's other kernels.

Modes (`MODE`): 0 copy (the ids given; only counted), 1 keyed (pool row = hash(key, layer,
seed) per token: the same token at the same position always runs the same experts), 2
stream (consecutive pool rows from an offset hashed from a device counter the kernel
advances, so every CUDA-graph replay draws afresh without a host sync). The count adds the
call's distinct experts to `touched[slot]` and 1 to `calls[slot]` (int64, one program: no
atomics, deterministic). `draw_count_ref` is the torch reference (and the CPU path).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddbench.kernels import pdl

COPY, KEYED, STREAM = 0, 1, 2
_MIX = 0x5851F42D4C957F2D          # 64-bit multiplicative mixer (wrapping)
_POS = 0x7FFFFFFFFFFFFFFF


def mix_ref(key: torch.Tensor, layer: int, seed: int) -> torch.Tensor:
    """int64 key -> non-negative int64 hash of (key, layer, seed) (wrapping arithmetic)."""
    x = key * 1000003 + (layer + 1) * 7919 + seed
    for _ in range(2):
        x = (x ^ (x >> 29)) * _MIX
    return (x ^ (x >> 32)) & _POS


def draw_count_ref(pool: torch.Tensor, ids: torch.Tensor, key: torch.Tensor | None, layer: int, seed: int,
                   mode: int, state: torch.Tensor, touched: torch.Tensor, calls: torch.Tensor, slot: int,
                   n_experts: int) -> torch.Tensor:
    """Reference of `draw_count`: -> the ids the experts run `[n, k]` int32 (counters and, in
    stream mode, `state` updated in place)."""
    n, p = ids.shape[0], pool.shape[0]
    if mode == KEYED:
        out = pool[mix_ref(key.reshape(-1).long(), layer, seed) % p]
    elif mode == STREAM:
        off = mix_ref(state.long(), layer, seed) % p                             # [1]
        state += 1
        out = pool[(off + torch.arange(n, device=ids.device)) % p]
    else:
        out = ids
    out = out.to(torch.int32)
    seen = torch.zeros(n_experts, dtype=torch.bool, device=ids.device)
    seen[out.reshape(-1).long()] = True
    touched[slot] += seen.sum()
    calls[slot] += 1
    return out


@triton.jit
def _mix(key, layer, seed):
    x = key * 1000003 + (layer + 1) * 7919 + seed
    x = (x ^ (x >> 29)) * 0x5851F42D4C957F2D
    x = (x ^ (x >> 29)) * 0x5851F42D4C957F2D
    return (x ^ (x >> 32)) & 0x7FFFFFFFFFFFFFFF


@triton.jit(do_not_specialize=["n", "layer", "seed", "slot"])
def _draw_count_kernel(pool_ptr, ids_ptr, key_ptr, out_ptr, state_ptr, touched_ptr, calls_ptr,
                       n, p, layer, seed, slot, n_experts,
                       K: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr, MODE: tl.constexpr,
                       PDL: tl.constexpr):
    pdl.enter(PDL)
    kk = tl.arange(0, K)
    off = tl.program_id(0).to(tl.int64) * 0
    if MODE == 2:
        state = tl.load(state_ptr)
        off = _mix(state, layer, seed) % p
        tl.store(state_ptr, state + 1)
    hist = tl.zeros((BINS,), dtype=tl.int32)
    for r0 in range(0, n, BLOCK):
        rows = r0 + tl.arange(0, BLOCK)
        ok = rows < n
        if MODE == 1:
            key = tl.load(key_ptr + rows, mask=ok, other=0)
            src = _mix(key, layer, seed) % p
            e = tl.load(pool_ptr + src[:, None] * K + kk[None, :], mask=ok[:, None], other=n_experts)
        elif MODE == 2:
            src = (off + rows.to(tl.int64)) % p
            e = tl.load(pool_ptr + src[:, None] * K + kk[None, :], mask=ok[:, None], other=n_experts)
        else:
            e = tl.load(ids_ptr + rows[:, None] * K + kk[None, :], mask=ok[:, None], other=n_experts)
        if MODE != 0:
            tl.store(out_ptr + rows[:, None] * K + kk[None, :], e, mask=ok[:, None])
        e = tl.where(ok[:, None], e, n_experts)                 # padding rows land in bin n_experts
        hist += tl.histogram(tl.reshape(e, (BLOCK * K,)), BINS)
    bins = tl.arange(0, BINS)
    distinct = tl.sum(((hist > 0) & (bins < n_experts)).to(tl.int64))
    tl.store(touched_ptr + slot, tl.load(touched_ptr + slot) + distinct)
    tl.store(calls_ptr + slot, tl.load(calls_ptr + slot) + 1)


def draw_count(pool: torch.Tensor, ids: torch.Tensor, key: torch.Tensor | None, layer: int, seed: int,
               mode: int, state: torch.Tensor, touched: torch.Tensor, calls: torch.Tensor, slot: int,
               n_experts: int, pdl_mode: int = 2) -> torch.Tensor:
    """One launch on CUDA (the reference elsewhere): pool `[P, k]` int32, ids `[n, k]` int32
    (the router's), key `[n]` int64 (KEYED), state `[1]` int64 (STREAM), touched/calls int64
    counters -> the ids the experts run `[n, k]` int32 (ids itself in COPY mode)."""
    if not ids.is_cuda:
        return draw_count_ref(pool, ids, key, layer, seed, mode, state, touched, calls, slot, n_experts)
    n, k = ids.shape
    if k & (k - 1):
        raise ValueError(f"route_draw needs a power-of-two top-k, got {k}")
    ids = ids.to(torch.int32).contiguous()
    out = ids if mode == COPY else torch.empty_like(ids)
    key = key.reshape(-1).long().contiguous() if mode == KEYED else ids
    block = max(1, min(128, triton.next_power_of_2(max(n, 1))))
    bins = triton.next_power_of_2(n_experts + 1)
    _draw_count_kernel[(1,)](pool, ids, key, out, state, touched, calls, n, pool.shape[0], layer, seed, slot,
                             n_experts, K=k, BLOCK=block, BINS=bins, MODE=mode,
                             **pdl.args(pdl.on(ids, pdl_mode)))
    return out
