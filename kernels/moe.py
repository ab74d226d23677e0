"""Routed-expert MoE: the K2.6 router and the MoE GEMM on Marlin-packed INT4 weights.

`fused_moe(x, topk_ids, topk_weights, w, backend)` is the one entry point: x `[T, H]`,
routing `[T, k]`, weights `MarlinMoE` (one TP rank's shard) -> `[T, H]`, the weighted
sum over each token's k experts of w2 · (SiLU(x·w_gate) * x·w_up). With TP the result
is this rank's partial sum (the caller all-reduces).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import marlin


@dataclass
class MarlinMoE:
    """One rank's routed experts in Marlin layout (shapes as `kernels.marlin.repack_moe`)."""
    w13: torch.Tensor        # int32 [E, H/16, 4*I]   (gate | up, N = 2*I)
    w13_scale: torch.Tensor  # bf16  [E, H/g, 2*I]
    w2: torch.Tensor         # int32 [E, I/16, 2*H]
    w2_scale: torch.Tensor   # bf16  [E, I/g, H]
    group_size: int = 32

    @property
    def n_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w2.shape[-1] // 2

    @property
    def inter(self) -> int:
        return self.w13.shape[-1] // 4

    def expert_bytes(self) -> int:
        """Bytes of one expert's packed weights plus scales."""
        ts = (self.w13, self.w13_scale, self.w2, self.w2_scale)
        return sum(t[0].numel() * t.element_size() for t in ts)


def route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int,
          routed_scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """K2.6 router (noaux_tc, n_group = topk_group = 1).

    x `[T, H]`, gate_weight `[E, H]`, bias `[E]` (selection only) -> (ids int32 `[T, k]`,
    weights fp32 `[T, k]`): sigmoid scores, top-k of score + bias, weights = the chosen
    scores renormalised to sum 1, times `routed_scaling`.
    """
    scores = torch.sigmoid(x.float() @ gate_weight.float().t())            # [T, E]
    ids = torch.topk(scores + bias.float(), top_k, dim=-1).indices         # [T, k]
    w = scores.gather(-1, ids)
    w = w / w.sum(-1, keepdim=True) * routed_scaling
    return ids.to(torch.int32), w


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w: MarlinMoE,
              backend: str = "torch") -> torch.Tensor:
    """The MoE GEMM; `backend` is 'torch' (reference) or 'triton'."""
    if backend == "torch":
        return fused_moe_ref(x, topk_ids, topk_weights, w)
    if backend == "triton":
        from kernels.moe_triton import fused_moe_triton

        return fused_moe_triton(x, topk_ids, topk_weights, w)
    raise ValueError(f"unknown MoE backend {backend!r}; choose torch or triton")


def fused_moe_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  w: MarlinMoE, compute_dtype=torch.float32) -> torch.Tensor:
    """Reference: dequantize each touched expert and compute in `compute_dtype`."""
    t, k = topk_ids.shape
    h, i = w.hidden, w.inter
    flat_ids = topk_ids.reshape(-1).long()                                 # [T*k]
    token_of = torch.arange(t, device=x.device).repeat_interleave(k)       # [T*k]
    out = torch.zeros(t, h, dtype=compute_dtype, device=x.device)
    xc = x.to(compute_dtype)
    for e in torch.unique(flat_ids).tolist():
        sel = (flat_ids == e).nonzero().squeeze(1)
        tok = token_of[sel]
        w13 = marlin.dequantize(w.w13[e], w.w13_scale[e], h, 2 * i, w.group_size, compute_dtype)  # [H, 2I]
        w2 = marlin.dequantize(w.w2[e], w.w2_scale[e], i, h, w.group_size, compute_dtype)         # [I, H]
        gate_up = xc[tok] @ w13                                            # [n, 2I]
        act = F.silu(gate_up[:, :i]) * gate_up[:, i:]                     # [n, I]
        y = (act @ w2) * topk_weights.reshape(-1)[sel].to(compute_dtype).unsqueeze(1)
        out.index_add_(0, tok, y)
    return out.to(x.dtype)
