"""DFlash-style block drafter (DESIGN §5).

A few non-causal transformer layers of the target's hidden size draft a whole block at
once: the input is [bonus, MASK x (B-1)] at positions P .. P+B-1 (P = the stream's
committed length), embedded with the target's embedding; one forward gives B-1
per-position distributions (for positions P+1 .. P+B-1) through the drafter's own final
norm and the target's lm_head.

Conditioning: the target's hidden states at `target_layers` for every committed token
are concatenated, projected by one linear (`fc`) and RMS-normed into a context feature;
every drafter layer projects that feature with its own k/v projections into extra keys
and values, which the block's queries attend to beside the block's own keys (all of the
context, all of the block: nothing causal). The context keys/values are kept per layer
and stream in a static, position-indexed context cache, extended each step with the
accepted tokens (`update`), so a step only projects the few new tokens.

Tensor parallelism mirrors the target: query and KV heads and the MLP intermediate dim
are split over ranks (column-parallel in, row-parallel out with an all-reduce), `fc` is
row-parallel over the concatenated input dim. Everything runs without host syncs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddbench.engine.config import ConfigError
from ddbench.engine.parallel import ColumnParallelLinear, Comm, RowParallelLinear
from ddbench.engine.phases import phase


@dataclass
class DrafterConfig:
    """Drafter shape; `hidden` and `vocab` come from the target."""
    hidden: int
    n_layers: int = 6
    n_heads: int = 64
    n_kv_heads: int = 8
    head_dim: int = 128
    inter: int = 18432
    block: int = 16
    target_layers: tuple[int, ...] = (1, 12, 24, 35, 47, 58)
    norm_eps: float = 1e-6
    rope_theta: float = 1e6
    mask_token: int = 0       # id of the MASK token fed at block positions 1..B-1
    tp: int = 1

    def __post_init__(self):
        self.target_layers = tuple(int(x) for x in self.target_layers)
        for what, n in [("n_heads", self.n_heads), ("n_kv_heads", self.n_kv_heads), ("inter", self.inter)]:
            if n % self.tp:
                raise ConfigError(f"drafter {what}={n} does not split over tp={self.tp}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"drafter n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.block < 2:
            raise ConfigError(f"drafter block={self.block} must be >= 2 (bonus + at least one MASK)")
        if (len(self.target_layers) * self.hidden) % self.tp:
            raise ConfigError("drafter fc input does not split over tp")

    @property
    def depth(self) -> int:
        """Drafted positions per forward (B - 1): the deepest tree level."""
        return self.block - 1

    @property
    def n_local_heads(self) -> int:
        return self.n_heads // self.tp

    @property
    def n_local_kv_heads(self) -> int:
        return self.n_kv_heads // self.tp


# K2.5's public DFlash drafter; `tiny` pairs with the `tiny` target preset (3 layers)
DRAFTER_PRESETS: dict[str, dict] = {
    "k2.5": {},
    "tiny": dict(n_layers=2, n_heads=8, n_kv_heads=4, head_dim=32, inter=256, block=8,
                 target_layers=(0, 1, 2)),
}


def drafter_config(target_cfg, name: str | None = None, **overrides) -> DrafterConfig:
    """Drafter config for a target `ModelConfig` (preset 'tiny' for the tiny target,
    'k2.5' otherwise), sharded like the target (tp = target_cfg.tp)."""
    name = name or ("tiny" if target_cfg.name == "tiny" else "k2.5")
    if name not in DRAFTER_PRESETS:
        raise ConfigError(f"unknown drafter preset {name!r}; choose from {', '.join(DRAFTER_PRESETS)}")
    fields = {"hidden": target_cfg.hidden, "tp": target_cfg.tp, "mask_token": target_cfg.vocab - 1,
              **DRAFTER_PRESETS[name], **overrides}
    dc = DrafterConfig(**fields)
    bad = [layer for layer in dc.target_layers if not 0 <= layer < target_cfg.n_layers]
    if bad:
        raise ConfigError(f"drafter target layers {bad} are not in 0..{target_cfg.n_layers - 1}")
    return dc


def rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate halves (Qwen/Llama style) of x `[N, T, heads, D]` by positions `[N, T]`."""
    ang = positions.float().unsqueeze(-1) * freqs                  # [N, T, D/2]
    cos, sin = ang.cos().unsqueeze(2), ang.sin().unsqueeze(2)      # [N, T, 1, D/2]
    x1, x2 = x.float().chunk(2, dim=-1)                            # [N, T, heads, D/2] each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class DrafterLayer(nn.Module):
    """Pre-norm block: GQA attention over [context keys, block keys] (non-causal), SwiGLU MLP."""

    def __init__(self, dc: DrafterConfig, comm: Comm, device=None, dtype=None):
        super().__init__()
        h, hd = dc.hidden, dc.head_dim
        self.dc = dc
        self.attn_norm = RMSNorm(h, dc.norm_eps, device, dtype)
        self.wq = ColumnParallelLinear(h, dc.n_heads * hd, comm, device, dtype)
        self.wk = ColumnParallelLinear(h, dc.n_kv_heads * hd, comm, device, dtype)
        self.wv = ColumnParallelLinear(h, dc.n_kv_heads * hd, comm, device, dtype)
        self.q_norm = RMSNorm(hd, dc.norm_eps, device, dtype)
        self.k_norm = RMSNorm(hd, dc.norm_eps, device, dtype)
        self.wo = RowParallelLinear(dc.n_heads * hd, h, comm, device, dtype)
        self.mlp_norm = RMSNorm(h, dc.norm_eps, device, dtype)
        self.w13 = ColumnParallelLinear(h, 2 * dc.inter, comm, device, dtype)   # gate | up, each split
        self.w2 = RowParallelLinear(dc.inter, h, comm, device, dtype)

    def kv(self, x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor):
        """x `[N, T, H]` (normed) -> roped k, v `[N, T, kv_local, hd]`."""
        n, t, _ = x.shape
        k = self.k_norm(self.wk(x).view(n, t, -1, self.dc.head_dim))
        v = self.wv(x).view(n, t, -1, self.dc.head_dim)
        return rope(k, positions, freqs), v

    def attn(self, x, positions, freqs, ctx_k, ctx_v, ctx_mask):
        """Attention branch: x `[N, B, H]`; ctx_k/v `[N, S, kv_local, hd]`; ctx_mask bool
        `[N, S]` -> `[N, B, H]` (summed over ranks)."""
        n, b, _ = x.shape
        hd, hkv = self.dc.head_dim, self.dc.n_local_kv_heads
        g = self.dc.n_local_heads // hkv                                        # queries per KV head
        xn = self.attn_norm(x)
        q = rope(self.q_norm(self.wq(xn).view(n, b, -1, hd)), positions, freqs)   # [N, B, hq, hd]
        k_blk, v_blk = self.kv(xn, positions, freqs)                            # [N, B, hkv, hd]
        k = torch.cat([ctx_k, k_blk], 1).transpose(1, 2)                        # [N, hkv, S+B, hd]
        v = torch.cat([ctx_v, v_blk], 1).transpose(1, 2)                        # [N, hkv, S+B, hd]
        q = q.view(n, b, hkv, g, hd).permute(0, 2, 3, 1, 4).reshape(n, hkv, g * b, hd)  # [N, hkv, g*B, hd]
        mask = torch.cat([ctx_mask, ctx_mask.new_ones(n, b)], 1)                # [N, S+B]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.view(n, 1, 1, -1))   # [N, hkv, g*B, hd]
        o = o.view(n, hkv, g, b, hd).permute(0, 3, 1, 2, 4).reshape(n, b, -1)   # [N, B, hq*hd]
        return self.wo(o)

    def mlp(self, x):
        """SwiGLU branch `[N, B, H]` -> `[N, B, H]` (summed over ranks)."""
        gate, up = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)

    def forward(self, x, positions, freqs, ctx_k, ctx_v, ctx_mask):
        x = x + self.attn(x, positions, freqs, ctx_k, ctx_v, ctx_mask)
        return x + self.mlp(x)


