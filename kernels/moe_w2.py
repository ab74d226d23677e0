"""The routed experts' down projection (w2) of one decode token, its weights loaded before the
PDL wait (CUDA, `kernels/moe_w2.cu`).

In the decode step the expert ids come from the router two launches before w2 (the w13 GEMV
sits between), so w2 need not wait for anything but its input act: each program loads its
64 output columns of all the token's experts (words and scales, ~72 KB at K2.6 TP-8) into
shared memory while w13 still runs, and after the wait only multiplies. `kernels.moe_gemv`'s
Triton GEMV, which holds no shared memory across the wait, loads them after it. Same maths as
that GEMV (packed fp16 products of a word, fp32 scales and sums); per-assignment fp32 rows out.
With `shared` (the shared expert's act and down projection) it also does that projection (its
static weights loaded before the wait too) and the sum over the token's rows: the MoE's
bf16 output, and the launch that did that sum (kernels.skinny's shared down GEMM) goes.

`fits` says whether a call qualifies (CUDA, Hopper, at most 8 assignments, an intermediate
size of at most `MAX_INTER`, with `shared` at most `MAX_SHARED` bytes of shared memory a
program); `ENABLED` (environment `DDBENCH_MOE_W2=0` turns it off) is read at each call.
"""
from __future__ import annotations

import functools
import os

import torch

from kernels import marlin, pdl

ENABLED = os.environ.get("DDBENCH_MOE_W2", "1") != "0"
THREADS = 256
MAX_ASSIGN = THREADS // 32      # one warp an assignment (kernels/moe_w2.cu)
MAX_INTER = 256                 # I: the words of 8 experts' 64 columns, 64 KB at 256, fit shared memory
MAX_SHARED = 200 * 1024         # dynamic shared memory of a program, bytes


def fits(act: torch.Tensor, w, shared: tuple | None = None) -> bool:
    """act fp16 `[n, I]` on a Hopper GPU with n <= MAX_ASSIGN, w (`MarlinMoE`) of I <= MAX_INTER,
    at least two scale groups (one group is Marlin's per-channel scale order, which the kernel
    does not read) and 64 | H, and shared None or (sact, wsd): the shared expert's act bf16 `[1, Is]`
    and down projection bf16 `[H, Is]`, both contiguous, 8 | Is, within MAX_SHARED: what `moe_w2` takes."""
    ok = (ENABLED and act.is_cuda and act.dtype == torch.float16 and act.dim() == 2
          and act.shape[0] <= MAX_ASSIGN and act.shape[1] == w.inter <= MAX_INTER and w.inter % 32 == 0
          and w.group_size % 32 == 0 and w.inter // w.group_size >= 2 and w.hidden % 64 == 0 and act.is_contiguous()
          and pdl.hopper(act))
    if not ok or shared is None:
        return ok
    sact, wsd = shared
    i_s = wsd.shape[-1]
    return (sact.dtype == wsd.dtype == torch.bfloat16 and sact.numel() == i_s and wsd.shape == (w.hidden, i_s)
            and i_s % 8 == 0 and sact.is_contiguous() and wsd.is_contiguous() and sact.data_ptr() % 16 == 0
            and wsd.data_ptr() % 16 == 0 and _shared_bytes(w.inter, w.group_size, i_s) <= MAX_SHARED)


def _shared_bytes(inter: int, group: int, i_s: int) -> int:
    """A program's dynamic shared memory: 8 assignments' words and scales, its 64 rows of wsd."""
    return MAX_ASSIGN * (inter // 16 * 32 + inter // group * 8) * 16 + 64 * i_s * 2


@functools.lru_cache(maxsize=None)
def _kernel(inter: int, group: int, i_s: int, device: torch.device):
    from kernels.cuda import Kernel
    return Kernel("moe_w2.cu", "moe_w2", {"I": inter, "G": group, "IS": i_s}, device)


def moe_w2(act: torch.Tensor, ids: torch.Tensor, w, pdl: bool = True, shared: tuple | None = None) -> torch.Tensor:
    """y fp32 `[n, H]`: row j = act[j] (fp16 `[n, I]`) times expert ids[j]'s w2 (int32 `[n]`),
    as `reference`; with shared = (sact, wsd) (as `fits` says) the bf16 `[1, H]` sum of those
    rows and sact wsd^T, as `reference_shared`. pdl: launched as a dependent of the kernel
    before (kernels.pdl); the ids are read before the wait, so they must come from a kernel at
    least two launches back, and sact must be written before this launch (stream order)."""
    if not fits(act, w, shared):
        raise ValueError(f"moe_w2 does not take act {tuple(act.shape)} {act.dtype} with experts of I = {w.inter}, "
                         f"H = {w.hidden}, group {w.group_size}"
                         f"{'' if shared is None else ' and that shared expert'} (kernels.moe_w2.fits)")
    n, inter = act.shape
    if ids.dtype != torch.int32 or ids.numel() != n or not ids.is_contiguous():
        raise ValueError(f"moe_w2: ids must be {n} contiguous int32, got {ids.dtype} {tuple(ids.shape)}")
    h = w.hidden
    sact, wsd = shared if shared is not None else (None, None)
    i_s = 0 if wsd is None else wsd.shape[1]
    y = (torch.empty(n, h, dtype=torch.float32, device=act.device) if wsd is None
         else torch.empty(1, h, dtype=torch.bfloat16, device=act.device))
    _kernel(inter, w.group_size, i_s, act.device)(h // 64, THREADS, _shared_bytes(inter, w.group_size, i_s),
                                                  [act, ids, n, w.w2, w.w2_scale, sact, wsd, y, h, int(pdl)],
                                                  pdl=pdl)
    return y


def reference(act: torch.Tensor, ids: torch.Tensor, w) -> torch.Tensor:
    """torch: each assignment's act (fp32) times its expert's dequantized w2, fp32 `[n, H]`."""
    rows = []
    for j, e in enumerate(ids.tolist()):
        w2 = marlin.dequantize(w.w2[e], w.w2_scale[e], w.inter, w.hidden, w.group_size)   # [I, H]
        rows.append(act[j].float() @ w2)
    return torch.stack(rows)


def reference_shared(act: torch.Tensor, ids: torch.Tensor, w, sact: torch.Tensor, wsd: torch.Tensor) -> torch.Tensor:
    """torch: the sum of `reference`'s rows plus sact wsd^T (fp32), bf16 `[1, H]`."""
    return (reference(act, ids, w).sum(0) + sact.reshape(-1).float() @ wsd.float().T).bfloat16()[None]
