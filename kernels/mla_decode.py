"""MLA decode attention, one token a stream, in one CUDA launch (`kernels/mla_decode.cu`).

From the output row of the fused wq_a|wkv_a GEMM to each head's value projection: the q / kv
RMS norms and the key rope with the cache write (what `fused_ops.mla_a_post` does), wq_b
with its rope, the query absorption (q_nope through wkv_b's key rows), the attention with the
merge of its position chunks, and the value projection. Those were five launches a layer. A
cluster of 8 programs a (stream, head) does them all: each program loads its chunk of the
cached KV and its slices of wq_b and of the head's key and value rows before the PDL wait,
computes a slice of the head's query, of q_lat and a partial softmax over its chunk, and the
cluster exchanges slices and partials through distributed shared memory (Hopper) instead of
global memory and launches.

Takes K2.6's head dims (latent 512, rope 64, no-rope query 128, value 128), a q latent of a
multiple of 256 up to `MAX_Q`, bf16, one token a stream, at most `MAX_STREAMS` streams, and
caches of at most `MAX_POSITIONS` positions (its capacity: the launch's shared memory is
sized from it); `fits` says whether a call qualifies, and the model falls back to the
launches otherwise. `ENABLED` (environment `DDBENCH_MLA_DECODE=0` turns it off) is read at
each call.
"""
from __future__ import annotations

import functools
import os

import torch

from kernels.fused_ops import mla_a_post_ref, rope_ref_
from kernels.mla_attn import mla_attention_ref

ENABLED = os.environ.get("DDBENCH_MLA_DECODE", "1") != "0"
# streams a call may have (read at each call): at one stream the c=1 step was 356 us faster
# than with the three launches, at ten 809 us slower (H200, docs/BENCHMARKS.md decode session 14)
MAX_STREAMS = 1
CLUSTER, THREADS = 8, 256                       # as kernels/mla_decode.cu
L, DR, DN, DV = 512, 64, 128, 128               # latent, rope, no-rope query, value dims a head
MAX_ROWS = 64                                   # KV rows a program holds in shared memory
MAX_POSITIONS = CLUSTER * MAX_ROWS
MAX_Q = 1536                                    # q latent dims (K2.6's q_lora_rank): its wq_b rows fit shared memory
LOG2E = 1.4426950408889634


