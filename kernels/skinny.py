"""y = x W^T (+ add) for a few rows of x: the decode-time dense GEMMs, on the CUDA cores.

At concurrency 1 every dense layer is a matrix-vector product: the job is streaming W once
at the copy bandwidth. cuBLAS picks split-K tensor-core kernels plus a reduce kernel for
these shapes (experiments/README.md, skinny_bench); here each program owns BN rows of W, streams them in
[BN, BK] tiles (16-byte loads, pipelined), multiplies by the x rows on the CUDA cores in
fp32 and reduces over BK once, after the loop. Other shapes go to `F.linear`.

Fused into the same kernel for the decode step (each saves a launch of a few microseconds):
an RMSNorm (+ residual add) prologue (`norm_linear`: the row's 1/rms is a per-row factor,
summed over the same x tiles and applied after the loop; the programs also write the new
residual, the normed row and its fp16 copy for `moe_gemv`, each a slice of the row), and
epilogues: SiLU(gate) * up for [gate | up] weights (`glu`), interleaved rope on each head's
rope columns (`rope`, MLA's q), and an add of the sum of several rows per output row
(`add_rows`, the routed experts' k rows of a token added in the shared expert's down GEMM).
A side job rides along, replacing a launch of its own: the router (`norm_linear(route=)`):
the gate GEMM's last program to finish (`kernels.ticket`) reads back every logit and
computes each row's top-k as `fused_ops.route` (same code, `fused_ops.route_row`).

Which of these run is the caller's choice, passed to each call (the engine takes it from
`kernels.select.KernelChoice`): `max_rows` (the most rows `fits` sends here), `cuda_gemv`
(one bf16 row under PDL runs `kernels.gemv` instead), `pdl_mode` (`kernels.pdl`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ddbench.kernels import gemv, pdl, ticket
from ddbench.kernels.device import sm_count
from ddbench.kernels.fused_ops import route_row

MAX_ROWS = 4       # default `max_rows` of `fits` (kernels.select's `skinny`)
MAX_N_OVER_K = 1   # `fits`: W with at most this many rows per column
# launch shape (`tiles`, `skinny_bmm`): programs per SM the column tiles
# aim for, values of a [BM, BN, BK] product, warps, pipeline stages. Chosen in the c=1 decode
# step on the H200 (experiments/scripts/decode_variants.py TRIALS, experiments/results/decode_trials_*):
# 4096 values 93 us faster than 8192 (2048: +1.3 ms); 1 or 4 programs/SM, 3 or 6 stages, 8 warps slower
PROGRAMS_PER_SM = 2
TILE_VALUES = 4096
NUM_WARPS = 4
NUM_STAGES = 4
PRELOAD = True     # each program loads its first weight tile before the PDL wait


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, add_ptr, y_ptr,          # per batch b: x [M, K]; W [N, K] (GLU: [2N, K]; any strides); add, y [M, N]
    M, N, K, stride_xb, stride_xm, stride_wb, stride_wn, stride_wk, stride_ab, stride_am, stride_yb, stride_ym,
    # RMSNorm prologue (one batch): x := h / rms(h) * nw with h = res + x (or x); outputs of the
    # whole rows, split over the programs: h [M, K], xn = the normed x [M, K], xh = xn in fp16, the MoE GEMV's input [M, K]
    res_ptr, nw_ptr, h_ptr, xn_ptr, xh_ptr, stride_rm, stride_hm, stride_xnm, stride_xhm, eps,
    # rope epilogue (one batch): interleaved rope of columns ROPE_OFF.. of each HEAD-wide head, cos/sin [M, R/2]
    cos_ptr, sin_ptr, stride_cs,
    # route epilogue (one batch): y = gate logits [M, N]; bias [N] -> ids int32 [M, TOP_K], weights fp32 [M, TOP_K]
    bias_ptr, ids_ptr, rw_ptr, cnt_ptr, scaling,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr,
    HAS_ADD: tl.constexpr, ADD_ROWS: tl.constexpr,   # add holds ADD_ROWS rows per output row, summed
    NORM: tl.constexpr, HAS_RES: tl.constexpr, OUT_H: tl.constexpr, OUT_XN: tl.constexpr, OUT_XH: tl.constexpr,
    WB: tl.constexpr,                     # K columns of the norm outputs per program
    GLU: tl.constexpr,                    # y = SiLU(x W[n]^T) * x W[N + n]^T (W = [gate | up] rows)
    ROPE: tl.constexpr, HEAD: tl.constexpr, ROPE_OFF: tl.constexpr,
    ROUTE: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TK: tl.constexpr,
    PDL: tl.constexpr,                    # launched as a dependent of the previous kernel (kernels.pdl)
    PRELOAD: tl.constexpr,                # the first weight tile is loaded before the PDL wait
):
    """Program (column block, batch): y[b, :, n] = x[b] W[b, n]^T (+ add) for BN columns, then
    the epilogues in the order GLU, ROPE, add; then the side job ROUTE in the last program to
    finish.

    With NORM the row's 1/rms is a per-row factor, so it is summed alongside the product
    (sum of h^2 over the same x tiles) and applied after the loop: no extra pass over x."""
    b = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    kk = tl.arange(0, BK)
    n_ok, m_ok = n < N, m < M
    w_rows = w_ptr + b * stride_wb + n.to(tl.int64)[:, None] * stride_wn                 # [BN, 1]
    x_rows = x_ptr + b * stride_xb + m[:, None] * stride_xm                             # [BM, 1]
    if PRELOAD:  # the first K tile's weights (static: no earlier kernel writes them) before
        # the PDL wait, so that their DRAM round trip overlaps the previous kernel's tail
        w0, u0 = _w_tile(w_rows, kk, n_ok, K, stride_wk, N * stride_wn, GLU)
        pdl.enter(PDL)
    else:
        pdl.enter(PDL)
        w0, u0 = _w_tile(w_rows, kk, n_ok, K, stride_wk, N * stride_wn, GLU)
    # per-K products, summed over K after the loop (`_k_sum`): [BN, BK] for one x row, else [BM, BN, BK]
    prod = tl.zeros([BN, BK] if BM == 1 else [BM, BN, BK], tl.float32)
    prod_up = tl.zeros([BN if GLU else 1, BK] if BM == 1 else [BM, BN if GLU else 1, BK], tl.float32)
    ss = tl.zeros([BM, BK if NORM else 1], tl.float32)                                 # sums of h^2
    prod, prod_up, ss = _x_tile(prod, prod_up, ss, w0, u0, x_rows, kk, m, m_ok, K, x_ptr, res_ptr, stride_rm, nw_ptr,
                                BM, NORM, HAS_RES, GLU)
    for k0 in tl.range(BK, K, BK, num_stages=NUM_STAGES):
        w, u = _w_tile(w_rows, k0 + kk, n_ok, K, stride_wk, N * stride_wn, GLU)
        prod, prod_up, ss = _x_tile(prod, prod_up, ss, w, u, x_rows, k0 + kk, m, m_ok, K, x_ptr, res_ptr, stride_rm,
                                    nw_ptr, BM, NORM, HAS_RES, GLU)
    acc = _k_sum(prod, BM, BN)                                                            # [BM, BN]
    rstd = tl.full([BM], 1.0, tl.float32)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(ss, 1) / K + eps)                                    # [BM]
        acc = acc * rstd[:, None]
    if GLU:
        up = _k_sum(prod_up, BM, BN) * rstd[:, None]
        acc = acc / (1.0 + tl.exp(-acc)) * up
    if ROPE:
        acc = _rope_cols(acc, n, m, m_ok, cos_ptr, sin_ptr, stride_cs, HEAD, ROPE_OFF, BM, BN)
    mn = m_ok[:, None] & n_ok[None, :]
    if HAS_ADD:
        for j in tl.static_range(ADD_ROWS):
            acc += tl.load(add_ptr + b * stride_ab + (m * ADD_ROWS + j)[:, None] * stride_am + n[None, :],
                           mask=mn).to(tl.float32)
    tl.store(y_ptr + b * stride_yb + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mn)
    if NORM and (OUT_H or OUT_XN or OUT_XH):  # this program's WB columns of the norm outputs
        kw = tl.program_id(0) * WB + tl.arange(0, WB)
        mk = m_ok[:, None] & (kw < K)[None, :]                                            # [BM, WB]
        h = tl.load(x_ptr + m[:, None] * stride_xm + kw[None, :], mask=mk, other=0.0)
        if HAS_RES:
            h = (h.to(tl.float32) + tl.load(res_ptr + m[:, None] * stride_rm + kw[None, :], mask=mk,
                                            other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        if OUT_H:
            tl.store(h_ptr + m[:, None] * stride_hm + kw[None, :], h, mask=mk)
        xn = (h.to(tl.float32) * rstd[:, None] * tl.load(nw_ptr + kw, mask=kw < K, other=0.0).to(tl.float32)[None, :]
              ).to(x_ptr.dtype.element_ty)
        if OUT_XN:
            tl.store(xn_ptr + m[:, None] * stride_xnm + kw[None, :], xn, mask=mk)
        if OUT_XH:
            tl.store(xh_ptr + m[:, None] * stride_xhm + kw[None, :], xn.to(tl.float16), mask=mk)
    if ROUTE:  # the last program to store its logits sees them all: each row's top-k
        if ticket.last_to_arrive(cnt_ptr, tl.num_programs(0)):
            for row in range(0, M):
                route_row(y_ptr + row * stride_ym, bias_ptr, ids_ptr + row * TOP_K, rw_ptr + row * TOP_K, N,
                          scaling, TOP_K, BLOCK_E, BLOCK_TK)


@triton.jit
def _w_tile(w_rows, k, n_ok, K, stride_wk, up_off, GLU: tl.constexpr):
    """The weights of K columns k: W rows [BN, BK] (and with GLU the up rows, up_off further)."""
    w_mask = n_ok[:, None] & (k < K)[None, :]
    w = tl.load(w_rows + k[None, :] * stride_wk, mask=w_mask, other=0.0)                # [BN, BK]
    u = w
    if GLU:
        u = tl.load(w_rows + up_off + k[None, :] * stride_wk, mask=w_mask, other=0.0)   # [BN, BK]
    return w, u


@triton.jit
def _x_tile(prod, prod_up, ss, w, u, x_rows, k, m, m_ok, K, x_ptr, res_ptr, stride_rm, nw_ptr,
            BM: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, GLU: tl.constexpr):
    """prod (prod_up) += x[:, k] times the tile's W (up) rows; with NORM x is the normed h
    (without its 1/rms, which is applied after the loop) and ss gets the sums of h^2."""
    x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)  # [BM, BK]
    if NORM:
        if HAS_RES:  # h in x's dtype, as the residual stream stores it
            r = tl.load(res_ptr + m[:, None] * stride_rm + k[None, :], mask=m_ok[:, None] & (k < K)[None, :],
                        other=0.0).to(tl.float32)
            x = (x + r).to(x_ptr.dtype.element_ty).to(tl.float32)
        ss += x * x
        x = x * tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
    if BM == 1:  # [BN, BK] products: each thread's W values are contiguous in K (vector loads)
        xv = tl.reshape(x, [x.shape[1]])[None, :]                                           # [1, BK]
        prod += xv * w.to(tl.float32)                                                       # [BN, BK]
        if GLU:
            prod_up += xv * u.to(tl.float32)
    else:
        prod += x[:, None, :] * w.to(tl.float32)[None, :, :]                               # [BM, BN, BK]
        if GLU:
            prod_up += x[:, None, :] * u.to(tl.float32)[None, :, :]
    return prod, prod_up, ss


@triton.jit
def _k_sum(prod, BM: tl.constexpr, BN: tl.constexpr):
    """`_x_tile`'s products summed over K -> [BM, BN]."""
    if BM == 1:
        acc = tl.reshape(tl.sum(prod, 1), [1, BN])
    else:
        acc = tl.sum(prod, 2)
    return acc


