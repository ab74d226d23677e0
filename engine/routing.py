"""Which experts the target's MoE layers run: the router's choice or a draw, and a count of
the distinct experts each layer touched.

Random weights route every token of a stream's tree to nearly the same experts (the
hidden states of sibling nodes barely differ), so a verify of 90 tokens touched ~85
distinct experts a layer where 90 tokens of real text under independent top-8 routing
touch ~326: the MoE work of a random-weight run is not the real one. `Routing` sits right
after the router in `engine.model.MoE.forward` (the router's work is still done) and:

- `model`: keeps the router's choice (the default with a checkpoint);
- `uniform`: replaces it by independent uniform top-k draws per token, as `ddbench
  moe-sweep` does (the default with random weights);
- `overlap:F`: the root of each stream's tree (and every token of a forward that is not a
  tree verify) draws uniformly; a tree node keeps each of its parent's experts with
  probability F and fills the rest with uniform experts its parent does not keep.

The draws read a pool of precomputed uniform top-k rows, so a step has no host sync and
the graphs stay valid. Where the caller names each token (`Routing.key`, from `PrefixKeys`:
a hash of the token's whole prefix, the stream's tokens up to and including it, set by the
engine's steppers and prefill), the row is a hash of (key, layer): the same prefix always
runs the same experts, so the target stays a deterministic function of the prefix and real
acceptance stays lossless against AR, while tokens with different prefixes draw
independently, as a real router's different hidden states do. (A key of token and position
alone gave a tree's nodes that share a drafted token at one depth under different parents the
same experts: at c = 10, budget 8, 249 distinct experts a layer ran where independent
routing touches 326.) Elsewhere the rows run on from an offset hashed from a device counter
that every call advances (fresh on every CUDA-graph replay). overlap's keep/replace draws are
random (`torch.rand`). Every call counts the distinct experts of the forward into device
buffers indexed by tokens per stream (`t`: 1 for a decode step, budget + 1 for a verify, the
chunk for a prefill); `mean_touched(t)` reads them after the run. Draw and count are one
launch on the GPU (`kernels.route_draw`); the launch is the hook's whole cost on the step (a
real router pays none of it); the keys cost a few element-wise launches a step.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ddbench.engine.config import ConfigError
from ddbench.kernels import route_draw

POOL_ROWS = 16384          # precomputed uniform top-k rows (>= tokens of one forward)
MAX_T = 2048               # tokens-per-stream slots of the counters (larger t share the last)


def parse_routing(text: str) -> tuple[str, float]:
    """'uniform' | 'model' | 'overlap:F' -> (mode, F)."""
    kind, _, arg = text.strip().partition(":")
    if kind in ("uniform", "model") and not arg:
        return kind, 0.0
    if kind == "overlap" and arg:
        try:
            f = float(arg)
        except ValueError:
            raise ConfigError(f"--routing {text!r}: F must be a number in [0, 1]") from None
        if not 0.0 <= f <= 1.0:
            raise ConfigError(f"--routing {text!r}: F must be in [0, 1]")
        return "overlap", f
    raise ConfigError(f"--routing {text!r}: use uniform, model or overlap:F")


def default_routing(text: str | None, checkpoint) -> str:
    """`--routing` unset: the router's own choice with a checkpoint, uniform draws with random weights."""
    return text if text else ("model" if checkpoint is not None else "uniform")


@contextmanager
def keyed(routing: "Routing | None", keys: torch.Tensor | None, tree: tuple | None = None):
    """Name one forward's tokens to `routing` (`keys` `[N, T]` long, `PrefixKeys`; `tree` as
    `Routing.tree` for a DDTree verify) for the body of the `with`, cleared after it however
    the body ends; `routing` None: nothing to name."""
    if routing is None:
        yield
        return
    routing.key, routing.tree = keys, tree
    try:
        yield
    finally:
        routing.key = routing.tree = None


