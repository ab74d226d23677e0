"""YaRN rotary embedding on interleaved pairs (DESIGN §3; DeepSeek-V3's reference).

The rope dims of q and k are rotated as pairs (2i, 2i+1) by angle position * freq_i.
YaRN (factor s, original context L0, beta_fast/beta_slow) keeps the high-frequency
dims as they are, divides the low-frequency ones by s, and ramps linearly between the
two over the dims whose wavelength falls between L0/beta_fast and L0/beta_slow. The
attention magnitude correction m^2 lives in `ModelConfig.softmax_scale`.
"""
from __future__ import annotations

import math

import torch

from ddbench.engine.config import ModelConfig


def _correction_dim(n_rot: float, dim: int, base: float, max_pos: int) -> float:
    """The rope dim whose wavelength makes `n_rot` turns over `max_pos` positions."""
    return dim * math.log(max_pos / (n_rot * 2 * math.pi)) / (2 * math.log(base))


def yarn_freqs(cfg: ModelConfig) -> torch.Tensor:
    """fp32 `[qk_rope_dim / 2]` angular frequencies per rotated pair."""
    dim, base = cfg.qk_rope_dim, cfg.rope_theta
    freqs = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)   # [dim/2]
    if cfg.rope_factor > 1:
        lo = max(math.floor(_correction_dim(cfg.rope_beta_fast, dim, base, cfg.rope_original_max_pos)), 0)
        hi = min(math.ceil(_correction_dim(cfg.rope_beta_slow, dim, base, cfg.rope_original_max_pos)), dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        smooth = 1 - ramp                      # 1: keep (high freq), 0: interpolate by factor
        freqs = freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth
    return freqs.float()


def rope_cos_sin(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions int `[B, T]` -> (cos, sin) fp32 `[B, T, R/2]`."""
    ang = positions.float().unsqueeze(-1) * freqs                      # [B, T, R/2]
    return ang.cos(), ang.sin()