@triton.jit
def _rope_cols(acc, n, m, m_ok, cos_ptr, sin_ptr, stride_cs, HEAD: tl.constexpr, OFF: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr):
    """Interleaved rope of the columns n (BN even, pairs (2i, 2i+1) side by side) whose place
    in their HEAD-wide head is >= OFF: y[2i] = x[2i] c - x[2i+1] s, y[2i+1] = x[2i] s + x[2i+1] c."""
    d = n % HEAD - OFF                                                   # [BN] rope dim (< 0: not roped)
    i = tl.maximum(d, 0) // 2
    cs_mask = m_ok[:, None] & (d >= 0)[None, :]
    c = tl.load(cos_ptr + m[:, None] * stride_cs + i[None, :], mask=cs_mask, other=1.0)    # [BM, BN]
    s = tl.load(sin_ptr + m[:, None] * stride_cs + i[None, :], mask=cs_mask, other=0.0)
    even, odd = tl.split(tl.reshape(acc, [BM, BN // 2, 2]))                                # [BM, BN/2] each
    partner = tl.reshape(tl.join(odd, even), [BM, BN])                                     # x[n ^ 1]
    sign = tl.where(n % 2 == 0, -1.0, 1.0)[None, :]
    return acc * c + sign * partner * s


def tiles(m: int, n: int, k: int, n_sms: int = 132, glu: bool = False) -> tuple[int, int, int]:
    """(BM, BN, BK): BM covers the rows; BN the largest of 16/8/4/2/1 that still gives
    about PROGRAMS_PER_SM programs per SM; BK so that the [BM, BN, BK] product (two with
    glu) stays at TILE_VALUES values."""
    bm = triton.next_power_of_2(m)
    bn = 16
    while bn > 1 and triton.cdiv(n, bn) < PROGRAMS_PER_SM * n_sms:
        bn //= 2
    bk = min(triton.next_power_of_2(k), max(64, TILE_VALUES // (bm * bn * (2 if glu else 1))), 1024)
    return bm, bn, bk


def fits(x: torch.Tensor, w: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """Whether `linear(x, w)` takes the Triton path: where it beat cuBLAS on the H200
    (experiments/README.md, skinny_bench), i.e. CUDA, 1..max_rows rows (max_rows = 0 turns it off),
    N <= MAX_N_OVER_K * K (long rows of W; with PDL the N > K ones were also
    slower in the decode step: docs/notes/decode.md), bf16/fp16. The engine fuses its norms and epilogues into
    a GEMM only where this holds for that GEMM (or, for the shared expert's down GEMM, where
    it held for the router)."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    return (x.is_cuda and 0 < rows <= max_rows and w.shape[0] <= MAX_N_OVER_K * w.shape[1]
            and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype)


def _on_gemv(cuda_gemv: bool, x: torch.Tensor, w: torch.Tensor, pdl_mode: int | None) -> bool:
    """Whether a call asking for kernels.gemv runs it: one bf16 row on a GPU with PDL on."""
    return cuda_gemv and _pdl(x, pdl_mode) > 0 and gemv.fits(x, w)


def _pdl(x: torch.Tensor, pdl_mode: int | None) -> int:
    """The PDL mode of a launch on x asked for `pdl_mode` (None: `kernels.pdl`'s default)."""
    return pdl.on(x) if pdl_mode is None else pdl.on(x, pdl_mode)


def linear(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None = None,
           reuse_add: bool = False, *, max_rows: int = MAX_ROWS, cuda_gemv: bool = False,
           pdl_mode: int | None = None) -> torch.Tensor:
    """x `[.., K]` @ w `[N, K]`^T (+ add `[.., N]`) -> `[.., N]` in x's dtype: the Triton
    kernel where `fits(x, w, max_rows)`, cuBLAS else. reuse_add: a contiguous `add` may be
    overwritten with the result (cuBLAS then accumulates into it in place instead of first
    copying it). cuda_gemv: one bf16 row under PDL goes to kernels.gemv (weights loaded
    before the wait). pdl_mode: `kernels.pdl` mode of the launches (None: its default)."""
    if add is None and _on_gemv(cuda_gemv, x, w, pdl_mode):
        return gemv.gemv(w, x.contiguous(), pdl=True).view(*x.shape[:-1], w.shape[0])
    if not fits(x, w, max_rows):
        if add is None:
            return F.linear(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        if reuse_add and add.is_contiguous():
            add.view(-1, add.shape[-1]).addmm_(x2, w.t())
            return add
        return torch.addmm(add.reshape(-1, add.shape[-1]), x2, w.t()).view(add.shape)
    return skinny_linear(x, w, add, cuda_gemv=cuda_gemv, pdl_mode=pdl_mode)


def heads_linear(x: torch.Tensor, w: torch.Tensor, *, max_rows: int = MAX_ROWS,
                 pdl_mode: int | None = None) -> torch.Tensor:
    """Per-head products: x `[B, T, H, K]`, w `[H, N, K]` (any strides) -> `[B, T, H, N]`
    (einsum 'bthk,hnk->bthn'); the Triton path for few rows of B*T, as in `linear`."""
    b, t, h, k = x.shape
    n = w.shape[1]
    if not (x.is_cuda and b * t <= max_rows and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype):
        return torch.einsum("bthk,hnk->bthn", x, w)
    out = torch.empty(b * t, h, n, dtype=x.dtype, device=x.device)
    skinny_bmm(x.flatten(0, 1).transpose(0, 1), w, out.transpose(0, 1), pdl_mode=pdl_mode)
    return out.view(b, t, h, n)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None = None,
                  tile: tuple[int, int, int] | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, glu: bool = False, rope: tuple | None = None,
                  add_rows: int = 1, *, cuda_gemv: bool = False, pdl_mode: int | None = None) -> torch.Tensor:
    """The Triton path of `linear`, any device Triton runs on (tests use the interpreter).
    glu: w `[2I, K]` holds gate rows then up rows; returns SiLU(x gate^T) * (x up^T) `[.., I]`.
    rope: (cos, sin, head, offset): the output is heads of `head` columns and columns
    offset.. of each get interleaved rope (`fused_ops.rope_ref_`); cos/sin `[.., R/2]` per row.
    add_rows: add has that many rows per row of x (any dtype), their sum is added (e.g. the
    k weighted expert rows of a token, fp32, summed into the shared expert's down GEMM).
    cuda_gemv, pdl_mode: as `linear` (kernels.gemv takes no GLU)."""
    k, n = x.shape[-1], w.shape[0] // (2 if glu else 1)
    if (not glu and _on_gemv(cuda_gemv, x, w, pdl_mode) and (add is None or add.dtype == torch.float32)
            and (rope is None or rope[0].dtype == torch.float32)):
        rope = rope and (rope[0].reshape(-1), rope[1].reshape(-1), *rope[2:])
        return gemv.gemv(w, x.contiguous(), pdl=True, add=add, rope=rope).view(*x.shape[:-1], n)
    x2 = x.reshape(-1, k)
    y = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    skinny_bmm(x2[None], w[None], y[None], None if add is None else add.reshape(1, -1, n), tile, num_warps,
               num_stages, glu=glu, rope=rope, add_rows=add_rows, pdl_mode=pdl_mode)
    return y.view(*x.shape[:-1], n)


def norm_linear(x: torch.Tensor, norm_w: torch.Tensor, eps: float, w: torch.Tensor,
                residual: torch.Tensor | None = None, glu: bool = False, out_xn: bool = False,
                out_xh: bool = False, route: tuple | None = None, tile: tuple[int, int, int] | None = None,
                num_warps: int | None = None, num_stages: int | None = None, *, cuda_gemv: bool = False,
                pdl_mode: int | None = None):
    """RMSNorm (+ residual add) as the prologue of the skinny GEMM, one launch, Triton path.

    h = residual + x (in x's dtype; h = x without residual), xn = h / rms(h) * norm_w (fp32
    maths), y = xn W^T, or with glu (w = [gate | up] rows `[2I, K]`) SiLU(xn gate^T) * xn up^T.
    Returns (y `[.., N]`, h or None (no residual), xn or None, xh or None): xn `[.., K]` in
    x's dtype when out_xn, xh = `moe_gemv.half_rows(xn)` (fp16 `[rows, K]`) when out_xh.
    Same meaning as `norm_linear_ref`; y is computed from the unrounded fp32 xn. x's rows may
    be strided (a column slice of a wider tensor).
    route: (bias, top_k, scaling): y are the router's gate logits; the same launch also
    routes each row as `fused_ops.route(y, bias, top_k, scaling)` and the return value gets
    (ids int32 `[rows, k]`, weights fp32 `[rows, k]`) appended.
    """
    k = x.shape[-1]
    n = w.shape[0] // (2 if glu else 1)
    if out_xh and k % 32:
        raise ValueError(f"norm_linear: the MoE GEMV's fp16 copy needs K % 32 == 0, got K = {k}")
    x2, r2 = (None if t is None else _unit_last(t.reshape(-1, k)) for t in (x, residual))   # [rows, K]
    lead = x.shape[:-1]
    if not (glu or out_xn or out_xh or route) and _on_gemv(cuda_gemv, x2, w, pdl_mode):
        h = None if r2 is None else torch.empty_like(x2)
        y = gemv.gemv(w, x2, pdl=True, norm=(norm_w, eps, r2, h))
        return y.view(*lead, n), None if h is None else h.view(*lead, k), None, None
    rows = x2.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    h = torch.empty(rows, k, dtype=x.dtype, device=x.device) if r2 is not None else None
    xn = torch.empty(rows, k, dtype=x.dtype, device=x.device) if out_xn else None
    xh = torch.empty(rows, k, dtype=torch.float16, device=x.device) if out_xh else None
    topk = None
    if route is not None:
        bias, top_k, scaling = route
        topk = (torch.empty(rows, top_k, dtype=torch.int32, device=x.device),
                torch.empty(rows, top_k, dtype=torch.float32, device=x.device))
        route = (bias, *topk, scaling)
    skinny_bmm(x2[None], w[None], y[None], tile=tile, num_warps=num_warps, num_stages=num_stages, glu=glu,
               norm=(norm_w, eps, r2, h, xn, xh), route=route, pdl_mode=pdl_mode)
    out = (y.view(*lead, n), None if h is None else h.view(*lead, k), None if xn is None else xn.view(*lead, k), xh)
    return out if topk is None else out + topk


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def norm_linear_ref(x, norm_w, eps, w, residual=None, glu=False):
    """The unfused meaning of `norm_linear`: (y, h or None, xn) (xh is `half_rows(xn)`)."""
    from ddbench.kernels.fused_ops import rms_norm_ref, silu_mul_ref

    xn, h = rms_norm_ref(x, norm_w, eps, residual) if residual is not None else (rms_norm_ref(x, norm_w, eps), None)
    y = F.linear(xn, w)
    return (silu_mul_ref(y) if glu else y), h, xn


def skinny_bmm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, add: torch.Tensor | None = None,
               tile: tuple[int, int, int] | None = None, num_warps: int | None = None,
               num_stages: int | None = None, glu: bool = False, norm: tuple | None = None, rope: tuple | None = None,
               add_rows: int = 1, route: tuple | None = None, pdl_mode: int | None = None) -> torch.Tensor:
    """out[b] = x[b] @ w[b]^T (+ add[b]): x `[B, M, K]`, w `[B, N, K]`, out `[B, M, N]`, any
    strides except unit strides on the last dims of x, out and add (w may be a transposed view).
    glu: w `[B, 2N, K]`, out = SiLU(x gate^T) * x up^T. norm (B = 1): the prologue's
    (norm_w, eps, residual, h, xn, xh) as `norm_linear` (outputs may be None).
    rope (B = 1): (cos, sin, head, offset) as `skinny_linear`. add_rows: add `[B, M*add_rows, N]`,
    out[b, i] gets the sum of add rows i*add_rows ..< (i+1)*add_rows.
    route (B = 1): (bias, ids, weights, scaling): out are gate logits, ids/weights `[M, k]`
    get their routing (`fused_ops.route`), computed by the grid's last program.
    pdl_mode: the `kernels.pdl` mode of the launch (None: its default)."""
    bsz, m, k = x.shape
    n = out.shape[2]
    if w.shape[1] != (2 * n if glu else n):
        raise ValueError(f"skinny_bmm: w has {w.shape[1]} rows for {n} outputs (glu={glu})")
    for name, t in (("x", x), ("out", out)) + ((("add", add),) if add is not None else ()):
        if t.stride(-1) != 1:
            raise ValueError(f"skinny_bmm needs {name} with a contiguous last dim")
    if add is not None and tuple(add.shape[1:]) != (m * add_rows, n):
        raise ValueError(f"skinny_bmm: add {tuple(add.shape)} is not [B, {m} * {add_rows}, {n}]")
    if bsz != 1 and any(o is not None for o in (norm, rope, route)):
        raise ValueError("skinny_bmm: the norm prologue and the rope/route epilogues need one batch")
    a = add if add is not None else out
    bm, bn, bk = tile or tiles(m, n, k, sm_count(x.device) // max(1, bsz), glu)
    num_warps, num_stages = num_warps or NUM_WARPS, num_stages or NUM_STAGES
    cos = sin = None
    if rope is not None:
        cos, sin, head, rope_off = rope
        cos, sin = (t.reshape(m, -1).float().contiguous() for t in (cos, sin))          # [M, R/2]
        if head % 2 or rope_off % 2 or 2 * cos.shape[1] != head - rope_off or n % head:
            raise ValueError(f"skinny_bmm: rope needs whole heads of {head} columns, {head - rope_off} "
                             f"rope dims (cos/sin {tuple(cos.shape)}), even offsets")
        if bn < 2:             # the pairs (2i, 2i+1) in one tile
            bn, bk = 2, min(bk, max(64, 4096 // bm))
    grid = (triton.cdiv(n, bn), bsz)
    norm_w, eps, res, h, xn, xh = norm or (None, 0.0, None, None, None, None)
    if norm_w is not None and norm_w.stride(0) != 1:
        raise ValueError("skinny_bmm: the norm weight must be contiguous")
    wb = triton.next_power_of_2(triton.cdiv(k, grid[0])) if any(t is not None for t in (h, xn, xh)) else 1
    bias, ids, rw, scaling = route or (None, None, None, 1.0)
    top_k = 1 if ids is None else ids.shape[1]
    if route is not None and (tuple(ids.shape) != (m, top_k) or tuple(rw.shape) != (m, top_k)
                              or not (ids.is_contiguous() and rw.is_contiguous() and bias.is_contiguous())):
        raise ValueError(f"skinny_bmm: route outputs {tuple(ids.shape)} / {tuple(rw.shape)} are not contiguous [{m}, k]")
    xs = x[0]  # stand-in for absent tensors (never read)
    _skinny_kernel[grid](
        x, w, a, out, m, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        a.stride(0), a.stride(1), out.stride(0), out.stride(1),
        *(t if t is not None else xs for t in (res, norm_w, h, xn, xh)),
        *(t.stride(0) if t is not None else 0 for t in (res, h, xn, xh)), eps,
        cos if cos is not None else xs, sin if sin is not None else xs, 0 if cos is None else cos.stride(0),
        *(t if t is not None else xs for t in (bias, ids, rw)),
        ticket.counters(x.device, "route", 1) if route is not None else xs, float(scaling),
        BM=bm, BN=bn, BK=bk, NUM_STAGES=num_stages, HAS_ADD=add is not None, ADD_ROWS=add_rows,
        NORM=norm is not None, HAS_RES=res is not None, OUT_H=h is not None, OUT_XN=xn is not None,
        OUT_XH=xh is not None, WB=wb, GLU=glu,
        ROPE=rope is not None, HEAD=rope[2] if rope else 1, ROPE_OFF=rope[3] if rope else 0,
        ROUTE=route is not None, TOP_K=top_k, BLOCK_E=triton.next_power_of_2(n) if route else 1,
        BLOCK_TK=triton.next_power_of_2(top_k),
        PRELOAD=PRELOAD, num_warps=num_warps, **pdl.args(_pdl(x, pdl_mode)))
    return out
