"""Small fused Triton kernels for the decode step, each beside its torch reference.

A decode step at concurrency 1 moves little data per op, so its time is mostly the
number of kernels; these kernels replace chains of 5-25 elementwise torch ops:

- `rms_norm`: y = x / rms(x) * w, optionally fused with the residual add before it.
- `mla_a_post`: everything between MLA's fused wq_a|wkv_a GEMM and wq_b: RMSNorm of the
  q latent (1536), RMSNorm of the kv latent (512) and interleaved rope of k_pe (64),
  the last two written straight into the KV cache at position prefix_len[b] + t.
- `rope_`: interleaved rope in place on a slice of every head (q's rope dims).
- `silu_mul`: SiLU(gate) * up for a fused [gate | up] projection.
- `route`: K2.6 router after the gate GEMM: sigmoid, top-k of score + bias, weights
  renormalised and scaled.

All wrappers take fp32/bf16/fp16 and compute in fp32. Every `*_ref` is the meaning.
On the skinny path (kernels.skinny) the work of `route` rides in the gate GEMM instead,
with the same code (`route_row`).
On Hopper the kernels of the decode chain (norm, mla_a_post, route) launch with PDL and
wait for their predecessor first thing (`kernels.pdl`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddbench.kernels import pdl


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


def _pdl(x: torch.Tensor, pdl_mode: int | None) -> int:
    return pdl.on(x) if pdl_mode is None else pdl.on(x, pdl_mode)


# ---- RMSNorm (+ residual add) ----------------------------------------------------------

@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, h_ptr,   # rows of x [N, D]; res/h only if HAS_RES
    stride_x, stride_res, stride_y, stride_h,
    D, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl.enter(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:  # h = res + x is the new residual stream
        x += tl.load(res_ptr + row * stride_res + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(h_ptr + row * stride_h + offs, x.to(h_ptr.dtype.element_ty), mask=m)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=m)


def rms_norm_ref(x, w, eps, residual=None):
    """-> y, or (y, h = residual + x) when `residual` is given."""
    h = x if residual is None else (residual.float() + x.float()).to(x.dtype)
    hf = h.float()
    y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)
    return y if residual is None else (y, h)


def rms_norm(x, w, eps, residual=None, pdl_mode=None):
    """Triton RMSNorm over the last dim of x `[..., D]` (rows may be strided views).
    pdl_mode (here and in the other launchers): the `kernels.pdl` mode (None: its default)."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    has_res = residual is not None
    if has_res:
        r2 = residual.reshape(-1, d).contiguous()
        h = torch.empty_like(y)
    else:
        r2 = h = y
    block = _pow2(d)
    _rms_norm_kernel[(x2.shape[0],)](x2, r2, w, y, h, x2.stride(0), r2.stride(0), y.stride(0), h.stride(0),
                                     d, eps, HAS_RES=has_res, BLOCK=block,
                                     num_warps=8 if block >= 4096 else 4, **pdl.args(_pdl(x2, pdl_mode)))
    y = y.view(x.shape)
    return (y, h.view(x.shape)) if has_res else y


# ---- MLA after wq_a|wkv_a: q norm, kv norm + rope + cache store -------------------------

