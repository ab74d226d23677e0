"""Symmetric group-wise INT4 quantization (compressed-tensors convention).

Stored values are unsigned nibbles 0..15 = signed int4 (-8..7) + 8; one scale per
`group_size` consecutive values along the input dim. Dequantized w = (q - 8) * scale.
"""
from __future__ import annotations

import math

import torch

INT4_OFFSET = 8
# std of a uniform draw from the signed int4 values -7..7
INT4_UNIFORM_STD = math.sqrt((15 ** 2 - 1) / 12)


def quantize(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """w float `[out, in]` -> (q uint8 `[out, in]` in 0..15, scale `[out, in/group]` bf16)."""
    out_f, in_f = w.shape[-2:]
    if group_size <= 0 or in_f % group_size:
        raise ValueError(f"group size {group_size} does not divide in={in_f}")
    wg = w.float().reshape(*w.shape[:-1], in_f // group_size, group_size)
    # symmetric: the largest magnitude maps to 7.5 so both -8 and +7 are used
    scale = (wg.abs().amax(-1) / 7.5).clamp_min(1e-8).to(torch.bfloat16)
    q = torch.round(wg / scale.float().unsqueeze(-1)).clamp(-8, 7) + INT4_OFFSET
    return q.to(torch.uint8).reshape(w.shape), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Inverse of `quantize`: q `[..., out, in]`, scale `[..., out, in/g]` -> `[..., out, in]`."""
    in_f = q.shape[-1]
    g = in_f // scale.shape[-1]
    w = (q.to(torch.int16) - INT4_OFFSET).to(dtype)
    return (w.reshape(*q.shape[:-1], in_f // g, g) * scale.to(dtype).unsqueeze(-1)).reshape(q.shape)


def random_int4(shape, group_size: int = 32, fan_in: int | None = None, gain: float = 1.0,
                generator: torch.Generator | None = None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random-but-valid INT4 weight `[..., out, in]`: zero-mean nibbles and per-group scales.

    Stored nibbles are uniform in 1..15 (signed -7..7): -8 is left out so the codes have zero
    mean. A -8..7 draw has a -0.5-step mean that every expert adds along the same direction,
    which grew the residual stream linearly with depth (16-50x its RMS after 61 layers).
    Scales give the dequantized weight std about gain/sqrt(fan_in) (fan_in defaults to `in`),
    which keeps a linear layer's output variance equal to its input's; each group's scale
    varies by a factor in [0.75, 1.25] so scale handling is exercised.
    """
    *lead, out_f, in_f = shape
    fan_in = fan_in or in_f
    q = torch.randint(1, 16, tuple(shape), dtype=torch.uint8, generator=generator, device=device)
    base = gain / (INT4_UNIFORM_STD * math.sqrt(fan_in))
    jitter = torch.rand((*lead, out_f, in_f // group_size), generator=generator, device=device)
    scale = (base * (0.75 + 0.5 * jitter)).to(torch.bfloat16)
    return q, scale
