"""Static, preallocated, position-indexed MLA KV cache (DESIGN §3, §8).

Per layer and stream only the latent KV is kept: the normed kv latent (`kv_lora_rank`,
512 on K2.6) and the roped shared key (`qk_rope_dim`, 64). Stream b's cached prefix is
positions 0 .. prefix_len[b]-1; a forward writes its T new tokens at prefix_len[b] ..
prefix_len[b]+T-1. The caller owns prefix_len and advances it.
"""
from __future__ import annotations

import torch

from ddbench.engine.config import ModelConfig
from ddbench.kernels.ddtree import commit_kv_ref


class KVCache:
    """ckv `[n_layers, B, S, kv_lora_rank]`, kpe `[n_layers, B, S, qk_rope_dim]`."""

    def __init__(self, cfg: ModelConfig, n_streams: int, max_len: int, device=None,
                 dtype=torch.bfloat16):
        self.n_streams, self.max_len = n_streams, max_len
        self.ckv = torch.zeros(cfg.n_layers, n_streams, max_len, cfg.kv_lora_rank, device=device, dtype=dtype)
        self.kpe = torch.zeros(cfg.n_layers, n_streams, max_len, cfg.qk_rope_dim, device=device, dtype=dtype)

    def commit(self, prefix_len: torch.Tensor, accepted: torch.Tensor) -> None:
        """Keep accepted tree nodes: node j of stream b sits at prefix_len[b] + j; accepted
        int `[B, A]` lists node indices root first, -1 padded; entry i moves to
        prefix_len[b] + i, in every layer. No host sync."""
        n, b, s, _ = self.ckv.shape
        # all layers in one call: layers folded into the stream dim, [n, B, S, .] -> [n*B, S, .]
        commit_kv_ref(self.ckv.view(n * b, s, -1), self.kpe.view(n * b, s, -1),
                      prefix_len.repeat(n), accepted.repeat(n, 1))
