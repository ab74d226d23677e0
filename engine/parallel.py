"""Tensor parallelism: a `Comm` and a small vocabulary of parallel layers (docs/DESIGN.md §3, §8).

The model only talks to a `Comm`; nothing else calls `torch.distributed`.

- `LocalComm`: tp = 1, every collective is the identity.
- `DistComm`: one process per rank over `torch.distributed` (NCCL on GPUs, gloo on CPUs).
- `SimComm`: the rank-shard simulation. One process runs rank `rank`'s shard of a TP-n
  model; collectives return a tensor of the right shape built from the local one (an
  all-reduce returns the local partial sum, an all-gather tiles the local piece n times)
  and add the modelled time `predict_us(nbytes)` of the real collective to a counter.

Layers (weights are the rank's shard; sharding itself happens in `engine.weights`):
`Linear` (replicated), `ColumnParallelLinear` (output dim split), `RowParallelLinear`
(input dim split, all-reduce after unless `reduce=False`), `VocabParallelEmbedding`
(rows split, all-reduce of the masked lookups), `ParallelLMHead` (rows split, all-gather
of the logits). Each layer runs its GEMM under a kernel choice (`kernels.select`; default:
its defaults), the model's own where the model builds it.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ddbench.engine.phases import phase
from ddbench.kernels import skinny
from ddbench.kernels.select import KernelChoice

DEFAULT_KERNELS = KernelChoice()


def linear(kernels: KernelChoice, x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None = None,
           reuse_add: bool = False, kind: str = "linear") -> torch.Tensor:
    """x W^T (+ add) under the kernel choice: `kernels.skinny.linear` with the choice's row
    limit, its PDL mode and kernels.gemv where the choice names this call's `kind` (one of
    `kernels.select.GEMV_CALLS`)."""
    return skinny.linear(x, w, add, reuse_add, max_rows=kernels.skinny, cuda_gemv=kind in kernels.gemv,
                         pdl_mode=kernels.pdl_mode)


class Comm:
    """Collectives over the tensor-parallel group; `tp` ranks, this is `rank`."""
    tp: int = 1
    rank: int = 0
    simulated: bool = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over ranks (may work in place; use the returned tensor)."""
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Rank pieces concatenated along `dim` in rank order."""
        raise NotImplementedError


class LocalComm(Comm):
    """tp = 1: collectives are the identity."""

    def all_reduce(self, x):
        return x

    def all_gather(self, x, dim=-1):
        return x


class DistComm(Comm):
    """`torch.distributed` over the default process group (NCCL or gloo)."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.tp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def all_reduce(self, x):
        with phase("comm"):
            self.dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x, dim=-1):
        with phase("comm"):
            x = x.contiguous()
            if x.is_cuda:  # one flat buffer: [tp * numel] -> [tp, *x.shape]
                flat = torch.empty(self.tp * x.numel(), dtype=x.dtype, device=x.device)
                self.dist.all_gather_into_tensor(flat, x.reshape(-1), group=self.group)
                parts = list(flat.view(self.tp, *x.shape).unbind(0))
            else:
                parts = [torch.empty_like(x) for _ in range(self.tp)]
                self.dist.all_gather(parts, x, group=self.group)
            return torch.cat(parts, dim=dim)


class SimComm(Comm):
    """Rank-shard simulation: shape-correct stand-ins whose time comes from a model.

    `predict_us(nbytes)` gives the modelled time of one all-reduce of `nbytes` over `tp`
    ranks. An all-gather whose result has `nbytes` is modelled as half an all-reduce of
    `nbytes` (it moves (n-1)/n of the bytes per rank where a ring all-reduce moves
    2(n-1)/n). `modelled_us` and `calls` accumulate per Python call, so read them around
    one eager forward (inside a CUDA graph the Python code runs only at capture).
    """
    simulated = True

    def __init__(self, tp: int, rank: int, predict_us: Callable[[int], float]):
        self.tp, self.rank, self.predict_us = tp, rank, predict_us
        self.modelled_us = 0.0
        self.calls = 0

    def reset(self) -> None:
        self.modelled_us, self.calls = 0.0, 0

    def all_reduce(self, x):
        self.modelled_us += float(self.predict_us(x.numel() * x.element_size()))
        self.calls += 1
        return x

    def all_gather(self, x, dim=-1):
        with phase("comm"):
            out = torch.cat([x] * self.tp, dim=dim)
        self.modelled_us += 0.5 * float(self.predict_us(out.numel() * out.element_size()))
        self.calls += 1
        return out