class Routing:
    """The routing hook of one model (see the module docstring). `tree` (set by the DDTree
    verify before its forward): (parent `[N, T]` long, depth `[N, T]` long, max depth)."""

    def __init__(self, spec: str, n_experts: int, top_k: int, device, seed: int = 0, pool_rows: int = POOL_ROWS,
                 pdl_mode: int = 2):
        self.mode, self.overlap = parse_routing(spec)
        self.label = spec.strip()
        self.n_experts, self.top_k = n_experts, top_k
        self.device = torch.device(device)
        self.tree: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self.key: torch.Tensor | None = None      # the forward's tokens' `PrefixKeys` ([N, T] long); None: unkeyed
        self.seed, self.pdl_mode = seed, pdl_mode
        self.touched = torch.zeros(MAX_T, dtype=torch.int64, device=self.device)     # sum of distinct counts
        self.calls = torch.zeros(MAX_T, dtype=torch.int64, device=self.device)
        self.state = torch.zeros(1, dtype=torch.int64, device=self.device)           # stream draws' counter
        self.scratch = torch.zeros(2, dtype=torch.int64, device=self.device)         # counters of uncounted draws
        self.pool = None
        if self.mode != "model":
            g = torch.Generator(device=self.device).manual_seed(seed)
            rows = []
            for r0 in range(0, pool_rows, 4096):      # chunks: a [4096, E] uniform block at a time
                n = min(4096, pool_rows - r0)
                u = torch.rand(n, n_experts, generator=g, device=self.device)
                rows.append(u.topk(top_k, dim=-1).indices.to(torch.int32))
            self.pool = torch.cat(rows)                                               # [P, k]

    def reset(self) -> None:
        self.touched.zero_()
        self.calls.zero_()

    def mean_touched(self, t: int | None = None) -> float | None:
        """Mean distinct experts per MoE layer and forward (forwards of `t` tokens per stream,
        or all); None when no such forward ran. Reads the device counters (syncs)."""
        sl = slice(None) if t is None else min(t, MAX_T - 1)
        calls = float(self.calls[sl].sum())
        return float(self.touched[sl].sum()) / calls if calls else None

    def draw(self, n: int) -> torch.Tensor:
        """`n` uniform top-k rows `[n, k]` int32 from a random offset (overlap's candidates)."""
        p = self.pool.shape[0]
        off = torch.randint(0, p, (1,), device=self.device)
        return self.pool[(off + torch.arange(n, device=self.device)) % p]

    def __call__(self, ids: torch.Tensor, w: torch.Tensor, b: int, t: int, layer: int = 0):
        """The router's (ids `[b*t, k]`, weights) of a forward of b streams x t tokens in MoE
        layer `layer` -> the ids the experts run (the router's weights stay), counted."""
        key = self.key.reshape(-1) if self.key is not None and tuple(self.key.shape) == (b, t) else None
        draw = route_draw.KEYED if key is not None else route_draw.STREAM
        if self.mode == "overlap" and self.tree is not None and tuple(self.tree[0].shape) == (b, t):
            fresh = self._launch(ids, key, layer, draw, self.scratch[:1], self.scratch[1:])  # uncounted
            ids = self.overlap_ids(fresh.view(b, t, -1), *self.tree).view(b * t, -1).to(torch.int32)
            draw = route_draw.COPY
        elif self.mode == "model":
            draw = route_draw.COPY
        return self._launch(ids, key, layer, draw, self.touched, self.calls, min(t, MAX_T - 1)), w

    def _launch(self, ids, key, layer, mode, touched, calls, slot=0):
        return route_draw.draw_count(ids if self.pool is None else self.pool, ids, key, layer, self.seed, mode,
                                     self.state, touched, calls, slot, self.n_experts, self.pdl_mode)

    def overlap_ids(self, fresh: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor,
                    max_depth: int) -> torch.Tensor:
        """fresh `[N, T, k]` uniform draws; parent/depth `[N, T]` of a tree (parent < child)
        -> `[N, T, k]`: roots keep their draw, a node at depth d keeps each of its parent's
        experts with probability F and fills the other slots, in order, with its own draws
        that its parent does not keep (enough of them: k distinct draws meet at most
        |kept| kept experts)."""
        n, t, k = fresh.shape
        cand = self.draw(n * t).view(n, t, k).long()                              # replacement candidates
        keep = torch.rand(n, t, k, device=fresh.device) < self.overlap            # [N, T, k]
        out = fresh.long()
        par = parent.clamp(min=0).view(n, t, 1).expand(n, t, k)
        for d in range(1, max_depth + 1):
            pid = out.gather(1, par)                                               # [N, T, k] parent's experts
            kept = torch.where(keep, pid, -1)
            ok = ~(cand.unsqueeze(-1) == kept.unsqueeze(-2)).any(-1)               # [N, T, k] candidate unused
            o_rank = torch.where(ok, ok.long().cumsum(-1) - 1, k)                  # ok candidate -> its slot
            buf = torch.zeros(n, t, k + 1, dtype=torch.long, device=fresh.device)
            buf.scatter_(-1, o_rank, cand)
            d_rank = ((~keep).long().cumsum(-1) - 1).clamp(min=0)                  # i-th dropped slot
            new = torch.where(keep, pid, buf.gather(-1, d_rank))
            out = torch.where((depth == d).unsqueeze(-1), new, out)
        return out