@triton.jit
def _mla_a_post_kernel(
    qkv_ptr, qw_ptr, kvw_ptr, cos_ptr, sin_ptr,  # qkv [B*T, Q+L+R] rows, norm weights [Q], [L], cos/sin [B*T, R/2]
    q_ptr, ckv_ptr, kpe_ptr, plen_ptr,           # out: q [B*T, Q]; caches [B, S, L], [B, S, R]; prefix_len [B]
    stride_qkv, stride_cs, stride_q,
    stride_cb, stride_cs_pos, stride_pb, stride_ps_pos,
    T, Q, L, R, eps,
    BLOCK_Q: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    pdl.enter(PDL)
    row = tl.program_id(0)
    src = qkv_ptr + row * stride_qkv
    # q latent: RMSNorm -> q
    oq = tl.arange(0, BLOCK_Q)
    mq = oq < Q
    a = tl.load(src + oq, mask=mq, other=0.0).to(tl.float32)
    a = a / tl.sqrt(tl.sum(a * a, axis=0) / Q + eps) * tl.load(qw_ptr + oq, mask=mq, other=0.0).to(tl.float32)
    tl.store(q_ptr + row * stride_q + oq, a.to(q_ptr.dtype.element_ty), mask=mq)
    # kv latent: RMSNorm -> ckv cache at prefix_len[b] + t
    b = row // T
    pos = tl.load(plen_ptr + b).to(tl.int64) + row % T
    offs = tl.arange(0, BLOCK_L)
    m = offs < L
    c = tl.load(src + Q + offs, mask=m, other=0.0).to(tl.float32)
    c = c / tl.sqrt(tl.sum(c * c, axis=0) / L + eps) * tl.load(kvw_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(ckv_ptr + b * stride_cb + pos * stride_cs_pos + offs, c.to(ckv_ptr.dtype.element_ty), mask=m)
    # k_pe: interleaved rope -> kpe cache
    i = tl.arange(0, BLOCK_H)
    mh = i < R // 2
    x0 = tl.load(src + Q + L + 2 * i, mask=mh, other=0.0).to(tl.float32)
    x1 = tl.load(src + Q + L + 2 * i + 1, mask=mh, other=0.0).to(tl.float32)
    cs = tl.load(cos_ptr + row * stride_cs + i, mask=mh, other=0.0)
    sn = tl.load(sin_ptr + row * stride_cs + i, mask=mh, other=0.0)
    dst = kpe_ptr + b * stride_pb + pos * stride_ps_pos
    tl.store(dst + 2 * i, (x0 * cs - x1 * sn).to(kpe_ptr.dtype.element_ty), mask=mh)
    tl.store(dst + 2 * i + 1, (x0 * sn + x1 * cs).to(kpe_ptr.dtype.element_ty), mask=mh)


def _rope_ref(x, cos, sin):
    """Interleaved rope of x `[N, .., R]` with cos/sin `[N, R/2]` (fp32 math)."""
    shape = (cos.shape[0], *([1] * (x.dim() - 2)), cos.shape[-1])
    c, s = cos.view(shape), sin.view(shape)
    xf = x.float().unflatten(-1, (-1, 2))                         # [N, .., R/2, 2]
    x0, x1 = xf[..., 0], xf[..., 1]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).flatten(-2)   # [N, .., R]


def mla_a_post_ref(qkv, q_w, kv_w, cos, sin, ckv, kpe, prefix_len, eps):
    """After the fused wq_a|wkv_a GEMM: qkv `[B, T, Q+L+R]`, cos/sin `[B, T, R/2]`.

    Returns q_norm(q latent) `[B, T, Q]`; writes kv_norm(kv latent) to ckv `[B, S, L]` and
    rope(k_pe) to kpe `[B, S, R]` at positions prefix_len[b] + t.
    """
    b, t, _ = qkv.shape
    lat, r = ckv.shape[-1], kpe.shape[-1]
    q_dim = qkv.shape[-1] - lat - r
    q = rms_norm_ref(qkv[..., :q_dim], q_w, eps)
    c = rms_norm_ref(qkv[..., q_dim:q_dim + lat], kv_w, eps)
    k = _rope_ref(qkv[..., q_dim + lat:].reshape(b * t, r), cos.reshape(b * t, -1), sin.reshape(b * t, -1))
    pos = prefix_len.long().view(b, 1) + torch.arange(t, device=qkv.device)   # [B, T]
    rows = torch.arange(b, device=qkv.device).view(b, 1).expand(b, t)         # [B, T]
    ckv.index_put_((rows, pos), c.to(ckv.dtype))
    kpe.index_put_((rows, pos), k.view(b, t, r).to(kpe.dtype))
    return q


def mla_a_post(qkv, q_w, kv_w, cos, sin, ckv, kpe, prefix_len, eps, pdl_mode=None):
    """Triton version of `mla_a_post_ref` (one program per new token)."""
    b, t, width = qkv.shape
    lat, r = ckv.shape[-1], kpe.shape[-1]
    q_dim = width - lat - r
    qkv2 = qkv.reshape(b * t, width)                                          # [B*T, Q+L+R]
    cos2, sin2 = cos.reshape(b * t, -1).float().contiguous(), sin.reshape(b * t, -1).float().contiguous()
    assert qkv2.stride(-1) == 1 and ckv.stride(-1) == 1 and kpe.stride(-1) == 1
    q = torch.empty(b * t, q_dim, dtype=qkv.dtype, device=qkv.device)
    _mla_a_post_kernel[(b * t,)](qkv2, q_w, kv_w, cos2, sin2, q, ckv, kpe, prefix_len,
                                 qkv2.stride(0), cos2.stride(0), q.stride(0),
                                 ckv.stride(0), ckv.stride(1), kpe.stride(0), kpe.stride(1),
                                 t, q_dim, lat, r, eps,
                                 BLOCK_Q=_pow2(q_dim), BLOCK_L=_pow2(lat), BLOCK_H=_pow2(r // 2),
                                 num_warps=8 if q_dim >= 1024 else 4, **pdl.args(_pdl(qkv2, pdl_mode)))
    return q.view(b, t, q_dim)


# ---- rope in place on q ----------------------------------------------------------------

@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr,      # x rows [N, H, *] (strided), cos/sin [N, R/2]
    stride_n, stride_h, stride_cs,
    H, R, offset,
    BLOCK_HEADS: tl.constexpr, BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0)
    hh = tl.arange(0, BLOCK_HEADS)[:, None]
    i = tl.arange(0, BLOCK_R)[None, :]
    m = (hh < H) & (i < R // 2)
    p = x_ptr + row * stride_n + hh * stride_h + offset + 2 * i
    x0 = tl.load(p, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(p + 1, mask=m, other=0.0).to(tl.float32)
    cs = tl.load(cos_ptr + row * stride_cs + i, mask=i < R // 2, other=0.0)
    sn = tl.load(sin_ptr + row * stride_cs + i, mask=i < R // 2, other=0.0)
    tl.store(p, (x0 * cs - x1 * sn).to(x_ptr.dtype.element_ty), mask=m)
    tl.store(p + 1, (x0 * sn + x1 * cs).to(x_ptr.dtype.element_ty), mask=m)


def rope_ref_(x, cos, sin, offset):
    """In place: rotate dims offset .. offset+R of every head of x `[B, T, H, D]`."""
    b, t, h, _ = x.shape
    r = 2 * cos.shape[-1]
    part = x[..., offset:offset + r]
    part.copy_(_rope_ref(part.reshape(b * t, h, r), cos.reshape(b * t, -1), sin.reshape(b * t, -1))
               .view(b, t, h, r))
    return x


def rope_(x, cos, sin, offset):
    """Triton version of `rope_ref_` (x's last dim contiguous, heads strided)."""
    b, t, h, _ = x.shape
    r = 2 * cos.shape[-1]
    assert x.stride(-1) == 1 and x.stride(0) == t * x.stride(1)
    cos2, sin2 = cos.reshape(b * t, -1).float().contiguous(), sin.reshape(b * t, -1).float().contiguous()
    _rope_kernel[(b * t,)](x, cos2, sin2, x.stride(1), x.stride(2), cos2.stride(0), h, r, offset,
                           BLOCK_HEADS=_pow2(h), BLOCK_R=_pow2(r // 2), num_warps=4)
    return x


# ---- SiLU(gate) * up -------------------------------------------------------------------

@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, stride_x, stride_y, I, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    g = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (g / (1.0 + tl.exp(-g)) * u).to(y_ptr.dtype.element_ty), mask=m)


def silu_mul_ref(x):
    """x `[..., 2I]` = [gate | up] -> SiLU(gate) * up `[..., I]`."""
    i = x.shape[-1] // 2
    return (torch.nn.functional.silu(x[..., :i].float()) * x[..., i:].float()).to(x.dtype)


def silu_mul(x):
    i = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * i).contiguous()
    y = torch.empty(x2.shape[0], i, dtype=x.dtype, device=x.device)
    block = min(_pow2(i), 1024)
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(i, block))](x2, y, x2.stride(0), y.stride(0), i, BLOCK=block)
    return y.view(*x.shape[:-1], i)


# ---- K2.6 router after the gate GEMM ---------------------------------------------------

@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, ids_ptr, w_ptr,   # logits [N, E], bias [E] -> ids int32 [N, K], w fp32 [N, K]
    stride_l, E, scaling,
    K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """One program per token."""
    pdl.enter(PDL)
    row = tl.program_id(0)
    route_row(logits_ptr + row * stride_l, bias_ptr, ids_ptr + row * K, w_ptr + row * K, E, scaling,
              K, BLOCK_E, BLOCK_K)


@triton.jit
def route_row(lrow, bias_ptr, ids_row, w_row, E, scaling,
              K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """One token's routing: logits lrow [E] (read past L1, `.cg`: another program of the same
    kernel may have written them), bias [E] -> ids_row int32 [K], w_row fp32 [K]. Used by
    `route` and by the skinny router GEMM's epilogue (kernels.skinny).

    Top-k by K rounds of one max over int64 keys that order by (score + bias, then lower
    expert index): the fp32 bits made order-preserving as int32, shifted up, with
    BLOCK_E - 1 - index below. The weights are gathered from the scores in registers after
    the loop (not reloaded: one dependent L2 round trip less, -14 us in the c=1 decode step)."""
    offs = tl.arange(0, BLOCK_E)
    m = offs < E
    z = tl.load(lrow + offs, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-z))
    sel = tl.where(m, sig + tl.load(bias_ptr + offs, mask=m, other=0.0).to(tl.float32), float("-inf"))
    bits = sel.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)                   # signed order == float order
    key = (bits.to(tl.int64) << 32) | (BLOCK_E - 1 - offs).to(tl.int64)
    ko = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(K):   # k rounds: top-k in descending order, lowest index among ties
        best = tl.max(key, axis=0)
        idx = (BLOCK_E - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
        ids = tl.where(ko == j, idx, ids)
        key = tl.where(offs == idx, -9223372036854775807 - 1, key)
    ws = tl.where(ko < K, tl.gather(sig, ids, 0), 0.0)
    ws = ws / tl.sum(ws, axis=0) * scaling
    tl.store(ids_row + ko, ids, mask=ko < K)
    tl.store(w_row + ko, ws, mask=ko < K)


def route_ref(logits, bias, top_k, scaling):
    """Gate logits `[N, E]` -> (ids int32 `[N, k]`, weights fp32 `[N, k]`), as kernels.moe.route."""
    s = torch.sigmoid(logits.float())
    ids = torch.topk(s + bias.float(), top_k, dim=-1).indices
    w = s.gather(-1, ids)
    return ids.to(torch.int32), w / w.sum(-1, keepdim=True) * scaling


def route(logits, bias, top_k, scaling, pdl_mode=None):
    n, e = logits.shape
    lg = logits.contiguous()
    ids = torch.empty(n, top_k, dtype=torch.int32, device=logits.device)
    w = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    _route_kernel[(n,)](lg, bias, ids, w, lg.stride(0), e, float(scaling),
                        K=top_k, BLOCK_E=_pow2(e), BLOCK_K=_pow2(top_k), num_warps=1, **pdl.args(_pdl(lg, pdl_mode)))
    return ids, w
