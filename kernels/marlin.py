"""The Marlin 4-bit weight layout (DESIGN §4), vectorized over leading (expert) dims.

A logical weight `q[K, N]` (K = input dim, stored values 0..15) becomes int32
`[K/16, 2N]`: word `[kt, nb*128 + lane*4 + tile]` holds the eight nibbles that
mma.m16n8k16 lane `lane` needs of tile `tile` of the 16x64 block (kt, nb), in the
order (2t,g) (2t+8,g) (2t,g+8) (2t+8,g+8) (2t+1,g) (2t+9,g) (2t+1,g+8) (2t+9,g+8)
with t = lane % 4, g = lane // 4.
"""
from __future__ import annotations

import torch

from ddbench.kernels import ctensors, quant


def _weight_perm() -> torch.Tensor:
    """Index into a run of 1024 tile-major values (4 tiles of 16x16) -> Marlin order."""
    perm = []
    for lane in range(32):
        t, g = lane % 4, lane // 4
        lane_vals = [16 * r + g + 8 * b for b in (0, 1) for r in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)]
        for tile in range(4):
            perm.extend(256 * tile + v for v in lane_vals)
    interleave = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
    return torch.tensor(perm).reshape(-1, 8)[:, interleave].reshape(-1)


WEIGHT_PERM = _weight_perm()
WEIGHT_PERM_INV = torch.argsort(WEIGHT_PERM)
# grouped scales: runs of 64 columns, an 8x8 transpose p[8i+j] = i + 8j
SCALE_PERM = torch.tensor([i + 8 * j for i in range(8) for j in range(8)])
# per-channel scales: runs of 32 columns
SCALE_PERM_SINGLE = torch.tensor([2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)])


def check_shape(k: int, n: int, group_size: int | None = None) -> None:
    """Raise ValueError unless (K, N, group) obey the Marlin rules."""
    if k % 16:
        raise ValueError(f"K={k} is not a multiple of 16")
    if n % 64:
        raise ValueError(f"N={n} is not a multiple of 64")
    if group_size is not None and group_size != -1 and (group_size <= 0 or k % group_size):
        raise ValueError(f"group size {group_size} does not divide K={k}")