class PrefixKeys:
    """Each stream's key: the hash of its committed tokens, sum over positions p of
    token_p * B^p mod M (M = 2^31 - 1). A token's key adds its own term, and a tree node's
    the terms of its path from the root, so a node and the AR step that reaches the same
    prefix get the same key; different prefixes collide with probability ~2^-31."""

    M, B = (1 << 31) - 1, 48271

    def __init__(self, n_streams: int, max_len: int, device):
        w = [1]
        for _ in range(max_len - 1):
            w.append(w[-1] * self.B % self.M)
        self.weight = torch.tensor(w, dtype=torch.long, device=device)                # [max_len] B^p mod M
        self.prefix = torch.zeros(n_streams, dtype=torch.long, device=device)         # committed tokens' hash

    def prompt(self, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Keys `[N, t]` of a prefill chunk (`valid` False past a prompt's end: such a token
        adds nothing); the chunk's valid tokens are committed."""
        terms = torch.where(valid, tokens.long() * self.weight[positions] % self.M, 0)
        keys = (self.prefix.view(-1, 1) + terms.cumsum(1)) % self.M
        self.prefix.copy_(keys[:, -1])
        return keys

    def tree(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Keys `[N, T]` of tokens after each stream's committed prefix; `visible[b, i, j]`:
        token j is token i or one of its ancestors (a one-token step: all True). Few launches
        (they run inside the timed step): a term is < 2^49 (token ids < 2^18), so a path of up
        to 2^13 of them sums in int64 before the one mod."""
        terms = tokens.long() * self.weight[positions]                                  # [N, T]
        return (torch.where(visible, terms.unsqueeze(1), 0).sum(-1) + self.prefix.view(-1, 1)) % self.M

    def commit(self, keys: torch.Tensor, node: torch.Tensor | None, active: torch.Tensor) -> None:
        """Streams with `active` now end at token `node[b]` (None: token 0) of the forward
        that `keys` named."""
        last = keys[:, 0] if node is None else keys.gather(1, node.clamp(min=0).view(-1, 1)).squeeze(1)
        torch.where(active, last, self.prefix, out=self.prefix)


class LayerHook:
    """The hook one MoE layer calls: its layer index, then the shared `Routing`."""

    def __init__(self, routing: Routing, layer: int):
        self.routing, self.layer = routing, layer

    def __call__(self, ids, w, b, t):
        return self.routing(ids, w, b, t, self.layer)


def set_routing(model, routing: Routing | None) -> None:
    """Install (or with None remove) the hook in every MoE layer of `model`."""
    for i, moe in model.moe_blocks().items():
        moe.routing = None if routing is None else LayerHook(routing, i)


def install(model, spec: str, seed: int = 0) -> Routing:
    """A `Routing` for `model`'s config and device, installed in its MoE layers."""
    r = Routing(spec, model.cfg.n_experts, model.cfg.top_k, model.device, seed,
                pdl_mode=model.ops.pdl_mode)
    set_routing(model, r)
    return r
