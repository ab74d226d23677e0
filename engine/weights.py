"""Weights: random-but-valid initialisation and TP sharding, in one place.

Every tensor is named as in Hugging Face's DeepSeek-V3 checkpoints (see
`Transformer.hf_weights`); the routed experts as compressed-tensors INT4
(`model.layers.L.mlp.experts.E.{gate,up,down}_proj.*`, DESIGN §3).

Sharding (`shard`) takes the full tensor (or a lazy slice of it) and the split dim and
returns rank r's piece: heads for q_b/kv_b/o_proj, the intermediate dim for dense and
shared MLPs, vocab rows for the embedding and lm_head, each routed expert's
intermediate dim (gate/up rows, down columns); everything else is replicated.

Random init, two modes that draw from the same distributions:

- "exact": each full tensor is drawn on the CPU from a generator seeded by (seed,
  tensor name) and then sharded, so every TP degree and rank sees the same model (TP=2
  equals TP=1) and `engine.checkpoint.write_checkpoint` writes exactly these tensors.
- "shard": only the rank's shard is drawn, directly on the model's device, from a
  generator seeded by (seed, name, rank) (replicated tensors: by (seed, name), so every
  rank holds the same copy). This is how a K2.6 TP-8 rank shard (~76 GB:
  71 GB INT4 experts, 5 GB bf16) initialises in seconds on one GPU.
  "auto" picks "exact" when the full routed experts are under 1 GB, else "shard".

Scales (why logits stay finite and O(1) through 61 layers):

- the embedding is N(0, 1), so the residual stream starts at unit RMS;
- every RMSNorm weight is 1 +- 5% (uniform), so each block's input has unit RMS;
- every linear has std gain/sqrt(fan_in) (fan_in = the full input dim), which keeps a
  unit-variance input at unit variance (gain 1), except the projections that write into
  the residual stream (o_proj, dense/shared down_proj, routed down_proj), whose gain is
  1/sqrt(2 * n_layers): each of the 2 * n_layers branches then adds about 1/(2 n_layers)
  of unit variance, so the residual RMS ends near 1.5 at any depth instead of growing
  with it (measured on `tiny` with 61 layers, both modes, two seeds: 1.0 after block 0,
  1.4-1.5 after block 60, logits std 1.0; tests/test_engine.py checks it);
- routed experts: INT4 values uniform in -7..7 (zero mean, see `kernels.quant.random_int4`) with
  group-32 bf16 scales for the same std; the router's renormalised top-k weights
  sum to routed_scaling (2.827), whose squares sum to about 1, so the routed sum has
  about one expert's variance; the router gate (std 1/sqrt(H)) gives unit-variance gate
  logits and the selection bias is N(0, 0.05^2), so routing is spread over all experts;
- lm_head has std 1/sqrt(H): logits have unit std after the final norm.
"""
from __future__ import annotations

import math
import zlib

import torch

from ddbench.engine.config import ModelConfig
from ddbench.kernels import marlin, quant

EXPERT_CHUNK = 16          # experts per generator seed in "exact" mode (also the writer)
SHARD_EXPERT_CHUNK = 64    # experts per step in "shard" mode (bounds temporary memory)
PROJ_NAMES = ("gate_proj", "up_proj", "down_proj")


def seed_of(seed: int, *parts) -> int:
    """A stable 63-bit seed from the run seed and a tensor's identity."""
    return (zlib.crc32("/".join(map(str, parts)).encode()) * 1_000_003 + seed) % (2**63)


def residual_gain(cfg: ModelConfig) -> float:
    return 1.0 / math.sqrt(2 * cfg.n_layers)


def draw(cfg: ModelConfig, name: str, shape, fan_in: int, generator, device=None,
         dtype=torch.bfloat16) -> torch.Tensor:
    """One random dense tensor by its HF name (see module docstring for the scales)."""
    if name.endswith("norm.weight"):
        return (1 + 0.1 * (torch.rand(shape, generator=generator, device=device) - 0.5)).to(dtype)
    if name.endswith("e_score_correction_bias"):
        return 0.05 * torch.randn(shape, generator=generator, device=device)      # fp32, as checkpoints
    if name == "model.embed_tokens.weight":
        std = 1.0
    elif name.endswith(("o_proj.weight", "down_proj.weight")):
        std = residual_gain(cfg) / math.sqrt(fan_in)
    else:
        std = 1.0 / math.sqrt(fan_in)
    return (std * torch.randn(shape, generator=generator, device=device)).to(dtype)


def full_shape(local: torch.Size, split: int | None, tp: int) -> tuple[int, ...]:
    shape = list(local)
    if split is not None:
        shape[split] *= tp
    return tuple(shape)


def random_full(cfg: ModelConfig, name: str, shape, seed: int) -> torch.Tensor:
    """The full (unsharded) random tensor `name` on the CPU, as a checkpoint stores it."""
    g = torch.Generator().manual_seed(seed_of(seed, name))
    fan_in = shape[1] if len(shape) == 2 else shape[0]
    return draw(cfg, name, shape, fan_in, g)


def shard(t, split: int | None, tp: int, rank: int):
    """Rank `rank`'s piece of full tensor (or safetensors slice) `t` along `split`."""
    if split is None or tp == 1:
        return t[:] if not isinstance(t, torch.Tensor) else t
    n = t.get_shape()[split] if not isinstance(t, torch.Tensor) else t.shape[split]
    size = n // tp
    lo, hi = rank * size, (rank + 1) * size
    return t[lo:hi] if split == 0 else t[:, lo:hi]


