"""W4A16 MoE on Hopper's wgmma for many tokens an expert (experiments/moe_wgmma.cu): a
candidate for the large-T path that `kernels/moe_wide.cu` runs today (docs/notes/moe.md, "T >=
1024"). Blocks of up to 128 tokens of one expert (`SIZES`), so each weight is dequantized once a
block (moe_wide's MT 2: once every 32 tokens); a producer warpgroup copies the stages, two consumer
warpgroups dequantize their 64 weight rows into registers as wgmma's A operand while the
previous stage's products run.

`fused_moe_wgmma(x, topk_ids, topk_weights, w)` computes what `kernels.moe.fused_moe_ref`
computes in four launches and no host syncs: `moe_marlin.plan` with blocks of CH = sizes[-1] rows,
`wg_w13`, `wg_w2`, and moe_wide's `wide_ksum` (a token's k weighted rows summed in slot order).

Predicted at the K2.6 TP-8 shard, T = 4096 (uniform: 85 tokens an expert, one block each, the
products at N = 96): w13 1536 items of 176 MFLOP, 338 us at an 800 TFLOP/s GEMM rate (moe_wide:
1286 us on the H200); w2 21504 items of 4 stages, 169 us of products plus the items' epilogues;
the layer ~1.0 ms if the products run at 65 % of the rate (docs/notes/moe.md, "wgmma v3"). With
blocks of 48 rows (SIZES 16-32-48) the candidate for T = 96-512. Not yet run on a GPU.
"""
from __future__ import annotations

import functools

import torch

from ddbench.kernels import moe_marlin, moe_wide, pdl
from ddbench.kernels.device import sm_count
from experiments.cuda import kernel

STAGES = 4
SIZES = (48, 96, 128)         # the wgmma N a block of up to each many rows runs; blocks of SIZES[-1] rows


def stage_bytes(ch: int) -> int:
    """A ring slot, as moe_wgmma.cu's STAGE_B: token tile (ch rows x 128 bytes), words, scales."""
    return ch * 128 + 2 * 4 * 128 * 4 + 1024


def shared_bytes(stages: int = STAGES, sizes: tuple = SIZES) -> int:
    """A program's dynamic shared memory, as moe_wgmma.cu's SMEM_B: 1024 of alignment slack, the
    ring, the w13 exchange tile (64 x CH fp32), two bf16 output tiles (CH x 64), two warpgroups'
    slots and weights (CH ints and floats each), two mbarriers a slot."""
    ch = sizes[-1]
    return 1024 + stages * stage_bytes(ch) + 64 * ch * 4 + 2 * ch * 128 + 2 * ch * 8 + stages * 16


def check_config(stages: int, sizes: tuple) -> None:
    """Raise ValueError unless the sizes are 3 ascending multiples of 16 up to 128 and the program
    fits an SM's 227 KB."""
    if (len(sizes) != 3 or any(n % 16 or not 16 <= n <= 128 for n in sizes) or list(sizes) != sorted(sizes)
            or stages < 2 or shared_bytes(stages, sizes) > 227 * 1024):
        raise ValueError(f"moe_wgmma: sizes must be 3 ascending multiples of 16 up to 128 and the ring fit 227 KB, "
                         f"got stages {stages}, sizes {sizes} ({shared_bytes(stages, sizes)} bytes)")