def pack(q: torch.Tensor) -> torch.Tensor:
    """q integer `[..., K, N]` with values 0..15 -> int32 `[..., K/16, 2N]` in Marlin order."""
    *lead, k, n = q.shape
    check_shape(k, n)
    # 16x16 tiles: [.., K/16, 16, N/16, 16] -> [.., K/16, N/16, 16, 16] -> [.., K/16, 16N]
    tiles = q.to(torch.uint8).reshape(*lead, k // 16, 16, n // 16, 16).transpose(-3, -2)
    tiles = tiles.reshape(*lead, k // 16, 16 * n)
    # each run of 1024 values (16x64 block) reordered into lane/fragment order
    runs = tiles.reshape(*lead, k // 16, n // 64, 1024)[..., WEIGHT_PERM.to(q.device)]
    return ctensors.pack_nibbles(runs.reshape(*lead, k // 16, 16 * n))


def unpack(packed: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """Inverse of `pack`: int32 `[..., K/16, 2N]` -> uint8 `[..., K, N]`."""
    check_shape(k, n)
    *lead, kt, words = packed.shape
    if (kt, words) != (k // 16, 2 * n):
        raise ValueError(f"packed shape {(kt, words)} does not match K={k}, N={n}")
    runs = ctensors.unpack_nibbles(packed).reshape(*lead, k // 16, n // 64, 1024)
    tiles = runs[..., WEIGHT_PERM_INV.to(packed.device)].reshape(*lead, k // 16, n // 16, 16, 16)
    return tiles.transpose(-3, -2).reshape(*lead, k, n)


def permute_scales(s: torch.Tensor, group_size: int) -> torch.Tensor:
    """Scales `[..., K/g, N]` -> same shape in Marlin order (grouped, or per-channel if g == K or -1)."""
    *lead, groups, n = s.shape
    per_channel = group_size == -1 or groups == 1
    perm = SCALE_PERM_SINGLE if per_channel else SCALE_PERM
    width = perm.numel()
    if n % width:
        raise ValueError(f"N={n} is not a multiple of {width}")
    return s.reshape(*lead, groups, n // width, width)[..., perm.to(s.device)].reshape(s.shape)


def unpermute_scales(s: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of `permute_scales`."""
    *lead, groups, n = s.shape
    perm = SCALE_PERM_SINGLE if (group_size == -1 or groups == 1) else SCALE_PERM
    inv = torch.argsort(perm).to(s.device)
    return s.reshape(*lead, groups, n // perm.numel(), perm.numel())[..., inv].reshape(s.shape)


def from_checkpoint(q_out_in: torch.Tensor, scale_out_in: torch.Tensor, group_size: int):
    """Checkpoint orientation (q `[.., N, K]`, scale `[.., N, K/g]`) -> (Marlin q, Marlin scales).

    The checkpoint's `[N, K/8]` words transposed are the GPTQ `[K/8, N]` layout; repacking
    changes no values.
    """
    q_kn = q_out_in.transpose(-1, -2)
    check_shape(q_kn.shape[-2], q_kn.shape[-1], group_size)
    return pack(q_kn), permute_scales(scale_out_in.transpose(-1, -2).contiguous(), group_size)


def repack_moe(gate: dict, up: dict, down: dict, tp: int = 1, rank: int = 0, group_size: int = 32):
    """Per-expert checkpoint tensors -> fused Marlin MoE tensors for TP rank `rank` of `tp`.

    `gate`, `up`, `down` are compressed-tensors dicts whose tensors carry a leading expert
    dim (`weight_packed [E, out, in/8]`, `weight_scale [E, out, in/g]`). Each expert is
    sharded along its intermediate dim I (I/tp per rank). Returns a dict with
    `w13 [E, H/16, 4*I_loc]` (gate rows then up rows, N = 2*I_loc), `w13_scale [E, H/g, 2*I_loc]`,
    `w2 [E, I_loc/16, 2H]`, `w2_scale [E, I_loc/g, H]`.
    """
    qg, sg = _unpack_expert_dict(gate)
    qu, su = _unpack_expert_dict(up)
    qd, sd = _unpack_expert_dict(down)
    inter = qg.shape[-2]
    if inter % tp:
        raise ValueError(f"intermediate {inter} does not split over tp={tp}")
    rows = slice(rank * inter // tp, (rank + 1) * inter // tp)
    groups = slice(rows.start // group_size, rows.stop // group_size)
    if rows.start % group_size or rows.stop % group_size:
        raise ValueError(f"a TP shard of {inter // tp} breaks the group size {group_size}")
    q13 = torch.cat([qg[..., rows, :], qu[..., rows, :]], dim=-2)  # [E, 2*I_loc, H]
    s13 = torch.cat([sg[..., rows, :], su[..., rows, :]], dim=-2)
    w13, w13_scale = from_checkpoint(q13, s13, group_size)
    w2, w2_scale = from_checkpoint(qd[..., :, rows], sd[..., :, groups], group_size)
    return {"w13": w13, "w13_scale": w13_scale, "w2": w2, "w2_scale": w2_scale}


def _unpack_expert_dict(t: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return ctensors.unpack_nibbles(t["weight_packed"]), t["weight_scale"]


def dequantize(packed: torch.Tensor, scales: torch.Tensor, k: int, n: int, group_size: int,
               dtype=torch.float32) -> torch.Tensor:
    """Marlin tensors -> dense weight `[..., K, N]` (the reference path)."""
    q = unpack(packed, k, n)
    s = unpermute_scales(scales, group_size)
    w = quant.dequantize(q.transpose(-1, -2), s.transpose(-1, -2), dtype)  # [.., N, K]
    return w.transpose(-1, -2)
