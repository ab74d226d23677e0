"""Assembling the engine: backends, the target model (random or a checkpoint), the drafter,
the memory check and the record of which kernels run. The commands (`ddbench decode`,
`ddbench e2e`) call these; nothing here knows about the command line.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ddbench.engine.config import ConfigError
from ddbench.kernels.select import KernelChoice, resolve


def pick_backends(device: torch.device, moe: str, attn: str) -> tuple[str, str]:
    """'auto' -> triton on GPU (the kernels need one), else the torch reference."""
    if moe == "auto":
        moe = "triton" if device.type == "cuda" else "torch"
    if attn == "auto":
        attn = "triton" if device.type == "cuda" else "torch"
    for what, v in (("--moe-backend", moe), ("--attn-backend", attn)):
        if v not in ("torch", "triton"):
            raise ConfigError(f"{what} {v!r}: choose auto, torch or triton")
    return moe, attn


def build_model(cfg, comm, checkpoint: Path | None, moe: str, attn: str, seed: int, device, init: str,
                kernels: KernelChoice | None = None):
    """The Transformer on `device` under the kernel choice `kernels`, from a checkpoint or
    random weights -> (model, init used)."""
    from ddbench.engine import checkpoint as ck
    from ddbench.engine.model import Transformer
    from ddbench.engine.weights import init_random

    model = Transformer(cfg, comm, moe_backend=moe, attn_backend=attn, device=device, kernels=kernels)
    if checkpoint is not None:
        ck.load_into(model, checkpoint)
        return model, "checkpoint"
    return model, init_random(model, seed, init)


def build_engine(cfg, comm, checkpoint, moe: str, attn: str, seed: int, device, init: str,
                 kernels: KernelChoice | None = None):
    """Target (checkpoint or random) and a random drafter of the same TP shard ->
    (model, drafter, init used)."""
    from ddbench.engine.drafter import Drafter, drafter_config

    model, used = build_model(cfg, comm, checkpoint, moe, attn, seed, device, init, kernels)
    drafter = Drafter(drafter_config(cfg), model, comm, device=device, dtype=model.dtype)
    drafter.init_random(seed)
    return model, drafter, used


def model_bytes(cfg, n_streams: int, max_len: int) -> int:
    """Bytes of one rank's weights and a KV cache of `n_streams` x `max_len` tokens."""
    from ddbench.engine.model import Transformer
    from ddbench.engine.parallel import SimComm

    comm = SimComm(cfg.tp, cfg.rank, lambda n: 0.0)
    meta = Transformer(cfg, comm, device="meta", fused="torch")
    need = sum(t.numel() * t.element_size() for t in meta.state_dict().values())
    return need + n_streams * max_len * cfg.kv_values_per_token * 2


def free_bytes(device: torch.device) -> int | None:
    """Free memory of `device` (GPU memory, or the host's available memory), None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return None


def check_fits(cfg, device: torch.device, n_streams: int, max_len: int) -> int:
    """Bytes of the rank's weights + KV cache; ConfigError if they cannot fit on `device`."""
    need = model_bytes(cfg, n_streams, max_len)
    free = free_bytes(device)
    if free is not None and need > 0.95 * free:
        hint = "try --tp 8 --simulate-rank 0" if cfg.tp == 1 else "try --preset tiny or a larger device"
        raise ConfigError(f"{cfg.name} tp={cfg.tp} rank {cfg.rank} needs {need / 1e9:.1f} GB of weights and KV "
                          f"cache but {device} has {free / 1e9:.1f} GB free ({hint})")
    return need


def kernel_record(model, tokens: list[int]) -> dict:
    """The model's kernel choice resolved on its device (`kernels.select.resolve`), with the
    routed experts' kernel and tiles at each MoE call size in `tokens` (tokens a forward)."""
    from ddbench.kernels.moe import resolve_moe_kernel

    out = resolve(model.kernels, model.device)
    moes = list(model.moe_blocks().values())
    if moes and model.moe_backend == "triton":
        w = moes[0].experts()
        out["moe_calls"] = {}
        for t in sorted(set(tokens)):
            name, tiles = resolve_moe_kernel(t, model.cfg.top_k, w, model.device, model.kernels.moe, dtype=model.dtype)
            out["moe_calls"][str(t)] = {"kernel": name, "tiles": tiles}
    elif moes:
        out["moe"] = "torch (reference backend)"
    return out