def _weight(out_f: int, in_f: int, device, dtype) -> nn.Parameter:
    # uninitialised: engine.weights fills every tensor (random init or checkpoint)
    return nn.Parameter(torch.empty(out_f, in_f, device=device, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """Replicated linear, no bias: y = x W^T with W `[out, in]`."""

    def __init__(self, in_f: int, out_f: int, device=None, dtype=None, kernels: KernelChoice = DEFAULT_KERNELS):
        super().__init__()
        self.kernels = kernels
        self.weight = _weight(out_f, in_f, device, dtype)

    def forward(self, x):
        return linear(self.kernels, x, self.weight)


class ColumnParallelLinear(nn.Module):
    """Output dim split over ranks: W shard `[out/tp, in]`, output stays sharded."""

    def __init__(self, in_f: int, out_f: int, comm: Comm, device=None, dtype=None,
                 kernels: KernelChoice = DEFAULT_KERNELS):
        super().__init__()
        if out_f % comm.tp:
            raise ValueError(f"out features {out_f} do not split over tp={comm.tp}")
        self.kernels = kernels
        self.weight = _weight(out_f // comm.tp, in_f, device, dtype)

    def forward(self, x):
        return linear(self.kernels, x, self.weight)


class RowParallelLinear(nn.Module):
    """Input dim split over ranks: W shard `[out, in/tp]`; the partial outputs are
    all-reduced unless `reduce=False` (then the caller reduces, e.g. once for two sums)."""

    def __init__(self, in_f: int, out_f: int, comm: Comm, device=None, dtype=None,
                 kernels: KernelChoice = DEFAULT_KERNELS):
        super().__init__()
        if in_f % comm.tp:
            raise ValueError(f"in features {in_f} do not split over tp={comm.tp}")
        self.comm, self.kernels = comm, kernels
        self.weight = _weight(out_f, in_f // comm.tp, device, dtype)

    def forward(self, x, reduce: bool = True):
        y = linear(self.kernels, x, self.weight)
        return self.comm.all_reduce(y) if reduce else y


class VocabParallelEmbedding(nn.Module):
    """Rows `[vocab/tp, H]` of rank r hold tokens r*vocab/tp ..; other tokens look up 0
    and the all-reduce fills them in. Under `SimComm` every token looks up a local row
    (token mod vocab/tp) so the simulated rank computes on realistic activations."""

    def __init__(self, vocab: int, hidden: int, comm: Comm, device=None, dtype=None):
        super().__init__()
        if vocab % comm.tp:
            raise ValueError(f"vocab {vocab} does not split over tp={comm.tp}")
        self.comm = comm
        self.vocab_local = vocab // comm.tp
        self.start = comm.rank * self.vocab_local
        self.weight = _weight(self.vocab_local, hidden, device, dtype)

    def forward(self, tokens):
        if self.comm.tp == 1:
            return F.embedding(tokens, self.weight)
        if self.comm.simulated:
            return self.comm.all_reduce(F.embedding(torch.remainder(tokens - self.start, self.vocab_local),
                                                    self.weight))
        local = tokens - self.start
        outside = (local < 0) | (local >= self.vocab_local)
        y = F.embedding(local.clamp(0, self.vocab_local - 1), self.weight)   # [.., H]
        y = y.masked_fill(outside.unsqueeze(-1), 0)
        return self.comm.all_reduce(y)


class ParallelLMHead(nn.Module):
    """Rows `[vocab/tp, H]`; local logits (fp32) all-gathered to the full vocab."""

    def __init__(self, hidden: int, vocab: int, comm: Comm, device=None, dtype=None,
                 kernels: KernelChoice = DEFAULT_KERNELS):
        super().__init__()
        if vocab % comm.tp:
            raise ValueError(f"vocab {vocab} does not split over tp={comm.tp}")
        self.comm, self.kernels = comm, kernels
        self.weight = _weight(vocab // comm.tp, hidden, device, dtype)

    def forward(self, h):
        logits = linear(self.kernels, h, self.weight, kind="head").float()   # [.., vocab/tp]
        return self.comm.all_gather(logits, dim=-1)  # [.., vocab]
