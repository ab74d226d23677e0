"""The routed experts' gate/up projection and act (w13) of one decode token, all of each
program's weights in flight at once (CUDA, `kernels/moe_w13.cu`).

At one token `kernels.moe_gemv`'s Triton GEMV splits each assignment's K over 16 programs
that stream their words a few pipeline stages at a time. Here each program issues all its
words and scales (~126 KB at K2.6 TP-8) with cp.async the moment it has read its expert id,
and multiplies them chunk by chunk as they land; as there, the last program of each column
part to arrive (kernels.ticket's pattern) adds the K splits' fp32 sums and writes the act.
Same maths as that GEMV (packed fp16 products of a word, fp32 scales and sums), so the act
differs from it only in the order of the fp32 sums; fp16 act rows out, the input of
`kernels.moe_w2`. (A version that added the splits through distributed shared memory in
clusters was slower: the H200 holds 15 clusters of 8 or 30 of 4 at one program an SM, not
the 16 or 32 a token's 32 column parts need; docs/BENCHMARKS.md, decode session 15.)

`fits` says whether a call qualifies; `ENABLED` (environment `DDBENCH_MOE_W13=0` turns it
off) is read at each call.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from kernels import marlin, pdl, ticket

ENABLED = os.environ.get("DDBENCH_MOE_W13", "1") != "0"
THREADS = 512                                # as kernels/moe_w13.cu
MAX_SHARED = 200 * 1024                      # bytes of a program's words and scales, at most
PROGRAMS_PER_SM = 1                          # the grid's programs an SM (2: 64 registers a thread; read at each call)


def config(hidden: int, inter: int, group: int, n: int, n_sms: int) -> dict[str, int] | None:
    """Compile-time shape, or None where the kernel does not apply (I a multiple of 64, group
    a multiple of 32, at least 2 groups): CB gate blocks a program (the fewest, from 1, 2, whose
    share of the weights fits MAX_SHARED), S K splits (as many as keep the grid within
    PROGRAMS_PER_SM programs an SM), NCH chunks of k tiles (the most, up to 8, that split them
    evenly over the warps, else 8), PPS = PROGRAMS_PER_SM."""
    groups = hidden // group
    if inter % 64 or hidden % group or group % 32 or groups < 2:
        return None
    for cb in (1, 2):
        parts = inter // (64 * cb)
        splits = min(groups, n_sms * PROGRAMS_PER_SM // (parts * n)) if inter % (64 * cb) == 0 else 0
        if splits < 1:
            continue
        cfg = {"H": hidden, "I": inter, "G": group, "CB": cb, "S": splits, "NCH": 8, "PPS": PROGRAMS_PER_SM}
        if shared_bytes(cfg) * PROGRAMS_PER_SM > MAX_SHARED:
            continue
        kt = -(-groups // splits) * group // 16
        cfg["NCH"] = next((c for c in range(8, 0, -1) if -(-kt // c) * 2 * cb % (THREADS // 32) == 0), 8)
        return cfg
    return None


def shared_bytes(cfg: dict[str, int]) -> int:
    """Dynamic shared memory of a program: its words and scales (afterwards its warps' column
    sums, 256 bytes a warp and a block)."""
    nb, groups = 2 * cfg["CB"], -(-cfg["H"] // cfg["G"] // cfg["S"])
    return max(groups * cfg["G"] // 16 * nb * 512 + groups * nb * 128, 256 * (THREADS // 32 + nb))


def parts(cfg: dict[str, int]) -> int:
    """Column parts of an assignment (CB gate and CB up blocks each)."""
    return cfg["I"] // (64 * cfg["CB"])


@functools.lru_cache(maxsize=None)
def _kernel(defines: tuple, device: torch.device):
    from kernels.cuda import Kernel
    return Kernel("moe_w13.cu", "moe_w13", dict(defines), device)


def fits(x: torch.Tensor, n: int, w) -> bool:
    """x fp16 `[1, H]` (one token, 16-byte aligned) on a Hopper GPU, n assignments, w
    (`MarlinMoE`) with a `config`."""
    from kernels.moe_triton import sm_count
    return (ENABLED and x.is_cuda and x.dtype == torch.float16 and x.dim() == 2 and x.shape == (1, w.hidden)
            and x.is_contiguous() and x.data_ptr() % 16 == 0 and pdl.hopper(x)
            and config(w.hidden, w.inter, w.group_size, n, sm_count(x.device)) is not None)


def moe_w13(x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor, w, pdl: bool = True) -> torch.Tensor:
    """act fp16 `[n, I]`: row j = SiLU(x gate) * (x up) * topk_weights[j] with expert ids[j]'s
    w13 (ids int32 `[n]`, weights fp32 `[n]`), as `reference`. pdl: launched as a dependent
    of the kernel before (kernels.pdl), which may write x, ids and the weights."""
    from kernels.moe_triton import sm_count
    n = ids.numel()
    if not fits(x, n, w):
        raise ValueError(f"moe_w13 does not take x {tuple(x.shape)} {x.dtype} with {n} assignments of experts of "
                         f"H = {w.hidden}, I = {w.inter}, group {w.group_size} (kernels.moe_w13.fits)")
    for name, t, dtype in (("ids", ids, torch.int32), ("topk_weights", topk_weights, torch.float32)):
        if t.dtype != dtype or t.numel() != n or not t.is_contiguous():
            raise ValueError(f"moe_w13: {name} must be {n} contiguous {dtype}, got {t.dtype} {tuple(t.shape)}")
    cfg = config(w.hidden, w.inter, w.group_size, n, sm_count(x.device))
    units = n * parts(cfg)
    partial = torch.empty(units, cfg["S"], 4 * 64 * cfg["CB"], dtype=torch.float32, device=x.device)
    count = ticket.counters(x.device, "moe_w13", units)
    act = torch.empty(n, w.inter, dtype=torch.float16, device=x.device)
    _kernel(tuple(sorted(cfg.items())), x.device)(
        (cfg["S"] * parts(cfg), n), THREADS, shared_bytes(cfg),
        [x, ids, topk_weights, w.w13, w.w13_scale, partial, count, act, int(pdl)], pdl=pdl)
    return act


def reference(x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor, w) -> torch.Tensor:
    """torch: x (fp32) times each assignment's dequantized w13, SiLU(gate) * up * weight, fp16 `[n, I]`."""
    rows = []
    for j, e in enumerate(ids.tolist()):
        w13 = marlin.dequantize(w.w13[e], w.w13_scale[e], w.hidden, 2 * w.inter, w.group_size)   # [H, 2I]
        gate, up = (x.reshape(1, -1).float() @ w13)[0].split(w.inter)
        rows.append(F.silu(gate) * up * topk_weights[j].float())
    return torch.stack(rows).half()
