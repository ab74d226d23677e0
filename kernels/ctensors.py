"""compressed-tensors `pack-quantized` checkpoint tensors (DESIGN §3).

Per linear: `weight_packed` int32 `[out, in/8]` (8 nibbles per word along the input
dim, value j at bits 4j), `weight_scale` bf16 `[out, in/g]`, `weight_shape` int64 `[2]`.
"""
from __future__ import annotations

import torch

def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 8n]` (values 0..15) -> int32 `[..., n]`, value j at bits 4j."""
    if q.shape[-1] % 8:
        raise ValueError(f"last dim {q.shape[-1]} is not a multiple of 8")
    q = q.to(torch.uint8)
    # two nibbles per byte (value 2j low, 2j+1 high); four little-endian bytes per word
    byte = q[..., 0::2] | (q[..., 1::2] << 4)
    return byte.contiguous().view(torch.int32)


def unpack_nibbles(w: torch.Tensor) -> torch.Tensor:
    """int32 `[..., n]` -> uint8 `[..., 8n]`."""
    byte = w.contiguous().view(torch.uint8)
    return torch.stack([byte & 0xF, byte >> 4], dim=-1).reshape(*w.shape[:-1], -1)


def to_checkpoint(q: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """q uint8 `[out, in]` + scale `[out, in/g]` -> the three checkpoint tensors."""
    return {
        "weight_packed": pack_nibbles(q),
        "weight_scale": scale.to(torch.bfloat16),
        "weight_shape": torch.tensor(list(q.shape[-2:]), dtype=torch.int64),
    }


def from_checkpoint(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `to_checkpoint`: -> (q uint8 `[out, in]`, scale)."""
    q = unpack_nibbles(t["weight_packed"])
    out_f, in_f = (int(x) for x in t["weight_shape"])
    if tuple(q.shape[-2:]) != (out_f, in_f):
        raise ValueError(f"weight_packed unpacks to {tuple(q.shape)}, weight_shape says {(out_f, in_f)}")
    return q, t["weight_scale"]
