"""The routed experts' gate/up projection and act (w13) of one decode token in clusters
(CUDA, `kernels/moe_w13.cu`).

At one token `kernels.moe_gemv`'s Triton GEMV splits each assignment's K into 16 programs,
writes their fp32 partial sums to global memory and lets the last program to arrive
(kernels.ticket) add them and compute the act. Here the K splits of an assignment's column
half are one cluster of programs (`CLUSTERS`) that add their partials through distributed
shared memory, and each program issues all its words (~126 KB at K2.6 TP-8) with cp.async
the moment it has read its expert id, instead of a few pipeline stages at a time. Same maths
as that GEMV (packed fp16 products of a word, fp32 scales and sums), so the act differs from
it only in the order of the fp32 sums; fp16 act rows out, the input of `kernels.moe_w2`.

`fits` says whether a call qualifies; `ENABLED` (environment `DDBENCH_MOE_W13=0` turns it
off) is read at each call.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from kernels import marlin, pdl

ENABLED = os.environ.get("DDBENCH_MOE_W13", "1") != "0"
THREADS = 512                                # as kernels/moe_w13.cu
# launch shapes to try, in order (read at each call): (programs a cluster = K splits, gate blocks
# of 64 columns a program); the first whose whole grid the GPU holds at once is taken
# (`Kernel.max_active_clusters`: a cluster must fit in one GPC). The H200 here holds 15 clusters
# of 8 (16 wanted) and 30 of 4 (32 wanted), 39 of 3 (docs/notes/decode.md).
CLUSTERS = ((8, 2), (4, 1), (3, 1))
MAX_SHARED = 200 * 1024                      # bytes of a program's words and scales, at most


def config(hidden: int, inter: int, group: int, n: int, n_sms: int, cluster: int, cb: int) -> dict[str, int] | None:
    """Compile-time shape for clusters of `cluster` programs of `cb` gate blocks, or None where
    the kernel does not apply (I a multiple of 64 cb, group a multiple of 32 with at least
    `cluster` and 2 groups, at most one program an SM, MAX_SHARED): NCH chunks of k tiles
    (the most, up to 8, that split them evenly over the warps, else 8)."""
    groups = hidden // group
    if inter % (64 * cb) or hidden % group or group % 32 or groups < max(2, cluster):
        return None
    if inter // (64 * cb) * n * cluster > n_sms:
        return None
    kt = -(-groups // cluster) * group // 16
    if kt * 2 * cb * 512 + -(-groups // cluster) * 2 * cb * 128 > MAX_SHARED:
        return None
    nch = next((c for c in range(8, 0, -1) if -(-kt // c) * 2 * cb % (THREADS // 32) == 0), 8)
    return {"H": hidden, "I": inter, "G": group, "CB": cb, "CL": cluster, "NCH": nch}


def shared_bytes(cfg: dict[str, int]) -> int:
    """Dynamic shared memory of a program: its words and scales (afterwards its warps' column
    sums, 256 bytes a warp and a block)."""
    nb, groups = 2 * cfg["CB"], -(-cfg["H"] // cfg["G"] // cfg["CL"])
    return max(groups * cfg["G"] // 16 * nb * 512 + groups * nb * 128, 256 * (THREADS // 32 + nb))


def grid(cfg: dict[str, int], n: int) -> tuple[int, int]:
    """(programs of the n assignments' column halves, n): one cluster a (half, assignment)."""
    return cfg["CL"] * cfg["I"] // (64 * cfg["CB"]), n


@functools.lru_cache(maxsize=None)
def _kernel(defines: tuple, device: torch.device):
    from kernels.cuda import Kernel
    return Kernel("moe_w13.cu", "moe_w13", dict(defines), device)


@functools.lru_cache(maxsize=None)
def _launch_config(hidden: int, inter: int, group: int, n: int, device: torch.device,
                   clusters: tuple[tuple[int, int], ...]) -> dict[str, int] | None:
    """The first `config` of `clusters` whose grid the GPU holds at once, or None."""
    from kernels.moe_triton import sm_count
    for cl, cb in clusters:
        cfg = config(hidden, inter, group, n, sm_count(device), cl, cb)
        if cfg is not None:
            g = grid(cfg, n)
            if _kernel(tuple(sorted(cfg.items())), device).max_active_clusters(g, THREADS, shared_bytes(cfg)) \
                    >= g[0] * g[1] // cl:
                return cfg
    return None


def fits(x: torch.Tensor, n: int, w) -> bool:
    """x fp16 `[1, H]` (one token, 16-byte aligned) on a Hopper GPU, n assignments, w
    (`MarlinMoE`) with I a multiple of 64 and at least two scale groups, and a launch `config`
    whose clusters the GPU holds at once."""
    return (ENABLED and x.is_cuda and x.dtype == torch.float16 and x.dim() == 2 and x.shape == (1, w.hidden)
            and x.is_contiguous() and x.data_ptr() % 16 == 0 and pdl.hopper(x)
            and _launch_config(w.hidden, w.inter, w.group_size, n, x.device, tuple(CLUSTERS)) is not None)


def moe_w13(x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor, w, pdl: bool = True) -> torch.Tensor:
    """act fp16 `[n, I]`: row j = SiLU(x gate) * (x up) * topk_weights[j] with expert ids[j]'s
    w13 (ids int32 `[n]`, weights fp32 `[n]`), as `reference`. pdl: launched as a dependent
    of the kernel before (kernels.pdl), which may write x, ids and the weights."""
    n = ids.numel()
    if not fits(x, n, w):
        raise ValueError(f"moe_w13 does not take x {tuple(x.shape)} {x.dtype} with {n} assignments of experts of "
                         f"H = {w.hidden}, I = {w.inter}, group {w.group_size} (kernels.moe_w13.fits)")
    for name, t, dtype in (("ids", ids, torch.int32), ("topk_weights", topk_weights, torch.float32)):
        if t.dtype != dtype or t.numel() != n or not t.is_contiguous():
            raise ValueError(f"moe_w13: {name} must be {n} contiguous {dtype}, got {t.dtype} {tuple(t.shape)}")
    cfg = _launch_config(w.hidden, w.inter, w.group_size, n, x.device, tuple(CLUSTERS))
    act = torch.empty(n, w.inter, dtype=torch.float16, device=x.device)
    _kernel(tuple(sorted(cfg.items())), x.device)(grid(cfg, n), THREADS, shared_bytes(cfg),
                                                  [x, ids, topk_weights, w.w13, w.w13_scale, act, int(pdl)], pdl=pdl)
    return act


def reference(x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor, w) -> torch.Tensor:
    """torch: x (fp32) times each assignment's dequantized w13, SiLU(gate) * up * weight, fp16 `[n, I]`."""
    rows = []
    for j, e in enumerate(ids.tolist()):
        w13 = marlin.dequantize(w.w13[e], w.w13_scale[e], w.hidden, 2 * w.inter, w.group_size)   # [H, 2I]
        gate, up = (x.reshape(1, -1).float() @ w13)[0].split(w.inter)
        rows.append(F.silu(gate) * up * topk_weights[j].float())
    return torch.stack(rows).half()