# ---- routed experts -----------------------------------------------------------------

def expert_chunks(cfg: ModelConfig, size: int = EXPERT_CHUNK) -> list[range]:
    return [range(e, min(e + size, cfg.n_experts)) for e in range(0, cfg.n_experts, size)]


# std of a uniform draw from the symmetric signed int4 values -7..7
def random_experts_full(cfg: ModelConfig, layer: int, experts: range, seed: int) -> dict:
    """Full logical experts `experts` of `layer` on the CPU: name -> (q uint8 `[e, out, in]`,
    scale bf16 `[e, out, in/g]`), seeded per (seed, layer, chunk start)."""
    g = torch.Generator().manual_seed(seed_of(seed, "experts", layer, experts.start))
    e, h, i = len(experts), cfg.hidden, cfg.moe_inter
    shapes = {"gate_proj": ((e, i, h), 1.0), "up_proj": ((e, i, h), 1.0),
              "down_proj": ((e, h, i), residual_gain(cfg))}
    return {n: quant.random_int4(s, cfg.group_size, gain=gain, generator=g) for n, (s, gain) in shapes.items()}


def random_experts_shard(cfg: ModelConfig, layer: int, experts: range, seed: int, device) -> dict:
    """Rank-local logical experts drawn directly on `device` (same distribution as full)."""
    g = torch.Generator(device=device).manual_seed(seed_of(seed, "experts", layer, experts.start, cfg.rank))
    e, h, i = len(experts), cfg.hidden, cfg.moe_inter_local
    shapes = {"gate_proj": ((e, i, h), h, 1.0), "up_proj": ((e, i, h), h, 1.0),
              "down_proj": ((e, h, i), cfg.moe_inter, residual_gain(cfg))}
    return {n: quant.random_int4(s, cfg.group_size, fan_in, gain, generator=g, device=device)
            for n, (s, fan_in, gain) in shapes.items()}


def shard_experts(cfg: ModelConfig, logical: dict) -> dict:
    """Full logical experts -> rank's piece: gate/up rows and down columns of I/tp."""
    i0, i1 = cfg.rank * cfg.moe_inter_local, (cfg.rank + 1) * cfg.moe_inter_local
    g0, g1 = i0 // cfg.group_size, i1 // cfg.group_size
    (qg, sg), (qu, su), (qd, sd) = (logical[n] for n in PROJ_NAMES)
    return {"gate_proj": (qg[:, i0:i1], sg[:, i0:i1]), "up_proj": (qu[:, i0:i1], su[:, i0:i1]),
            "down_proj": (qd[:, :, i0:i1], sd[:, :, g0:g1])}


def to_marlin(cfg: ModelConfig, local: dict) -> dict:
    """Rank-local logical experts -> Marlin tensors (w13 = gate rows then up rows)."""
    (qg, sg), (qu, su), (qd, sd) = (local[n] for n in PROJ_NAMES)
    w13, w13_scale = marlin.from_checkpoint(torch.cat([qg, qu], dim=-2), torch.cat([sg, su], dim=-2),
                                            cfg.group_size)                   # q [e, 2I, H] -> [e, H/16, 4I]
    w2, w2_scale = marlin.from_checkpoint(qd, sd, cfg.group_size)              # q [e, H, I] -> [e, I/16, 2H]
    return {"w13": w13, "w13_scale": w13_scale, "w2": w2, "w2_scale": w2_scale}


def set_experts(moe, experts: range, packed: dict) -> None:
    """Copy Marlin tensors of `experts` into an MoE module's buffers."""
    for k, v in packed.items():
        getattr(moe, k)[experts.start:experts.stop].copy_(v)


# ---- whole model --------------------------------------------------------------------

def routed_bytes_full(cfg: ModelConfig) -> int:
    """Bytes of all routed experts' INT4 values (full model, no scales)."""
    return len(cfg.moe_layers) * cfg.n_experts * 3 * cfg.hidden * cfg.moe_inter // 2


@torch.no_grad()
def init_random(model, seed: int = 0, mode: str = "auto") -> str:
    """Fill every tensor of `model` (a `Transformer`) with random-but-valid values.

    Returns the mode used ("exact" or "shard"; see the module docstring).
    """
    cfg = model.cfg
    if mode == "auto":
        mode = "exact" if routed_bytes_full(cfg) < 2**30 else "shard"
    if mode not in ("exact", "shard"):
        raise ValueError(f"unknown init mode {mode!r}")
    dev = model.device
    for name, (param, split) in model.hf_weights().items():
        shape = full_shape(param.shape, split, cfg.tp)
        if mode == "exact":
            param.copy_(shard(random_full(cfg, name, shape, seed), split, cfg.tp, cfg.rank))
        else:
            # replicated tensors (split None) get the same draw on every rank
            who = -1 if split is None else cfg.rank
            g = torch.Generator(device=dev).manual_seed(seed_of(seed, name, "shard", who))
            fan_in = shape[1] if len(shape) == 2 else shape[0]
            param.copy_(draw(cfg, name, param.shape, fan_in, g, device=dev, dtype=param.dtype))
    for layer, moe in model.moe_blocks().items():
        if mode == "exact":
            for experts in expert_chunks(cfg):
                local = shard_experts(cfg, random_experts_full(cfg, layer, experts, seed))
                set_experts(moe, experts, to_marlin(cfg, local))
        else:
            for experts in expert_chunks(cfg, SHARD_EXPERT_CHUNK):
                set_experts(moe, experts, to_marlin(cfg, random_experts_shard(cfg, layer, experts, seed, dev)))
    return mode