def fits(qkv: torch.Tensor, wq_b: torch.Tensor, wkv_b: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
         cos: torch.Tensor, prefix_len: torch.Tensor, visible: torch.Tensor) -> bool:
    """Whether `mla_decode` takes these arguments (`mla_decode` says their shapes): ENABLED, a
    Hopper GPU, bf16 (cos fp32), one token a stream and at most MAX_STREAMS streams, K2.6's
    head dims, a q latent Q of a multiple of 256 up to MAX_Q, a cache of at most
    MAX_POSITIONS positions, int32 prefix_len."""
    if not (ENABLED and qkv.is_cuda and qkv.dim() == 3 and qkv.shape[1] == 1 and qkv.shape[0] <= MAX_STREAMS):
        return False
    b, q = qkv.shape[0], qkv.shape[2] - L - DR
    nh = wq_b.shape[0] // (DN + DR)
    return (qkv.dtype == wq_b.dtype == wkv_b.dtype == ckv.dtype == kpe.dtype == torch.bfloat16
            and cos.dtype == torch.float32 and cos.shape == (b, 1, DR // 2) and 0 < q <= MAX_Q and q % 256 == 0
            and wq_b.shape == (nh * (DN + DR), q) and wkv_b.shape == (nh * (DN + DV), L)
            and ckv.dim() == 3 and ckv.shape[0] == b and ckv.shape[2] == L and ckv.shape[1] <= MAX_POSITIONS
            and kpe.shape == (b, ckv.shape[1], DR) and prefix_len.dtype == torch.int32 and visible.shape == (b, 1, 1)
            and torch.cuda.get_device_capability(qkv.device)[0] >= 9)


@functools.lru_cache(maxsize=None)
def _kernel(rows: int, q: int, device: torch.device):
    from kernels.cuda import Kernel
    return Kernel("mla_decode.cu", "mla_decode", {"MAXP": rows, "Q": q}, device)


def mla_decode(qkv: torch.Tensor, q_w: torch.Tensor, kv_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               wq_b: torch.Tensor, wkv_b: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
               prefix_len: torch.Tensor, visible: torch.Tensor, eps: float, scale: float,
               pdl: bool = True) -> torch.Tensor:
    """Attention output after each head's value projection, `[B, 1, NH, DV]` bf16, as `reference`.

    qkv `[B, 1, Q + L + DR]` (the fused wq_a|wkv_a GEMM's output: q latent, kv latent, raw
    key rope part), q_w `[Q]` and kv_w `[L]` the norm weights, cos / sin fp32 `[B, 1, DR/2]`,
    wq_b `[NH * (DN + DR), Q]` (each head's no-rope then rope rows), wkv_b `[NH * (DN + DV), L]`
    (each head's DN key rows then DV value rows), the cache ckv `[B, S, L]`, kpe `[B, S, DR]`
    (rows contiguous; the new token's row is written at prefix_len[b], as mla_a_post does),
    prefix_len int32 `[B]`, visible bool `[B, 1, 1]`. pdl: launched as a dependent of the kernel
    before (kernels.pdl); its cached rows and weights are read before the wait."""
    if not fits(qkv, wq_b, wkv_b, ckv, kpe, cos, prefix_len, visible):
        raise ValueError(f"mla_decode does not take qkv {tuple(qkv.shape)} {qkv.dtype}, wq_b {tuple(wq_b.shape)}, "
                         f"wkv_b {tuple(wkv_b.shape)}, cache {tuple(ckv.shape)}, cos {tuple(cos.shape)} {cos.dtype}, "
                         f"prefix_len {prefix_len.dtype}, visible {tuple(visible.shape)} (kernels.mla_decode.fits)")
    b, s, q = qkv.shape[0], ckv.shape[1], qkv.shape[2] - L - DR
    nh = wq_b.shape[0] // (DN + DR)
    if (qkv.stride(2) != 1 or ckv.stride(2) != 1 or ckv.stride(1) != L or kpe.stride(2) != 1 or kpe.stride(1) != DR
            or not all(w.is_contiguous() for w in (q_w, kv_w, wq_b, wkv_b, cos, sin))):
        raise ValueError("mla_decode: qkv's rows, the cache rows, the weights and cos / sin must be contiguous")
    rows = -(-s // CLUSTER)
    out = torch.empty(b, 1, nh, DV, dtype=qkv.dtype, device=qkv.device)
    shared = (rows * (L + DR) + DN * L // CLUSTER + DV // CLUSTER * L + (DN + DR) // CLUSTER * q + q + L) * 2 + 4 * q
    vis = visible.view(torch.uint8)
    _kernel(rows, q, qkv.device)((CLUSTER * nh, b), THREADS, shared,
                                 [qkv, qkv.stride(0), q_w, kv_w, cos, sin, wq_b, wkv_b, ckv, ckv.stride(0), kpe,
                                  kpe.stride(0), prefix_len, vis, vis.stride(0), out, float(eps),
                                  float(scale * LOG2E), int(pdl)], pdl=pdl)
    return out


def reference(qkv: torch.Tensor, q_w: torch.Tensor, kv_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              wq_b: torch.Tensor, wkv_b: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
              prefix_len: torch.Tensor, visible: torch.Tensor, eps: float, scale: float) -> torch.Tensor:
    """torch, the launches it replaces: `mla_a_post_ref` (writes the cache row), wq_b in fp32
    with rope on each head's rope dims (rounded once, as the GEMM's epilogue), q_lat = q_nope
    W_uk (fp32, rounded), `mla_attention_ref` (output rounded), times each head's W_uv in fp32,
    rounded."""
    b = qkv.shape[0]
    nh = wq_b.shape[0] // (DN + DR)
    q_a = mla_a_post_ref(qkv, q_w, kv_w, cos, sin, ckv, kpe, prefix_len, eps)          # [B, 1, Q]
    q = (q_a.float() @ wq_b.float().T).view(b, 1, nh, DN + DR)
    q = rope_ref_(q, cos, sin, DN).to(qkv.dtype)
    w = wkv_b.view(nh, DN + DV, L).float()
    q_lat = torch.einsum("bthd,hdl->bthl", q[..., :DN].float(), w[:, :DN]).to(qkv.dtype)
    o = mla_attention_ref(q_lat, q[..., DN:], ckv, kpe, prefix_len, visible, scale)
    return torch.einsum("bthl,hvl->bthv", o.float(), w[:, DN:]).to(qkv.dtype)
