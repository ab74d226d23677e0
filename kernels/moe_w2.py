"""The routed experts' down projection (w2) of one decode token, its weights loaded before the
PDL wait (CUDA, `kernels/moe_w2.cu`).

In the decode step the expert ids come from the router two launches before w2 (the w13 GEMV
sits between), so w2 need not wait for anything but its input act: each program loads its
64 output columns of all the token's experts (words and scales, ~72 KB at K2.6 TP-8) into
shared memory while w13 still runs, and after the wait only multiplies. `kernels.moe_gemv`'s
Triton GEMV, which holds no shared memory across the wait, loads them after it. Same maths as
that GEMV (packed fp16 products of a word, fp32 scales and sums); per-assignment fp32 rows out.

`fits` says whether a call qualifies (CUDA, Hopper, at most 8 assignments, an intermediate
size of at most `MAX_INTER`); the gemv config's `w2_cuda` (kernels.moe_triton.MoeTritonConfig)
chooses it.
"""
from __future__ import annotations

import functools

import torch

from ddbench.kernels import marlin, pdl

THREADS = 256
MAX_ASSIGN = THREADS // 32      # one warp an assignment (kernels/moe_w2.cu)
MAX_INTER = 256                 # I: the words of 8 experts' 64 columns, 64 KB at 256, fit shared memory


def fits(act: torch.Tensor, w) -> bool:
    """act fp16 `[n, I]` on a Hopper GPU with n <= MAX_ASSIGN, w (`MarlinMoE`) of I <= MAX_INTER,
    at least two scale groups (one group is Marlin's per-channel scale order, which the kernel
    does not read) and 64 | H: what `moe_w2` takes."""
    return (act.is_cuda and act.dtype == torch.float16 and act.dim() == 2
            and act.shape[0] <= MAX_ASSIGN and act.shape[1] == w.inter <= MAX_INTER and w.inter % 32 == 0
            and w.group_size % 32 == 0 and w.inter // w.group_size >= 2 and w.hidden % 64 == 0 and act.is_contiguous()
            and pdl.hopper(act))


@functools.lru_cache(maxsize=None)
def _kernel(inter: int, group: int, device: torch.device):
    from ddbench.kernels.cuda import Kernel
    return Kernel("moe_w2.cu", "moe_w2", {"I": inter, "G": group}, device)


def moe_w2(act: torch.Tensor, ids: torch.Tensor, w, pdl: bool = True) -> torch.Tensor:
    """y fp32 `[n, H]`: row j = act[j] (fp16 `[n, I]`) times expert ids[j]'s w2 (int32 `[n]`),
    as `reference`. pdl: launched as a dependent of the kernel before (kernels.pdl); the ids
    are read before the wait, so they must come from a kernel at least two launches back."""
    if not fits(act, w):
        raise ValueError(f"moe_w2 does not take act {tuple(act.shape)} {act.dtype} with experts of I = {w.inter}, "
                         f"H = {w.hidden}, group {w.group_size} (kernels.moe_w2.fits)")
    n, inter = act.shape
    if ids.dtype != torch.int32 or ids.numel() != n or not ids.is_contiguous():
        raise ValueError(f"moe_w2: ids must be {n} contiguous int32, got {ids.dtype} {tuple(ids.shape)}")
    h = w.hidden
    y = torch.empty(n, h, dtype=torch.float32, device=act.device)
    shared = MAX_ASSIGN * (inter // 16 * 32 + inter // w.group_size * 8) * 16
    _kernel(inter, w.group_size, act.device)(h // 64, THREADS, shared,
                                             [act, ids, n, w.w2, w.w2_scale, y, h, int(pdl)], pdl=pdl)
    return y


def reference(act: torch.Tensor, ids: torch.Tensor, w) -> torch.Tensor:
    """torch: each assignment's act (fp32) times its expert's dequantized w2, fp32 `[n, H]`."""
    rows = []
    for j, e in enumerate(ids.tolist()):
        w2 = marlin.dequantize(w.w2[e], w.w2_scale[e], w.inter, w.hidden, w.group_size)   # [I, H]
        rows.append(act[j].float() @ w2)
    return torch.stack(rows)