def fits(x: torch.Tensor, topk_ids: torch.Tensor, w) -> bool:
    """bf16 x on sm_90, group 32, 64 or 128, H and I multiples of 128 (the stage loop runs
    64-row K stages in pairs), moe_marlin's planning."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == w.hidden
            and torch.cuda.get_device_capability(x.device) == (9, 0) and w.group_size in (32, 64, 128)
            and w.hidden % 128 == 0 and w.inter % 128 == 0 and w.n_experts <= moe_marlin.MAXE
            and topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0])


@functools.lru_cache(maxsize=None)
def _kernel(name: str, stages: int, sizes: tuple, group: int, hidden: int, inter: int, top_k: int,
            device: torch.device):
    check_config(stages, sizes)
    return kernel("moe_wgmma.cu", name, {"STAGES": stages, "N1": sizes[0], "N2": sizes[1], "N3": sizes[2], "G": group,
                                         "H": hidden, "I": inter, "TOPK": top_k}, device, "a")


def _launch(name: str, stages: int, sizes: tuple, w, top_k: int, device: torch.device, args: list, mode: int) -> None:
    k = _kernel(name, stages, tuple(sizes), w.group_size, w.hidden, w.inter, top_k, device)
    k(sm_count(device), 384, shared_bytes(stages, sizes), args + [mode], pdl=mode > 0)


def wg_w13(x: torch.Tensor, routing: tuple, top_k: int, w, stages: int = STAGES, sizes: tuple = SIZES,
           pdl_mode: int = 2) -> torch.Tensor:
    """x bf16 `[T, H]` -> SiLU(gate)*up bf16 `[rows, I]` in the plan's sorted rows (plan with CH =
    sizes[-1])."""
    sorted_ids, block_expert, block_rows, n_blocks = routing
    act = torch.empty(sorted_ids.numel(), w.inter, dtype=torch.bfloat16, device=x.device)
    _launch("wg_w13", stages, sizes, w, top_k, x.device,
            [x.contiguous(), w.w13, w.w13_scale, sorted_ids, block_expert, block_rows, n_blocks, act],
            pdl.on(x, pdl_mode))
    return act


def wg_w2(act: torch.Tensor, routing: tuple, topk_weights: torch.Tensor, w, stages: int = STAGES,
          sizes: tuple = SIZES, pdl_mode: int = 2) -> torch.Tensor:
    """`wg_w13`'s output -> bf16 `[T, H]`: the w2 GEMM, top-k weights, then moe_wide's k sum."""
    sorted_ids, block_expert, block_rows, n_blocks = routing
    t, top_k = topk_weights.shape
    h, dev = w.hidden, act.device
    ypart = torch.empty(t * top_k, h, dtype=torch.bfloat16, device=dev)
    out = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
    mode = pdl.on(act, pdl_mode)
    _launch("wg_w2", stages, sizes, w, top_k, dev, [act, w.w2, w.w2_scale, sorted_ids, block_expert, block_rows, n_blocks,
                                             topk_weights.reshape(-1).float().contiguous(), ypart], mode)
    ksum = moe_wide._kernel("wide_ksum", 2, 4, 4, 1, w.group_size, h, w.inter, top_k, dev)
    ksum(-(-t * (h // 8) // 256), 256, 0, [ypart, out, t, mode], pdl=mode > 0)
    return out


def fused_moe_wgmma(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w,
                    stages: int = STAGES, sizes: tuple = SIZES, pdl_mode: int = 2) -> torch.Tensor:
    """x bf16 `[T, H]`, routing `[T, k]`, `MarlinMoE` -> bf16 `[T, H]` (as fused_moe_ref)."""
    if not fits(x, topk_ids, w):
        raise ValueError(f"moe_wgmma does not take x {x.dtype} {tuple(x.shape)} on {x.device} with experts of "
                         f"H = {w.hidden}, I = {w.inter}, group {w.group_size}")
    routing = moe_marlin.plan(topk_ids, w.n_experts, sizes[-1], pdl_mode)
    act = wg_w13(x, routing, topk_ids.shape[1], w, stages, sizes, pdl_mode)
    return wg_w2(act, routing, topk_weights, w, stages, sizes, pdl_mode)


def a_fragment(word: torch.Tensor) -> torch.Tensor:
    """moe_wgmma.cu's `dequant_a` mirrored: one warp's Marlin words (int32 `[32]`, lanes 4g + t)
    -> the 16 x 16 A slice (rows n, columns k; values q) that wgmma reads from the lanes'
    registers a[r] (pair i of nibbles (i, i + 4) into a[(i % 2) * 2 + i // 2]), by PTX's A
    fragment layout: a0a1 (g, 2t..), a2a3 (g + 8, 2t..), a4a5 (g, 2t + 8..), a6a7 (g + 8, 2t + 8..)."""
    a = torch.zeros(16, 16, dtype=torch.int64)
    places = [(0, 0), (8, 0), (0, 8), (8, 8)]                           # a[r]: (row, column) offsets
    for lane, pairs in enumerate(moe_marlin.nibble_pairs(word)):
        g, t = lane // 4, lane % 4
        for i, pair in enumerate(pairs):
            dr, dc = places[(i % 2) * 2 + i // 2]
            a[g + dr, 2 * t + dc], a[g + dr, 2 * t + dc + 1] = pair
    return a


def b_offset(row: int, k: int) -> int:
    """The byte offset moe_wgmma.cu's producer copies element k (0..63) of a stage's token row to:
    16-byte chunk k / 8 of the row's 128 bytes XOR the row's index mod 8 (the 128-byte swizzle
    of wgmma's K-major operand; the tile is 1024-aligned)."""
    return row * 128 + (((k // 8) ^ (row % 8)) << 4) + 2 * (k % 8)
