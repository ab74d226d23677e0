"""y = x W^T (+ add) for a few rows of x: the decode-time dense GEMMs, on the CUDA cores.

At concurrency 1 every dense layer is a matrix-vector product: the job is streaming W once
at the copy bandwidth. cuBLAS picks split-K tensor-core kernels plus a reduce kernel for
these shapes (docs/BENCHMARKS.md, decode section); here each program owns BN rows of W, streams them in
[BN, BK] tiles (16-byte loads, pipelined), multiplies by the x rows on the CUDA cores in
fp32 and reduces over BK once, after the loop. Other shapes go to `F.linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.moe_triton import sm_count

MAX_ROWS = 4


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, add_ptr, y_ptr,          # per batch b: x [M, K]; W [N, K] (any strides); add, y [M, N]
    M, N, K, stride_xb, stride_xm, stride_wb, stride_wn, stride_wk, stride_ab, stride_am, stride_yb, stride_ym,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_ADD: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Program (column block, batch): y[b, :, n] = x[b] W[b, n]^T (+ add) for BN columns."""
    b = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    kk = tl.arange(0, BK)
    n_ok, m_ok = n < N, m < M
    w_rows = w_ptr + b * stride_wb + n.to(tl.int64)[:, None] * stride_wn                 # [BN, 1]
    x_rows = x_ptr + b * stride_xb + m[:, None] * stride_xm                             # [BM, 1]
    acc3 = tl.zeros([BM, BN, BK], tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=NUM_STAGES):
        k = k0 + kk
        w = tl.load(w_rows + k[None, :] * stride_wk, mask=n_ok[:, None] & (k < K)[None, :], other=0.0)  # [BN, BK]
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)             # [BM, BK]
        acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]                 # [BM, BN, BK]
    acc = tl.sum(acc3, 2)                                                                 # [BM, BN]
    mn = m_ok[:, None] & n_ok[None, :]
    if HAS_ADD:
        acc += tl.load(add_ptr + b * stride_ab + m[:, None] * stride_am + n[None, :], mask=mn).to(tl.float32)
    tl.store(y_ptr + b * stride_yb + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mn)


def tiles(m: int, n: int, k: int, n_sms: int = 132) -> tuple[int, int, int]:
    """(BM, BN, BK): BM covers the rows; BN the largest of 16/8/4/2/1 that still gives
    about 2 programs per SM; BK so that the [BM, BN, BK] product stays at 8192 values."""
    bm = triton.next_power_of_2(m)
    bn = 16
    while bn > 1 and triton.cdiv(n, bn) < 2 * n_sms:
        bn //= 2
    bk = min(triton.next_power_of_2(k), max(64, 8192 // (bm * bn)), 1024)
    return bm, bn, bk


def linear(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """x `[.., K]` @ w `[N, K]`^T (+ add `[.., N]`) -> `[.., N]` in x's dtype.

    The Triton kernel where it beat cuBLAS on the H200 (scripts/gpu/skinny_bench.py,
    docs/BENCHMARKS.md): at most MAX_ROWS rows and N <= K (long rows of W); cuBLAS else."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if not (x.is_cuda and 0 < rows <= MAX_ROWS and w.shape[0] <= w.shape[1]
            and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype):
        if add is None:
            return F.linear(x, w)
        return torch.addmm(add.reshape(-1, add.shape[-1]), x.reshape(-1, x.shape[-1]), w.t()).view(add.shape)
    return skinny_linear(x, w, add)


def heads_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head products: x `[B, T, H, K]`, w `[H, N, K]` (any strides) -> `[B, T, H, N]`
    (einsum 'bthk,hnk->bthn'); the Triton path for few rows of B*T, as in `linear`."""
    b, t, h, k = x.shape
    n = w.shape[1]
    if not (x.is_cuda and b * t <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype):
        return torch.einsum("bthk,hnk->bthn", x, w)
    out = torch.empty(b * t, h, n, dtype=x.dtype, device=x.device)
    skinny_bmm(x.flatten(0, 1).transpose(0, 1), w, out.transpose(0, 1))
    return out.view(b, t, h, n)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None = None,
                  tile: tuple[int, int, int] | None = None, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """The Triton path of `linear`, any device Triton runs on (tests use the interpreter)."""
    k, n = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, k)
    y = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    skinny_bmm(x2[None], w[None], y[None], None if add is None else add.reshape(1, -1, n), tile, num_warps, num_stages)
    return y.view(*x.shape[:-1], n)


def skinny_bmm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, add: torch.Tensor | None = None,
               tile: tuple[int, int, int] | None = None, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """out[b] = x[b] @ w[b]^T (+ add[b]): x `[B, M, K]`, w `[B, N, K]`, out `[B, M, N]`, any
    strides except unit strides on the last dims of x, out and add (w may be a transposed view)."""
    bsz, m, k = x.shape
    n = w.shape[1]
    for name, t in (("x", x), ("out", out)) + ((("add", add),) if add is not None else ()):
        if t.stride(-1) != 1:
            raise ValueError(f"skinny_bmm needs {name} with a contiguous last dim")
    a = add if add is not None else out
    bm, bn, bk = tile or tiles(m, n, k, sm_count(x.device) // max(1, bsz))
    _skinny_kernel[(triton.cdiv(n, bn), bsz)](
        x, w, a, out, m, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        a.stride(0), a.stride(1), out.stride(0), out.stride(1),
        BM=bm, BN=bn, BK=bk, HAS_ADD=add is not None, NUM_STAGES=num_stages, num_warps=num_warps)
    return out
