"""The routed experts of one decode token on Hopper in one CUDA launch (`kernels/moe_decode.cu`).

At one token the MoE is a GEMV over its k experts' weights (22 MB at K2.6 TP-8): the time is
how fast those bytes arrive, plus what each kernel boundary costs (~2 us a dependent launch on
an H100, measured: experiments/scripts/moe_decode_probe.py). So one launch does both GEMMs:
each (expert, 64 gate + 64 up columns) unit's K splits stream their w13 words through per-warp
cp.async rings, write their sums and count themselves done; meanwhile each of H/64 programs has
its 64 output columns of every expert's w2 loading into shared memory, and once every split is
done it sums the splits into SiLU(gate) * up * top-k weight (fp16), multiplies its columns by
those act rows and sums over the experts in order. The products run on the tensor cores (each
Marlin word an fp16 A fragment, the token every column of B; fp32 sums, scaled per group in
fp32); deterministic (fixed summation orders, no float atomics).

Programs wait for each other inside the launch, so all must be resident at once: one program
an SM, at most the GPU's SM count of them (`fits` checks; 128 at K2.6 TP-8 and one token).
`kernels.moe.resolve_moe_kernel` picks it ("decode").
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ddbench.kernels import marlin, pdl, ticket

KS = 4                   # w13's K splits a unit: 4 x I/64 x 8 = 128 programs at K2.6 TP-8
THREADS = 256
MAX_ASSIGN = THREADS // 32   # one warp of the w2 role an assignment
MAX_INTER = 256          # I: the w2 role keeps 8 experts' 64 columns in shared memory (72 KB at 256)


def fits(x: torch.Tensor, n_assign: int, w) -> bool:
    """x `[1, H]` bf16 or fp16 on a Hopper GPU with at least `programs` SMs, at most MAX_ASSIGN
    assignments, w (`MarlinMoE`) with 64 | I <= MAX_INTER, scale groups of 32, 64 or 128 rows
    with at least two a column (one group is Marlin's per-channel order, not read here) and
    64 | H: what the kernel takes."""
    from ddbench.kernels.device import sm_count

    return (x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2 and x.shape[0] == 1
            and x.shape[1] == w.hidden and x.is_contiguous() and pdl.hopper(x) and shapes_ok(n_assign, w)
            and programs(n_assign, w) <= sm_count(x.device))


def shapes_ok(n_assign: int, w) -> bool:
    """The shape conditions of `fits`: n_assign assignments, experts w."""
    return (1 <= n_assign <= MAX_ASSIGN and w.inter % 64 == 0 and w.inter <= MAX_INTER
            and w.group_size in (32, 64, 128) and w.inter // w.group_size >= 2 and w.hidden // w.group_size >= 2
            and w.hidden % 64 == 0)


def programs(n_assign: int, w) -> int:
    """The grid: the larger of the w13 role's KS x I/64 x n programs and the w2 role's H/64."""
    return max(KS * (w.inter // 64) * n_assign, w.hidden // 64)


def shared_bytes(hidden: int, inter: int, group: int, stages: int | None = None) -> int:
    """Dynamic shared memory: the w13 rings (`stages` deep a warp; by default the kernel's
    STAGES13), the w2 words and scales, the x pairs of a split."""
    stages = stages or (4 if group <= 64 else 2)
    ring = (THREADS // 32) * stages * (group // 16 * 2 * 32 + 16)
    words = MAX_ASSIGN * (inter // 16 * 32 + inter // group * 8)
    per = -(-(hidden // group) // KS)
    return (ring + words) * 16 + per * group // 2 * 4


@functools.lru_cache(maxsize=None)
def _kernel(hidden: int, inter: int, group: int, device: torch.device):
    from ddbench.kernels.cuda import Kernel
    return Kernel("moe_decode.cu", "decode_moe", {"H": hidden, "I": inter, "G": group, "KS": KS}, device)


def fused_moe_decode(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w,
                     sum_k: bool = True, pdl_mode: int = 2) -> torch.Tensor:
    """x `[1, H]`, routing `[1, k]` -> `[1, H]` in x's dtype (sum_k) or the k weighted rows
    fp32 `[k, H]` (slot order) for the caller to sum."""
    n = topk_ids.numel()
    if not fits(x, n, w):
        raise ValueError(f"the decode MoE kernel does not take x {tuple(x.shape)} {x.dtype} with {n} assignments "
                         f"and experts of H = {w.hidden}, I = {w.inter}, group {w.group_size} (kernels.moe_decode.fits)")
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    tw = topk_weights.reshape(-1).float().contiguous()
    h, i = w.hidden, w.inter
    units = n * (i // 64)
    part = torch.empty(units, KS, 128, dtype=torch.float32, device=x.device)
    y = None if sum_k else torch.empty(n, h, dtype=torch.float32, device=x.device)
    out = torch.empty(1, h, dtype=torch.bfloat16, device=x.device) if sum_k else None
    mode = pdl.on(x, pdl_mode)
    _kernel(h, i, w.group_size, x.device)(
        programs(n, w), THREADS, shared_bytes(h, i, w.group_size),
        [x, int(x.dtype == torch.bfloat16), ids, tw, n, w.w13, w.w13_scale, w.w2, w.w2_scale, part,
         ticket.counters(x.device, "moe_decode", 2), y, out, mode], pdl=mode > 0)
    return out.to(x.dtype) if sum_k else y


def reference_w13(x: torch.Tensor, ids: torch.Tensor, topk_w: torch.Tensor, w) -> torch.Tensor:
    """torch, fp32: SiLU(gate) * up * weight of each assignment, `[n, I]`."""
    rows = []
    for j, e in enumerate(ids.tolist()):
        w13 = marlin.dequantize(w.w13[e], w.w13_scale[e], w.hidden, 2 * w.inter, w.group_size)   # [H, 2I]
        gu = x[0].float() @ w13
        rows.append(F.silu(gu[:w.inter]) * gu[w.inter:] * topk_w[j].float())
    return torch.stack(rows)


def reference_w2(act: torch.Tensor, ids: torch.Tensor, w) -> torch.Tensor:
    """torch: each assignment's act (fp32) times its expert's dequantized w2, fp32 `[n, H]`."""
    rows = []
    for j, e in enumerate(ids.tolist()):
        w2 = marlin.dequantize(w.w2[e], w.w2_scale[e], w.inter, w.hidden, w.group_size)   # [I, H]
        rows.append(act[j].float() @ w2)
    return torch.stack(rows)
