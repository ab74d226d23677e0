"""Model configuration: one dataclass, named presets, and the per-rank view.

`ModelConfig` holds the Kimi K2.6 (DeepSeek-V3 architecture) fields of DESIGN §3.
`preset(name, tp=1, rank=0)` returns a config; with `tp > 1` the derived `*_local`
fields describe one tensor-parallel rank's shard.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A configuration that breaks a shape rule (bad input, not a bug)."""


@dataclass
class ModelConfig:
    name: str = "k2.6"
    # backbone
    hidden: int = 7168
    n_layers: int = 61
    n_dense_layers: int = 1
    dense_inter: int = 18432
    vocab: int = 163840
    norm_eps: float = 1e-5
    # MLA attention
    n_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_dim: int = 128
    qk_rope_dim: int = 64
    v_head_dim: int = 128
    # rope (YaRN)
    rope_theta: float = 50000.0
    rope_factor: float = 64.0
    rope_original_max_pos: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 1.0
    # MoE
    n_experts: int = 384
    top_k: int = 8
    n_shared_experts: int = 1
    moe_inter: int = 2048
    routed_scaling: float = 2.827
    n_group: int = 1
    topk_group: int = 1
    # INT4 routed experts
    group_size: int = 32
    # tensor parallelism
    tp: int = 1
    rank: int = 0
    # derived in __post_init__
    qk_head_dim: int = field(init=False)
    softmax_scale: float = field(init=False)
    n_local_heads: int = field(init=False)
    moe_inter_local: int = field(init=False)
    dense_inter_local: int = field(init=False)
    shared_inter_local: int = field(init=False)
    vocab_local: int = field(init=False)

    def __post_init__(self):
        self.qk_head_dim = self.qk_nope_dim + self.qk_rope_dim
        mscale = 0.1 * math.log(self.rope_factor) * self.rope_mscale_all_dim + 1.0 if self.rope_factor > 1 else 1.0
        self.softmax_scale = self.qk_head_dim ** -0.5 * mscale * mscale
        if self.tp < 1 or not 0 <= self.rank < self.tp:
            raise ConfigError(f"rank {self.rank} is not in 0..{self.tp - 1} (tp={self.tp})")
        for what, n in [("n_heads", self.n_heads), ("moe_inter", self.moe_inter),
                        ("dense_inter", self.dense_inter), ("vocab", self.vocab)]:
            if n % self.tp:
                raise ConfigError(f"{what}={n} does not split over tp={self.tp}")
        if self.n_group != 1 or self.topk_group != 1:
            raise ConfigError(f"grouped routing (n_group={self.n_group}, topk_group={self.topk_group}) is not "
                              "supported: the router implements K2.6's n_group = topk_group = 1")
        if self.rope_mscale != self.rope_mscale_all_dim:
            raise ConfigError(f"rope mscale {self.rope_mscale} != mscale_all_dim {self.rope_mscale_all_dim} "
                              "is not supported (K2.6 has 1 and 1)")
        if not 0 < self.top_k <= self.n_experts:
            raise ConfigError(f"top_k={self.top_k} must be in 1..n_experts={self.n_experts}")
        self.n_local_heads = self.n_heads // self.tp
        self.moe_inter_local = self.moe_inter // self.tp
        self.dense_inter_local = self.dense_inter // self.tp
        self.shared_inter_local = self.moe_inter * self.n_shared_experts // self.tp
        self.vocab_local = self.vocab // self.tp

    def check_marlin(self) -> None:
        """Raise ConfigError unless the routed-expert shards obey the Marlin rules (DESIGN §4)."""
        g = self.group_size
        # w13: K = hidden, N = 2 * moe_inter_local;  w2: K = moe_inter_local, N = hidden
        for gemm, k, n in [("w13", self.hidden, 2 * self.moe_inter_local),
                           ("w2", self.moe_inter_local, self.hidden)]:
            if k % 16:
                raise ConfigError(f"{gemm}: K={k} is not a multiple of 16 (Marlin tiles)")
            if n % 64:
                raise ConfigError(f"{gemm}: N={n} is not a multiple of 64 (Marlin tiles)")
            if g <= 0 or k % g:
                raise ConfigError(f"{gemm}: group size {g} does not divide K={k}")

    def shard(self, tp: int, rank: int = 0) -> "ModelConfig":
        """The same model seen by rank `rank` of `tp`."""
        return with_overrides(self, tp=tp, rank=rank)

    @property
    def kv_values_per_token(self) -> int:
        """Cached values per token over all layers: MLA latent + rope key (DESIGN §8)."""
        return self.n_layers * (self.kv_lora_rank + self.qk_rope_dim)

    def dense_shapes(self) -> dict[str, tuple[int, int]]:
        """`[N, K]` of this rank's bf16 weight of each dense GEMM of a layer (at decode, one-row
        products; the scripts/gpu benchmarks time these shapes)."""
        h, nh = self.hidden, self.n_local_heads
        return {"wqkv_a": (self.q_lora_rank + self.kv_lora_rank + self.qk_rope_dim, h),
                "wq_b": (nh * self.qk_head_dim, self.q_lora_rank),
                "wo": (h, nh * self.v_head_dim),
                "router": (self.n_experts, h),
                "shared_w13": (2 * self.shared_inter_local, h), "shared_w2": (h, self.shared_inter_local),
                "dense_w13": (2 * self.dense_inter_local, h), "dense_w2": (h, self.dense_inter_local)}

    @property
    def moe_layers(self) -> range:
        return range(self.n_dense_layers, self.n_layers)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


