"""`ddbench pack`: random-but-valid K2.6-shaped INT4 expert weights, repacked to Marlin.

Per MoE layer: logical int4 nibbles + group scales for every expert's gate/up/down
(full experts, as a checkpoint holds them) -> compressed-tensors tensors with K2.6's
names -> the rank's Marlin shard (`kernels.marlin.repack_moe`). Experts are processed in
chunks so a whole K2.6 layer fits in a CPU's memory.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch
from rich.progress import Progress

from ddbench import UserError
from ddbench.results import atomic_write_text, ensure_out_dir, run_metadata, timestamp
from ddbench.timing import pick_device
from ddbench.engine.config import ModelConfig, parse_overrides, preset as make_preset
from ddbench.engine.weights import residual_gain
from ddbench.kernels import ctensors, marlin, quant

EXPERT_CHUNK = 16


def parse_layers(text: str, cfg: ModelConfig) -> list[int]:
    from ddbench.args import parse_int_list

    layers = list(cfg.moe_layers) if text == "all" else parse_int_list(text, "--layers")
    bad = [x for x in layers if x not in cfg.moe_layers]
    if bad:
        raise UserError(f"--layers {bad} are not MoE layers of this preset "
                        f"({cfg.moe_layers.start}..{cfg.moe_layers.stop - 1})")
    return layers


def random_experts(cfg: ModelConfig, layer: int, experts: range, seed: int, device) -> dict:
    """Full (unsharded) logical experts for `experts` of `layer`: q uint8 and bf16 scales.

    Each linear's scales give its dequantized weight std 1/sqrt(fan_in) (see
    `kernels.quant.random_int4`); down_proj writes into the residual stream and takes the
    engine's residual gain (`engine.weights.residual_gain`). Reproducible per (seed, layer,
    expert chunk) on one kind of device.
    """
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + layer * 4099 + experts.start)
    e, h, i = len(experts), cfg.hidden, cfg.moe_inter
    out = {}
    for name, shape, gain in [("gate_proj", (e, i, h), 1.0), ("up_proj", (e, i, h), 1.0),
                              ("down_proj", (e, h, i), residual_gain(cfg))]:
        out[name] = quant.random_int4(shape, cfg.group_size, gain=gain, generator=g, device=device)
    return out


def checkpoint_tensors(layer: int, experts: range, logical: dict) -> dict[str, torch.Tensor]:
    """K2.6 compressed-tensors names for one chunk of experts."""
    out = {}
    for name, (q, s) in logical.items():
        for j, e in enumerate(experts):
            for key, t in ctensors.to_checkpoint(q[j], s[j]).items():
                out[f"model.layers.{layer}.mlp.experts.{e}.{name}.{key}"] = t
    return out


def stacked_checkpoint(logical: dict) -> dict[str, dict]:
    """Checkpoint dicts with a leading expert dim, as `marlin.repack_moe` takes them."""
    return {name: {"weight_packed": ctensors.pack_nibbles(q), "weight_scale": s}
            for name, (q, s) in logical.items()}


def verify_chunk(cfg: ModelConfig, logical: dict, packed: dict) -> None:
    """Unpack the Marlin shard and compare with the logical weights, bit for bit."""
    i0, i1 = cfg.rank * cfg.moe_inter_local, (cfg.rank + 1) * cfg.moe_inter_local
    g0, g1 = i0 // cfg.group_size, i1 // cfg.group_size
    qg, sg = logical["gate_proj"]
    qu, su = logical["up_proj"]
    qd, sd = logical["down_proj"]
    want13 = torch.cat([qg[:, i0:i1], qu[:, i0:i1]], 1).transpose(1, 2)
    want13_s = torch.cat([sg[:, i0:i1], su[:, i0:i1]], 1).transpose(1, 2)
    checks = [
        ("w13", marlin.unpack(packed["w13"], cfg.hidden, 2 * cfg.moe_inter_local), want13),
        ("w13_scale", marlin.unpermute_scales(packed["w13_scale"], cfg.group_size), want13_s),
        ("w2", marlin.unpack(packed["w2"], cfg.moe_inter_local, cfg.hidden), qd[:, :, i0:i1].transpose(1, 2)),
        ("w2_scale", marlin.unpermute_scales(packed["w2_scale"], cfg.group_size), sd[:, :, g0:g1].transpose(1, 2)),
    ]
    for name, got, want in checks:
        if not torch.equal(got, want.to(got.dtype)):
            raise RuntimeError(f"verify failed: {name} does not round-trip")


def checksum(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def run(*, preset: str | None, tp: int, rank: int, layers: str, group_size: int | None, device: str,
        verify: bool, save_checkpoint: bool, seed: int, out: Path, override: list[str] | None,
        hf_dir: Path | None = None) -> Path:
    fields = parse_overrides(override)
    if group_size is not None:
        fields["group_size"] = group_size
    dev = pick_device(device)
    note = None
    if preset is None:
        preset = "k2.6" if dev.type == "cuda" else "tiny"
        if dev.type != "cuda":
            note = "note: no GPU, so the tiny preset (pass --preset k2.6 for the full model: minutes per layer)"
    cfg = make_preset(preset, tp=tp, rank=rank, **fields)
    cfg.check_marlin()
    if hf_dir is not None:
        if note:
            print(note)
        return write_hf_dir(cfg, Path(hf_dir), seed)
    if (cfg.moe_inter_local * rank) % cfg.group_size:
        raise UserError(f"rank shard start {cfg.moe_inter_local * rank} breaks group size {cfg.group_size}")
    layer_ids = parse_layers(layers, cfg)
    out_dir = ensure_out_dir(out) / f"pack_{cfg.name}_tp{tp}_r{rank}_{timestamp()}"
    if note:
        print(note)
    out_dir.mkdir()
    manifest = run_metadata("pack", preset=cfg.name, tp=tp, rank=rank, seed=seed, device=str(dev),
                            group_size=cfg.group_size, config=cfg.to_dict(), layers={},
                            layers_planned=layer_ids, completed=False)
    # the manifest exists from the start and lists each layer once its files are complete,
    # so a run stopped by any signal (even kill -9) leaves an honest record of what it wrote
    atomic_write_text(out_dir / "manifest.json", json.dumps(manifest, indent=2, default=str) + "\n")
    try:
        _pack_layers(cfg, layer_ids, dev, tp, rank, seed, verify, save_checkpoint, out_dir, manifest)
    except BaseException as e:
        for tmp in out_dir.glob("*.partial"):
            tmp.unlink()
        manifest["error"] = f"{type(e).__name__}: {e}"
        atomic_write_text(out_dir / "manifest.json", json.dumps(manifest, indent=2, default=str) + "\n")
        print(f"stopped: {out_dir} holds {len(manifest['layers'])} of {len(layer_ids)} layer(s) "
              "(manifest.json: completed false)")
        raise
    manifest["completed"] = True
    atomic_write_text(out_dir / "manifest.json", json.dumps(manifest, indent=2, default=str) + "\n")
    total = sum(t["bytes"] for L in manifest["layers"].values() for t in L["tensors"].values())
    pack_s = sum(L["pack_s"] for L in manifest["layers"].values())
    print(f"wrote {out_dir} ({len(layer_ids)} layer(s), {total / 1e9:.2f} GB Marlin; "
          f"pack {pack_s:.2f} s on {dev}{'; verified bit-exact' if verify else ''})")
    return out_dir


def _pack_layers(cfg: ModelConfig, layer_ids: list[int], dev, tp: int, rank: int, seed: int, verify: bool,
                 save_checkpoint: bool, out_dir: Path, manifest: dict) -> None:
    from safetensors.torch import save_file

    chunks = [range(e, min(e + EXPERT_CHUNK, cfg.n_experts)) for e in range(0, cfg.n_experts, EXPERT_CHUNK)]
    with Progress() as progress:
        task = progress.add_task("packing", total=len(layer_ids) * len(chunks))
        for layer in layer_ids:
            progress.update(task, description=f"layer {layer}")
            tensors, ckpt, t_gen, t_pack, t_verify = {}, {}, 0.0, 0.0, 0.0
            prefix = f"model.layers.{layer}.mlp.experts"
            for experts in chunks:
                t0 = time.perf_counter()
                logical = random_experts(cfg, layer, experts, seed, dev)
                _sync(dev)
                t1 = time.perf_counter()
                packed = marlin.repack_moe(*stacked_checkpoint(logical).values(), tp=tp, rank=rank,
                                           group_size=cfg.group_size)
                _sync(dev)
                t2 = time.perf_counter()
                if verify:
                    verify_chunk(cfg, logical, packed)
                    _sync(dev)
                t_gen, t_pack, t_verify = t_gen + t1 - t0, t_pack + t2 - t1, t_verify + time.perf_counter() - t2
                if save_checkpoint:
                    ckpt.update({k: v.cpu() for k, v in checkpoint_tensors(layer, experts, logical).items()})
                for k, v in packed.items():  # one preallocated host tensor per name, filled chunk by chunk
                    if f"{prefix}.{k}" not in tensors:
                        tensors[f"{prefix}.{k}"] = torch.empty((cfg.n_experts, *v.shape[1:]), dtype=v.dtype)
                    tensors[f"{prefix}.{k}"][experts.start:experts.stop] = v.cpu()
                progress.advance(task)
            t0 = time.perf_counter()
            _save_atomic(save_file, tensors, out_dir / f"layer{layer:02d}.marlin.safetensors")
            if save_checkpoint:
                _save_atomic(save_file, ckpt, out_dir / f"layer{layer:02d}.checkpoint.safetensors")
            manifest["layers"][str(layer)] = {
                "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", ""),
                                "bytes": v.numel() * v.element_size(), "sha256_16": checksum(v)}
                            for k, v in tensors.items()},
                "generate_s": round(t_gen, 3), "pack_s": round(t_pack, 3),
                "verify_s": round(t_verify, 3) if verify else None, "verified": verify,
                "write_s": round(time.perf_counter() - t0, 3),
            }
            atomic_write_text(out_dir / "manifest.json", json.dumps(manifest, indent=2, default=str) + "\n")


def write_hf_dir(cfg: ModelConfig, hf_dir: Path, seed: int) -> Path:
    """The whole random model (engine.weights, "exact" mode) as a Hugging Face checkpoint."""
    from ddbench.engine.checkpoint import write_checkpoint
    from ddbench.engine.weights import routed_bytes_full

    if hf_dir.exists() and any(hf_dir.iterdir()):
        raise UserError(f"--hf-dir {hf_dir} exists and is not empty")
    gb = routed_bytes_full(cfg) / 1e9
    if gb > 20:
        print(f"note: {cfg.name} has {gb:.0f} GB of routed experts; writing takes long")
    with Progress() as progress:
        task = progress.add_task(f"writing {hf_dir}", total=cfg.n_layers)
        write_checkpoint(cfg, hf_dir, seed, progress=lambda: progress.advance(task))
    print(f"wrote {hf_dir} (Hugging Face layout, {cfg.name}, seed {seed})")
    return hf_dir


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _save_atomic(save_file, tensors: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".partial")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    tmp.replace(path)
