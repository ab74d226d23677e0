"""DDTree kernels: tree builder, greedy accept and KV commit (DESIGN §5)."""
from __future__ import annotations

import torch


def commit_kv_ref(ckv: torch.Tensor, kpe: torch.Tensor, prefix_len: torch.Tensor,
                  accepted: torch.Tensor) -> None:
    """Move accepted tree nodes' KV to contiguous positions after each stream's prefix, in place.

    ckv `[B, S, L]`, kpe `[B, S, R]`; node j of stream b sits at cache position
    prefix_len[b] + j; accepted int `[B, A]` lists node indices root first, -1 padded.
    Entry i goes to prefix_len[b] + i. No host sync.
    """
    b, a = accepted.shape
    plen = prefix_len.long().view(b, 1)
    valid = accepted >= 0                                                   # [B, A]
    src = plen + accepted.long().clamp_min(0)                               # [B, A]
    dst = plen + torch.arange(a, device=accepted.device).view(1, a)         # [B, A]
    for cache in (ckv, kpe):
        d = cache.shape[-1]
        rows = cache.gather(1, src.unsqueeze(-1).expand(b, a, d))            # read all first
        old = cache.gather(1, dst.unsqueeze(-1).expand(b, a, d))
        cache.scatter_(1, dst.unsqueeze(-1).expand(b, a, d), torch.where(valid.unsqueeze(-1), rows, old))
