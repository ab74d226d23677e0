"""MLA decode attention, one token a stream, in one CUDA launch (`kernels/mla_decode.cu`).

The decode step's attention was three launches a layer: the query absorption (q_nope through
wkv_b's key rows), the split attention and the merge with the value projection. Here a
cluster of 8 programs a (stream, head) does all three: each program loads its chunk of the
cached KV and its slices of the head's key and value rows before the PDL wait, computes a
slice of q_lat and a partial softmax over its chunk, and the cluster exchanges slices and
partials through distributed shared memory (Hopper) instead of global memory and launches.

Takes K2.6's head dims (latent 512, rope 64, no-rope query 128, value 128), bf16, one
token a stream, at most `MAX_STREAMS` streams, and caches of at most `MAX_POSITIONS` positions (its capacity: the
launch's shared memory is sized from it); `fits` says whether a call qualifies, and the
model falls back to the three launches otherwise. Whether the model uses it at all, and up
to how many streams, is the kernel choice's `attn` (`kernels.select`).
"""
from __future__ import annotations

import functools

import torch

from ddbench.kernels import pdl
from ddbench.kernels.mla_attn import mla_attention_ref

# streams a call may have under the kernel choice attn=auto: at one stream the c=1 step was 356 us faster
# than with the three launches, at ten 809 us slower (H200, docs/notes/decode.md, session 14)
MAX_STREAMS = 1
CLUSTER, THREADS = 8, 256                       # as kernels/mla_decode.cu
L, DR, DN, DV = 512, 64, 128, 128               # latent, rope, no-rope query, value dims a head
MAX_ROWS = 64                                   # KV rows a program holds in shared memory
MAX_POSITIONS = CLUSTER * MAX_ROWS
LOG2E = 1.4426950408889634


def fits(q: torch.Tensor, wkv_b: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
         prefix_len: torch.Tensor, visible: torch.Tensor, max_streams: int | None = None) -> bool:
    """Whether `mla_decode` takes these arguments: a Hopper GPU, bf16, one token a stream
    and at most `max_streams` streams (None: any number), K2.6's head dims, a cache of
    S <= MAX_POSITIONS positions, int32 prefix_len."""
    return (q.is_cuda and q.dim() == 4 and (max_streams is None or q.shape[0] <= max_streams) and q.shape[1] == 1
            and q.shape[3] == DN + DR
            and q.dtype == wkv_b.dtype == ckv.dtype == kpe.dtype == torch.bfloat16
            and ckv.shape[-1] == L and kpe.shape[-1] == DR and prefix_len.dtype == torch.int32
            and visible.shape == (q.shape[0], 1, 1)
            and wkv_b.shape == (q.shape[2] * (DN + DV), L) and ckv.shape[1] <= MAX_POSITIONS
            and pdl.hopper(q))


@functools.lru_cache(maxsize=None)
def _kernel(rows: int, device: torch.device):
    from ddbench.kernels.cuda import Kernel
    return Kernel("mla_decode.cu", "mla_decode", {"MAXP": rows}, device)


def mla_decode(q: torch.Tensor, wkv_b: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
               prefix_len: torch.Tensor, visible: torch.Tensor, scale: float, pdl: bool = True) -> torch.Tensor:
    """Attention output after each head's value projection, `[B, 1, NH, DV]` bf16, as `reference`.

    q `[B, 1, NH, DN + DR]` (no-rope then roped dims of each head, as wq_b writes them), wkv_b
    `[NH * (DN + DV), L]` (each head's DN key rows then DV value rows), ckv `[B, S, L]` and kpe
    `[B, S, DR]` (rows contiguous) with the new token's row already at prefix_len[b], prefix_len
    int32 `[B]`, visible bool `[B, 1, 1]`. pdl: launched as a dependent of the kernel before
    (kernels.pdl); its cached rows and weights are read before the wait."""
    if not fits(q, wkv_b, ckv, kpe, prefix_len, visible):
        raise ValueError(f"mla_decode does not take q {tuple(q.shape)} {q.dtype}, wkv_b {tuple(wkv_b.shape)}, "
                         f"cache {tuple(ckv.shape)}, prefix_len {prefix_len.dtype}, visible {tuple(visible.shape)} "
                         "(kernels.mla_decode.fits)")
    b, _, nh, _ = q.shape
    s = ckv.shape[1]
    if (q.stride(3) != 1 or q.stride(2) != DN + DR or ckv.stride(2) != 1 or ckv.stride(1) != L
            or kpe.shape != (b, s, DR) or kpe.stride(2) != 1 or kpe.stride(1) != DR or not wkv_b.is_contiguous()):
        raise ValueError("mla_decode: q's heads, the cache rows and wkv_b must be contiguous")
    rows = -(-s // CLUSTER)
    out = torch.empty(b, 1, nh, DV, dtype=q.dtype, device=q.device)
    shared = (rows * (L + DR) + DN * L // CLUSTER + DV // CLUSTER * L) * 2
    vis = visible.view(torch.uint8)
    _kernel(rows, q.device)((CLUSTER * nh, b), THREADS, shared,
                            [q, q.stride(0), wkv_b, ckv, ckv.stride(0), kpe, kpe.stride(0), prefix_len, vis,
                             vis.stride(0), out, float(scale * LOG2E), int(pdl)], pdl=pdl)
    return out


def reference(q: torch.Tensor, wkv_b: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
              prefix_len: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """torch: q_lat = q_nope W_uk (fp32, rounded to q's dtype), `mla_attention_ref` (output in
    q's dtype), times each head's W_uv in fp32, rounded."""
    nh = q.shape[2]
    w = wkv_b.view(nh, DN + DV, L).float()
    q_lat = torch.einsum("bthd,hdl->bthl", q[..., :DN].float(), w[:, :DN]).to(q.dtype)
    o = mla_attention_ref(q_lat, q[..., DN:], ckv, kpe, prefix_len, visible, scale)
    return torch.einsum("bthl,hvl->bthv", o.float(), w[:, DN:]).to(q.dtype)