PRESETS: dict[str, dict] = {
    "k2.6": {},
    # one TP-8 rank's shard of K2.6 (rank 0); DESIGN §3
    "k2.6-tp8-rank": {"tp": 8, "rank": 0},
    # small dims that keep every divisibility rule up to tp=8 (moe_inter_local 32)
    "tiny": dict(hidden=256, n_layers=3, n_dense_layers=1, dense_inter=512, vocab=1024,
                 n_heads=8, q_lora_rank=64, kv_lora_rank=64, qk_nope_dim=16, qk_rope_dim=16,
                 v_head_dim=16, n_experts=16, top_k=4, moe_inter=256, rope_original_max_pos=256),
}


def with_overrides(cfg: ModelConfig, **changes) -> ModelConfig:
    init_fields = {f.name for f in dataclasses.fields(ModelConfig) if f.init}
    unknown = set(changes) - init_fields
    if unknown:
        raise ConfigError(f"unknown config field(s): {', '.join(sorted(unknown))}")
    base = {k: v for k, v in dataclasses.asdict(cfg).items() if k in init_fields}
    base.update(changes)
    return ModelConfig(**base)


def preset(name: str, tp: int | None = None, rank: int | None = None, **overrides) -> ModelConfig:
    """Named preset, optionally one TP rank's view and field overrides."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    fields = {"name": name, **PRESETS[name], **overrides}
    if tp is not None:
        fields["tp"] = tp
    if rank is not None:
        fields["rank"] = rank
    return with_overrides(ModelConfig(), **fields)


def parse_overrides(items: list[str] | None) -> dict:
    """`["hidden=256", "norm_eps=1e-6"]` -> typed dict (types taken from ModelConfig)."""
    types = {f.name: f.type for f in dataclasses.fields(ModelConfig) if f.init}
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or key not in types:
            raise ConfigError(f"bad override {item!r}: expected FIELD=VALUE with a ModelConfig field")
        kind = {"int": int, "float": float, "str": str}[str(types[key]).replace("'", "")]
        try:
            out[key] = kind(value)
        except ValueError:
            raise ConfigError(f"bad override {item!r}: {value!r} is not a {kind.__name__}") from None
    return out