class Drafter(nn.Module):
    """The DFlash drafter of one TP rank plus its per-stream context cache.

    `target` is the target `Transformer` (its `embed` and `logits` are shared, not copied).
    Call `alloc(n_streams, max_len)` before use.
    """

    def __init__(self, dc: DrafterConfig, target, comm: Comm, device=None, dtype=torch.bfloat16):
        super().__init__()
        if dc.tp != comm.tp:
            raise ConfigError(f"drafter tp={dc.tp} but comm tp={comm.tp}")
        self.dc, self.comm = dc, comm
        self.target = [target]            # a list keeps the target out of this module's parameters
        self.device, self.dtype = torch.device(device or "cpu"), dtype
        nl = len(dc.target_layers)
        self.fc = RowParallelLinear(nl * dc.hidden, dc.hidden, comm, device, dtype)
        self.ctx_norm = RMSNorm(dc.hidden, dc.norm_eps, device, dtype)
        self.layers = nn.ModuleList(DrafterLayer(dc, comm, device, dtype) for _ in range(dc.n_layers))
        self.norm = RMSNorm(dc.hidden, dc.norm_eps, device, dtype)
        inv = 1.0 / dc.rope_theta ** (torch.arange(0, dc.head_dim, 2, dtype=torch.float64) / dc.head_dim)
        self.register_buffer("freqs", inv.float().to(self.device), persistent=False)
        self.ctx_k = self.ctx_v = None

    @property
    def block(self) -> int:
        return self.dc.block

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.dc.target_layers

    def alloc(self, n_streams: int, max_len: int) -> None:
        """Context cache: k, v `[n_layers, N, max_len, kv_local, head_dim]`."""
        shape = (self.dc.n_layers, n_streams, max_len, self.dc.n_local_kv_heads, self.dc.head_dim)
        self.ctx_k = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.ctx_v = torch.zeros(shape, device=self.device, dtype=self.dtype)

    @torch.no_grad()
    def init_random(self, seed: int = 0) -> None:
        """Random-but-valid weights: N(0, 1/fan_in) projections (residual outputs scaled by
        1/sqrt(2 n_layers)), unit norms; keeps activations O(1) through the layers."""
        gen = torch.Generator(device=self.device).manual_seed(seed + 7919 * (self.dc.tp * 64 + self.comm.rank))
        out_scale = 1.0 / math.sqrt(2 * self.dc.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            fan_in = p.shape[1] * (self.dc.tp if name.endswith(("wo.weight", "w2.weight", "fc.weight")) else 1)
            std = fan_in ** -0.5 * (out_scale if name.endswith(("wo.weight", "w2.weight")) else 1.0)
            p.copy_(torch.randn(p.shape, generator=gen, device=self.device, dtype=torch.float32) * std)

    def weight_bytes(self) -> int:
        """Bytes of this rank's drafter weights (the embedding and lm_head are the target's)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def _ctx_mask(self, ctx_len: torch.Tensor) -> torch.Tensor:
        s = self.ctx_k.shape[2]
        return torch.arange(s, device=self.device).view(1, s) < ctx_len.view(-1, 1)   # [N, S]

    @torch.no_grad()
    def update(self, hiddens: torch.Tensor, start: torch.Tensor) -> None:
        """Extend the context: hiddens `[N, A, n_target_layers, H]` of tokens at positions
        start[b] + i (i < A) -> context keys/values at those cache positions, every layer.
        Rows past a stream's true count are written too (beyond its context length they
        are masked out and later overwritten), so no count is needed and nothing syncs."""
        n, a, nl, h = hiddens.shape
        piece = nl * h // self.dc.tp                                            # this rank's fc input slice
        x = hiddens.reshape(n, a, nl * h)[..., self.comm.rank * piece:(self.comm.rank + 1) * piece]
        c = self.ctx_norm(self.fc(x.to(self.dtype)))                             # [N, A, H]
        pos = start.long().view(n, 1) + torch.arange(a, device=self.device)       # [N, A]
        rows = torch.arange(n, device=self.device).view(n, 1).expand(n, a)         # [N, A]
        for i, layer in enumerate(self.layers):
            k, v = layer.kv(c, pos, self.freqs)                                    # [N, A, hkv, hd]
            self.ctx_k[i].index_put_((rows, pos), k)
            self.ctx_v[i].index_put_((rows, pos), v)

    @torch.no_grad()
    def forward(self, bonus: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Draft one block per stream: bonus `[N]` at position start[b] (= the stream's
        context length) -> fp32 logits `[N, B-1, vocab]` for positions start+1 .. start+B-1."""
        n, b = bonus.shape[0], self.dc.block
        target = self.target[0]
        tokens = torch.full((n, b), self.dc.mask_token, dtype=torch.long, device=self.device)
        tokens[:, 0] = bonus
        pos = start.long().view(n, 1) + torch.arange(b, device=self.device)       # [N, B]
        x = target.embed(tokens).to(self.dtype)                                   # [N, B, H]
        mask = self._ctx_mask(start)
        for i, layer in enumerate(self.layers):
            x = layer(x, pos, self.freqs, self.ctx_k[i], self.ctx_v[i], mask)
        with phase("lm_head"):  # the drafter's own norm, then the shared lm_head (not the target's norm)
            return target.head(self.norm(x[:, 1:]))                               # [N, B-1, vocab]
