"""MLA attention in the absorbed form over a position-indexed latent KV cache.

One function serves prefill (causal), decode (one token) and tree verification: stream b
has `prefix_len[b]` cached positions, all visible, and T new tokens already written to
cache positions prefix_len[b] .. prefix_len[b]+T-1; new token i sees new token j iff
`visible[b, i, j]`. Scores use the 512 latent dims (query absorbed through wkv_b's key
part) plus the 64 rope dims; the output stays in the latent space (before v/o).
"""
from __future__ import annotations

import torch


def mla_attention_ref(q_lat: torch.Tensor, q_rope: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                      prefix_len: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference (fp32 softmax).

    q_lat `[B, T, H, L]`, q_rope `[B, T, H, R]`, ckv `[B, S, L]`, kpe `[B, S, R]`,
    prefix_len int `[B]`, visible bool `[B, T, T]` -> `[B, T, H, L]` in q's dtype.
    """
    b, t, h, _ = q_lat.shape
    s = ckv.shape[1]
    scores = (torch.einsum("bthl,bsl->bths", q_lat.float(), ckv.float())
              + torch.einsum("bthr,bsr->bths", q_rope.float(), kpe.float())) * scale  # [B, T, H, S]
    pos = torch.arange(s, device=ckv.device)                                             # [S]
    plen = prefix_len.to(ckv.device).long().view(b, 1, 1)
    rel = pos.view(1, 1, s) - plen                                                       # [B, 1, S]
    in_prefix = rel < 0                                                                   # [B, 1, S]
    node = rel.clamp(0, t - 1).expand(b, t, s)                                           # [B, T, S]
    sees_node = visible.gather(2, node) & (rel < t)                                      # [B, T, S]
    mask = in_prefix | sees_node                                                          # [B, T, S]
    scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("bths,bsl->bthl", p, ckv.float()).to(q_lat.dtype)
