"""K2.6 checkpoints in Hugging Face layout: read (sharded for one TP rank) and write.

A checkpoint directory holds `config.json` (DeepSeek-V3 fields, flat or nested under
`text_config`; YaRN under `rope_scaling` or `rope_parameters`),
`model.safetensors.index.json` (`weight_map`: tensor name -> shard file) and the shards.
Tensor names are Hugging Face DeepSeek-V3's; routed experts are compressed-tensors
`pack-quantized` INT4 (`weight_packed` int32, `weight_scale` bf16, `weight_shape`),
everything else bf16 (the router's `e_score_correction_bias` fp32 or bf16).

`load_checkpoint` reads only rank r's slice of every tensor (safetensors lazy slices),
checks each tensor's name, shape, dtype (and `weight_shape`) against the config first,
and raises `ConfigError` naming the first bad tensor. `write_checkpoint` writes the
random weights of `engine.weights` ("exact" mode) for any preset in this layout, so the
loader is tested on small checkpoints of the exact format.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ddbench.engine.config import ConfigError, ModelConfig, preset as make_preset, with_overrides
from ddbench.engine import weights as W
from ddbench.kernels import ctensors

INDEX = "model.safetensors.index.json"

# config.json field -> ModelConfig field
HF_FIELDS = {
    "hidden_size": "hidden", "num_hidden_layers": "n_layers", "first_k_dense_replace": "n_dense_layers",
    "intermediate_size": "dense_inter", "vocab_size": "vocab", "rms_norm_eps": "norm_eps",
    "num_attention_heads": "n_heads", "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_dim", "qk_rope_head_dim": "qk_rope_dim", "v_head_dim": "v_head_dim",
    "n_routed_experts": "n_experts", "num_experts_per_tok": "top_k", "n_shared_experts": "n_shared_experts",
    "moe_intermediate_size": "moe_inter", "routed_scaling_factor": "routed_scaling", "n_group": "n_group",
    "topk_group": "topk_group",
}
HF_ROPE = {"factor": "rope_factor", "original_max_position_embeddings": "rope_original_max_pos",
           "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow", "mscale": "rope_mscale",
           "mscale_all_dim": "rope_mscale_all_dim"}
SAFETENSORS_DTYPE = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                     "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8, "I8": torch.int8}


# ---- config -------------------------------------------------------------------------

def config_from_hf(hf: dict, tp: int = 1, rank: int = 0, name: str = "checkpoint") -> ModelConfig:
    """A DeepSeek-V3-style config.json dict -> ModelConfig for rank `rank` of `tp`."""
    text = hf.get("text_config", hf)
    fields = {"name": name, "tp": tp, "rank": rank}
    for key, field in HF_FIELDS.items():
        if key not in text:
            raise ConfigError(f"config.json: missing field {key!r}")
        fields[field] = text[key]
    if text["q_lora_rank"] is None:
        raise ConfigError("config.json: q_lora_rank is null (no q LoRA); K2.6 layout expected")
    if text.get("tie_word_embeddings", False):
        raise ConfigError("config.json: tie_word_embeddings is true; K2.6 has an untied lm_head")
    if text.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"config.json: scoring_func {text['scoring_func']!r}; only sigmoid is supported")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = rope.get("rope_theta", text.get("rope_theta"))
    if theta is None:
        raise ConfigError("config.json: missing field 'rope_theta'")
    fields["rope_theta"] = theta
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "yarn":
        for key, field in HF_ROPE.items():
            if key in rope:
                fields[field] = rope[key]
    elif kind == "default":
        fields["rope_factor"] = 1.0
    else:
        raise ConfigError(f"config.json: rope type {kind!r}; only yarn or default are supported")
    quant = hf.get("quantization_config") or text.get("quantization_config") or {}
    for group in (quant.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        if w.get("num_bits", 4) != 4:
            raise ConfigError(f"config.json: {w['num_bits']}-bit experts; only INT4 is supported")
        if "group_size" in w:
            fields["group_size"] = w["group_size"]
    try:
        return with_overrides(make_preset("k2.6"), **fields)
    except TypeError as e:
        raise ConfigError(f"config.json: {e}") from None


def config_to_hf(cfg: ModelConfig) -> dict:
    """ModelConfig -> a DeepSeek-V3 config.json dict (compressed-tensors INT4 experts)."""
    out = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
           "torch_dtype": "bfloat16", "tie_word_embeddings": False, "scoring_func": "sigmoid",
           "topk_method": "noaux_tc", "norm_topk_prob": True, "moe_layer_freq": 1,
           "hidden_act": "silu", "max_position_embeddings": int(cfg.rope_original_max_pos * cfg.rope_factor)}
    out.update({key: getattr(cfg, field) for key, field in HF_FIELDS.items()})
    out["rope_theta"] = cfg.rope_theta
    out["rope_scaling"] = {"type": "yarn", **{key: getattr(cfg, f) for key, f in HF_ROPE.items()}}
    out["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": cfg.group_size, "dynamic": False}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
    }
    return out


def read_config(path: Path, tp: int = 1, rank: int = 0) -> ModelConfig:
    path = Path(path)
    f = path / "config.json"
    if not f.is_file():
        raise ConfigError(f"{path}: no config.json (not a checkpoint directory)")
    try:
        hf = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f}: not valid JSON ({e})") from None
    return config_from_hf(hf, tp, rank, name=f"hf-{path.name}")


# ---- expected tensors ---------------------------------------------------------------

def expert_names(layer: int, e: int, proj: str) -> dict[str, str]:
    p = f"model.layers.{layer}.mlp.experts.{e}.{proj}."
    return {k: p + k for k in ("weight_packed", "weight_scale", "weight_shape")}


def expert_shape(cfg: ModelConfig, proj: str) -> tuple[int, int]:
    """(out, in) of one full routed expert linear."""
    return (cfg.hidden, cfg.moe_inter) if proj == "down_proj" else (cfg.moe_inter, cfg.hidden)


class Reader:
    """Lazy access to a checkpoint's tensors through its index, with checks."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = Path(path)
        idx = self.path / INDEX
        if not idx.is_file():
            raise ConfigError(f"{self.path}: no {INDEX}")
        try:
            self.weight_map = json.loads(idx.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ConfigError(f"{idx}: not a safetensors index ({e})") from None
        # multimodal K2.x checkpoints prefix the text model (e.g. "language_model.")
        anchor = "model.embed_tokens.weight"
        found = [n for n in self.weight_map if n.endswith(anchor)]
        self.prefix = min(found, key=len)[:-len(anchor)] if found else ""
        self._open, self._files = safe_open, {}

    def slice(self, name: str):
        """The lazy safetensors slice of `name` (ConfigError if it is missing)."""
        fname = self.weight_map.get(self.prefix + name)
        if fname is None:
            raise ConfigError(f"checkpoint {self.path}: missing tensor {name}")
        if fname not in self._files:
            f = self.path / fname
            if not f.is_file():
                raise ConfigError(f"checkpoint {self.path}: tensor {name}: shard file {fname} is missing")
            try:
                self._files[fname] = self._open(str(f), framework="pt")
            except Exception as e:  # noqa: BLE001 - any unreadable shard is a bad checkpoint
                raise ConfigError(f"checkpoint {self.path}: tensor {name}: cannot read {fname} ({e})") from None
        try:
            return self._files[fname].get_slice(self.prefix + name)
        except Exception:  # noqa: BLE001 - index says it is there, file does not
            raise ConfigError(f"checkpoint {self.path}: missing tensor {name} (not in {fname})") from None

    def checked(self, name: str, shape, dtypes) -> object:
        """The slice of `name` after checking its full shape and dtype."""
        sl = self.slice(name)
        got = tuple(sl.get_shape())
        if got != tuple(shape):
            raise ConfigError(f"checkpoint tensor {name}: shape {list(got)}, config expects {list(shape)}")
        dt = SAFETENSORS_DTYPE.get(sl.get_dtype())
        if dt not in dtypes:
            want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
            raise ConfigError(f"checkpoint tensor {name}: dtype {sl.get_dtype()}, expected {want}")
        return sl


def dense_dtypes(name: str) -> tuple:
    if name.endswith("e_score_correction_bias"):
        return (torch.float32, torch.bfloat16)
    return (torch.bfloat16,)


# ---- load ---------------------------------------------------------------------------

@torch.no_grad()
def load_into(model, path: Path) -> None:
    """Fill `model` (a Transformer built for the checkpoint's config) with rank r's shard."""
    cfg = model.cfg
    rd = Reader(path)
    for name, (param, split) in model.hf_weights().items():
        shape = W.full_shape(param.shape, split, cfg.tp)
        sl = rd.checked(name, shape, dense_dtypes(name))
        param.copy_(W.shard(sl, split, cfg.tp, cfg.rank))
    i0, i1 = cfg.rank * cfg.moe_inter_local, (cfg.rank + 1) * cfg.moe_inter_local
    g = cfg.group_size
    for layer, moe in model.moe_blocks().items():
        for experts in W.expert_chunks(cfg):
            local = {proj: ([], []) for proj in W.PROJ_NAMES}
            for e in experts:
                for proj in W.PROJ_NAMES:
                    q, s = _read_expert(rd, cfg, layer, e, proj, i0, i1, g)
                    local[proj][0].append(q)
                    local[proj][1].append(s)
            dev = moe.w13.device  # repack on the model's device
            # q uint8 [e, I/tp, H] (gate, up) or [e, H, I/tp] (down); scale [e, rows, cols/g]
            stacked = {p: (torch.stack(q).to(dev), torch.stack(s).to(dev)) for p, (q, s) in local.items()}
            W.set_experts(moe, experts, W.to_marlin(cfg, stacked))


def _read_expert(rd: Reader, cfg: ModelConfig, layer: int, e: int, proj: str, i0: int, i1: int, g: int):
    """One expert linear's rank slice -> (q uint8 `[out, in]`, scale `[out, in/g]`)."""
    out_f, in_f = expert_shape(cfg, proj)
    names = expert_names(layer, e, proj)
    if in_f % 8 or in_f % g:
        raise ConfigError(f"checkpoint tensor {names['weight_packed']}: in={in_f} breaks packing/group {g}")
    packed = rd.checked(names["weight_packed"], (out_f, in_f // 8), (torch.int32,))
    scale = rd.checked(names["weight_scale"], (out_f, in_f // g), (torch.bfloat16,))
    wshape = rd.checked(names["weight_shape"], (2,), (torch.int64, torch.int32))[:]
    if wshape.tolist() != [out_f, in_f]:
        raise ConfigError(f"checkpoint tensor {names['weight_shape']}: {wshape.tolist()}, "
                          f"config expects {[out_f, in_f]}")
    if proj == "down_proj":   # input dim (I) split: whole words and whole groups
        q = ctensors.unpack_nibbles(packed[:, i0 // 8:i1 // 8])
        s = scale[:, i0 // g:i1 // g]
    else:                     # output dim (I) split
        q = ctensors.unpack_nibbles(packed[i0:i1])
        s = scale[i0:i1]
    return q, s


def load_checkpoint(path: Path, tp: int = 1, rank: int = 0, comm=None, device=None,
                    dtype=torch.bfloat16, **model_kw):
    """Build a Transformer from a checkpoint directory, sharded for rank `rank` of `tp`."""
    from ddbench.engine.model import Transformer

    cfg = read_config(path, tp, rank)
    model = Transformer(cfg, comm, device=device, dtype=dtype, **model_kw)
    load_into(model, path)
    return model


# ---- write --------------------------------------------------------------------------

FILE_EXPERTS = 64   # routed experts per shard file (a K2.6 layer's experts: 6 files of ~1.4 GB)


@torch.no_grad()
def write_checkpoint(cfg: ModelConfig, path: Path, seed: int = 0, progress=None) -> Path:
    """Write the full random model (engine.weights "exact" mode, seed `seed`) in HF layout.

    Shard files: one for the embedding, final norm and lm_head, one per layer for its
    dense tensors, and one per 64 routed experts of each MoE layer (so a K2.6 layer never
    sits whole in host memory). Each file is written under a temporary name and renamed;
    config.json and the index come last. `progress()` is called once per layer.
    """
    from safetensors.torch import save_file

    from ddbench.engine.model import Transformer

    full = cfg.shard(1, 0)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # the model on the meta device only lists names and shapes
    names = Transformer(full, device="meta", fused="torch").hf_weights()
    groups: dict[str, list] = {"top": []}
    for name, (t, _) in names.items():
        key = name.split(".")[2] if name.startswith("model.layers.") else "top"
        groups.setdefault(key, []).append((name, tuple(t.shape)))
    file_chunks = [range(e, min(e + FILE_EXPERTS, full.n_experts)) for e in range(0, full.n_experts, FILE_EXPERTS)]
    n_files = len(groups) + len(full.moe_layers) * len(file_chunks)
    weight_map: dict[str, str] = {}

    def save(tensors: dict) -> None:
        fname = f"model-{len(set(weight_map.values())) + 1:05d}-of-{n_files:05d}.safetensors"
        tmp = path / (fname + ".partial")
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp))
        os.replace(tmp, path / fname)
        weight_map.update({n: fname for n in tensors})

    for key, items in groups.items():
        save({name: W.random_full(full, name, shape, seed) for name, shape in items})
        if key != "top" and int(key) in full.moe_layers:
            layer = int(key)
            for chunk in file_chunks:
                tensors = {}
                for experts in W.expert_chunks(full):   # the generator's chunks (seeding unit)
                    if experts.start < chunk.start or experts.start >= chunk.stop:
                        continue
                    logical = W.random_experts_full(full, layer, experts, seed)
                    for proj, (q, sc) in logical.items():
                        for j, e in enumerate(experts):
                            for part, t in ctensors.to_checkpoint(q[j], sc[j]).items():
                                tensors[expert_names(layer, e, proj)[part]] = t
                save(tensors)
        if progress is not None and key != "top":
            progress()
    (path / "config.json").write_text(json.dumps(config_to_hf(full), indent=2) + "\n")
    idx = {"metadata": {"total_size": sum((path / f).stat().st_size for f in set(weight_map.values()))},
           "weight_map": dict(sorted(weight_map.items()))}
    tmp = path / (INDEX + ".partial")
    tmp.write_text(json.dumps(idx, indent=2) + "\n")
    os.replace(tmp, path / INDEX)
    return path
