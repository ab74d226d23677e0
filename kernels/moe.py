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

from ddbench.kernels import marlin


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


KERNELS = ("auto", "decode", "marlin", "wide", "triton", "gemv", "torch")
# "auto": one token on Hopper: the CUDA decode kernel (kernels.moe_decode) where it fits the
# call; from MARLIN_MIN_TOKENS tokens the CUDA Marlin kernel (kernels.moe_marlin) where it fits
# (bf16, sm_90+), from WIDE_MIN_PER_EXPERT tokens an expert (T*k/E) its large-T sibling
# (kernels.moe_wide) where that fits; elsewhere the Triton default (moe_triton.TILE_TABLE: the
# CUDA-core gemv at one token). Measured crossovers: docs/notes/moe.md.
MARLIN_MIN_TOKENS = 2
WIDE_MIN_PER_EXPERT = 14.0   # H100: marlin 654.0 vs wide 661.2 us at T = 640 (13.3), wide 681.3 vs 708.6 at 704 (14.7)


def resolve_moe_kernel(tokens: int, top_k: int, w: MarlinMoE, device, kernel: str = "auto", *,
                       dtype: torch.dtype = torch.bfloat16, stream_rows: int = 1) -> tuple[str, dict]:
    """Which MoE kernel a call of `tokens` tokens runs, and its tiles: (name, tile dict).

    kernel: "auto" (the measured rule: one token decode, then MARLIN_MIN_TOKENS, then
    WIDE_MIN_PER_EXPERT), "decode" (kernels.moe_decode, one token), "marlin"
    (kernels.moe_marlin), "wide" (kernels.moe_wide), "triton" (kernels.moe_triton's
    tl.dot kernel), "gemv" (kernels.moe_gemv, CUDA cores or sorted 16-row mma blocks), "torch"
    (fused_moe_ref)."""
    from dataclasses import asdict

    from ddbench.kernels import moe_decode, moe_marlin, moe_wide
    from ddbench.kernels.device import sm_count

    if kernel not in KERNELS:
        raise ValueError(f"unknown MoE kernel {kernel!r}; choose {', '.join(KERNELS)}")
    device = torch.device(device)
    if kernel == "torch":
        return "torch", {}
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
    decode_ok = (hopper and dtype in (torch.bfloat16, torch.float16) and tokens == 1
                 and moe_decode.shapes_ok(tokens * top_k, w) and moe_decode.programs(top_k, w) <= sm_count(device))
    if kernel == "decode" or (kernel == "auto" and decode_ok):
        if not decode_ok:
            raise ValueError("the decode MoE kernel needs one token in bf16 or fp16 on an sm_90+ GPU with enough SMs "
                             "and kernels.moe_decode.fits shapes")
        return "decode", {"w13_splits": moe_decode.KS, "programs": moe_decode.programs(top_k, w)}
    wide_ok = hopper and dtype == torch.bfloat16 and moe_wide.shapes_ok(w)
    if kernel == "wide" or (kernel == "auto" and wide_ok and tokens * top_k / w.n_experts >= WIDE_MIN_PER_EXPERT):
        if not wide_ok:
            raise ValueError("the wide MoE kernel needs bf16 on an sm_90+ GPU and kernels.moe_wide.shapes_ok shapes")
        return "wide", moe_wide.resolve_tiles(tokens, top_k, w)
    marlin_ok = hopper and dtype == torch.bfloat16 and moe_marlin.shapes_ok(w)
    if kernel == "marlin" or (kernel == "auto" and marlin_ok and tokens >= MARLIN_MIN_TOKENS):
        if not marlin_ok:
            raise ValueError("the marlin MoE kernel needs bf16 on an sm_90+ GPU and kernels.moe_marlin.shapes_ok shapes")
        return "marlin", moe_marlin.resolve_tiles(tokens, top_k, w, device)
    from ddbench.kernels import moe_triton as mt

    sms = mt.sm_count(device)
    if kernel == "auto":
        cfg = _default_config(tokens, top_k, w, device, stream_rows)
        return ("gemv" if cfg.gemv else "triton"), asdict(cfg)
    gemv_rows = [(b, f) for b, f in mt.TILE_TABLE if f.get("gemv")]
    rows = gemv_rows if kernel == "gemv" else [(b, f) for b, f in mt.TILE_TABLE if not f.get("gemv")]
    per_expert = tokens * top_k / w.n_experts
    fields = next((f for b, f in rows if per_expert <= b), rows[-1][1])
    cfg = mt.default_config(tokens, top_k, w.n_experts, w.inter, w.hidden, sms, table=[(float("inf"), fields)])
    return kernel, asdict(cfg)


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w: MarlinMoE,
              backend: str = "torch", x_half: torch.Tensor | None = None, sum_k: bool = True,
              stream_rows: int = 1, *, kernel: str = "auto", pdl_mode: int = 2) -> torch.Tensor:
    """The MoE GEMM; `backend` is 'torch' (reference) or 'triton' (the GPU kernels, chosen by
    `kernel`: see `resolve_moe_kernel`). x_half (kernel gemv only, ignored elsewhere): x already
    in that path's activation format (`kernels.moe_gemv.half_rows(x)`: fp16), saves its first
    launch. sum_k=False (kernels gemv and decode, `takes_rows`) returns the k weighted rows per
    token, fp32 `[T*k, H]` (row t*k + j), for the caller to sum (saves a launch). stream_rows: tokens a stream in x (`moe_triton.default_config`). pdl_mode:
    kernels.pdl's mode of the marlin and decode kernels' launches (the Triton paths run mode 2 where PDL exists)."""
    if backend not in ("torch", "triton"):
        raise ValueError(f"unknown MoE backend {backend!r}; choose torch or triton")
    name, tiles = "torch", {}
    if backend == "triton":
        name, tiles = resolve_moe_kernel(topk_ids.shape[0], topk_ids.shape[1], w, x.device, kernel, dtype=x.dtype,
                                         stream_rows=stream_rows)
    if not sum_k and name not in ROWS_KERNELS:
        raise ValueError(f"fused_moe(sum_k=False) needs one of the kernels {', '.join(ROWS_KERNELS)} (takes_rows)")
    if name == "torch":
        return fused_moe_ref(x, topk_ids, topk_weights, w)
    if name == "decode":
        from ddbench.kernels.moe_decode import fused_moe_decode

        return fused_moe_decode(x, topk_ids, topk_weights, w, sum_k, pdl_mode)
    if name == "marlin":
        from ddbench.kernels.moe_marlin import fused_moe_marlin

        return fused_moe_marlin(x, topk_ids, topk_weights, w, tiles, pdl_mode)
    if name == "wide":
        from ddbench.kernels.moe_wide import fused_moe_wide

        return fused_moe_wide(x, topk_ids, topk_weights, w, tiles, pdl_mode)
    from ddbench.kernels.device import sm_count
    from ddbench.kernels.moe_triton import MoeTritonConfig, check_inputs, fused_moe_triton

    cfg = MoeTritonConfig(**tiles)
    if cfg.gemv and (x_half is not None or not sum_k):
        from ddbench.kernels.moe_gemv import fused_moe_gemv

        check_inputs(x, topk_ids, topk_weights, w, cfg)
        if x_half is not None and (x_half.shape != x.shape or x_half.dtype != torch.float16):
            raise ValueError(f"x_half must be fp16 {list(x.shape)}, got {x_half.dtype} {tuple(x_half.shape)}")
        return fused_moe_gemv(x, topk_ids, topk_weights, w, cfg, sm_count(x.device), x_half, sum_k)
    return fused_moe_triton(x, topk_ids, topk_weights, w, cfg)


def _default_config(tokens: int, top_k: int, w: MarlinMoE, device, stream_rows: int = 1):
    from ddbench.kernels.device import sm_count
    from ddbench.kernels.moe_triton import default_config

    return default_config(tokens, top_k, w.n_experts, w.inter, w.hidden, sm_count(device), stream_rows=stream_rows)


ROWS_KERNELS = ("gemv", "decode")   # the kernels that take fused_moe(..., sum_k=False)


def uses_gemv(tokens: int, top_k: int, w: MarlinMoE, device, *, kernel: str = "auto",
              dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether `fused_moe(backend="triton", kernel=kernel)` runs `tokens` tokens on the CUDA-core
    path (kernels.moe_gemv), whose input is fp16 (`fused_moe(..., x_half=)` saves its cast)."""
    return resolve_moe_kernel(tokens, top_k, w, device, kernel, dtype=dtype)[0] == "gemv"


def takes_rows(tokens: int, top_k: int, w: MarlinMoE, device, *, kernel: str = "auto",
               dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether that call takes `fused_moe(..., sum_k=False)` (returns the k weighted rows of each
    token for the caller to sum)."""
    return resolve_moe_kernel(tokens, top_k, w, device, kernel, dtype=dtype)[0] in ROWS_KERNELS


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


# ---------------------------------------------------------------- synthetic weights and routings

def random_marlin_moe(n_experts: int, hidden: int, inter: int, group_size: int = 32, top_k: int = 8,
                      device=None, seed: int = 0, chunk: int = 16) -> MarlinMoE:
    """Random-but-valid Marlin MoE shard built directly at its shape (`quant.random_int4` +
    `marlin.pack`), `chunk` experts at a time so the logical int4 never exists whole.

    inter is the shard's intermediate size (I/tp). Scales give w13 outputs unit variance
    and w2 an extra 1/sqrt(top_k), so the weighted sum over the k experts keeps unit scale.
    """
    from ddbench.kernels import quant

    marlin.check_shape(hidden, 2 * inter, group_size)
    marlin.check_shape(inter, hidden, group_size)
    g = torch.Generator(device=device).manual_seed(seed)
    out = {"w13": torch.empty(n_experts, hidden // 16, 4 * inter, dtype=torch.int32, device=device),
           "w13_scale": torch.empty(n_experts, hidden // group_size, 2 * inter, dtype=torch.bfloat16, device=device),
           "w2": torch.empty(n_experts, inter // 16, 2 * hidden, dtype=torch.int32, device=device),
           "w2_scale": torch.empty(n_experts, inter // group_size, hidden, dtype=torch.bfloat16, device=device)}
    for e0 in range(0, n_experts, chunk):
        e1 = min(n_experts, e0 + chunk)
        for name, (n_out, n_in, gain) in {"w13": (2 * inter, hidden, 1.0),
                                         "w2": (hidden, inter, top_k ** -0.5)}.items():
            q, s = quant.random_int4((e1 - e0, n_out, n_in), group_size, gain=gain, generator=g, device=device)
            # checkpoint orientation [E, N, K] -> Marlin [E, K/16, 2N] and permuted [E, K/g, N]
            out[name][e0:e1] = marlin.pack(q.transpose(-1, -2))
            out[f"{name}_scale"][e0:e1] = marlin.permute_scales(s.transpose(-1, -2).contiguous(), group_size)
    return MarlinMoE(**out, group_size=group_size)


ROUTINGS = ("uniform", "skewed", "balanced", "router")


def synthetic_routing(kind: str, tokens: int, n_experts: int, top_k: int, device=None, seed: int = 0,
                      hot: int = 16, hot_share: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing without a router: (ids int32 `[T, k]`, distinct per token; weights fp32 `[T, k]`
    summing to 1 per token).

    uniform: each token's k experts drawn uniformly without replacement. skewed: `hot`
    experts together get probability mass `hot_share`, the rest share the remainder.
    balanced: assignment j of token t goes to expert (t*k + j) mod E (every expert equally
    loaded, the most experts touched for T).
    """
    if tokens <= 0:
        raise ValueError(f"tokens must be positive, got {tokens}")
    g = torch.Generator(device=device).manual_seed(seed)
    if kind == "uniform":
        ids = torch.rand(tokens, n_experts, generator=g, device=device).topk(top_k, dim=-1).indices
    elif kind == "skewed":
        hot = max(1, min(hot, n_experts - 1))
        p = torch.full((n_experts,), (1 - hot_share) / (n_experts - hot), device=device)
        p[:hot] = hot_share / hot
        ids = torch.multinomial(p.expand(tokens, n_experts), top_k, replacement=False, generator=g)
    elif kind == "balanced":
        ids = (torch.arange(tokens * top_k, device=device) % n_experts).reshape(tokens, top_k)
    else:
        raise ValueError(f"unknown routing {kind!r}; choose {', '.join(ROUTINGS[:3])}")
    w = torch.rand(tokens, top_k, generator=g, device=device) + 0.1
    return ids.to(torch.int32), w / w.sum(-1, keepdim=True)


def random_router(hidden: int, n_experts: int, device=None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random K2.6-style router: gate weight `[E, H]` (std 1/sqrt(H)) and correction bias `[E]`."""
    g = torch.Generator(device=device).manual_seed(seed)
    weight = torch.randn(n_experts, hidden, generator=g, device=device) / hidden ** 0.5
    bias = 0.1 * torch.randn(n_experts, generator=g, device=device)
    return weight.to(torch.bfloat16), bias


def expected_experts_touched(tokens: int, n_experts: int, top_k: int) -> float:
    """Expected distinct experts hit by T tokens with uniform top-k routing: E (1 - (1 - k/E)^T)."""
    return n_experts * (1 - (1 - top_k / n_experts) ** tokens)


# ---------------------------------------------------------------- the reference in two stages

def moe_ref_w13(x: torch.Tensor, topk_ids: torch.Tensor, w: MarlinMoE, compute_dtype=torch.float32) -> torch.Tensor:
    """Reference w13 stage: x `[T, H]` -> SiLU(gate)*up `[T*k, I]`, row t*k + j for slot j of token t."""
    t, k = topk_ids.shape
    h, i = w.hidden, w.inter
    flat_ids = topk_ids.reshape(-1).long()                                 # [T*k]
    token_of = torch.arange(t, device=x.device).repeat_interleave(k)       # [T*k]
    act = torch.empty(t * k, i, dtype=compute_dtype, device=x.device)
    xc = x.to(compute_dtype)
    for e in torch.unique(flat_ids).tolist():
        sel = (flat_ids == e).nonzero().squeeze(1)
        w13 = marlin.dequantize(w.w13[e], w.w13_scale[e], h, 2 * i, w.group_size, compute_dtype)  # [H, 2I]
        gate_up = xc[token_of[sel]] @ w13                                  # [n, 2I]
        act[sel] = F.silu(gate_up[:, :i]) * gate_up[:, i:]
    return act


def moe_ref_w2(act: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w: MarlinMoE,
               compute_dtype=torch.float32) -> torch.Tensor:
    """Reference w2 stage: act `[T*k, I]` -> `[T, H]`, weighted by the top-k weights and summed over k."""
    t, k = topk_ids.shape
    h, i = w.hidden, w.inter
    flat_ids = topk_ids.reshape(-1).long()
    token_of = torch.arange(t, device=act.device).repeat_interleave(k)
    out = torch.zeros(t, h, dtype=compute_dtype, device=act.device)
    for e in torch.unique(flat_ids).tolist():
        sel = (flat_ids == e).nonzero().squeeze(1)
        w2 = marlin.dequantize(w.w2[e], w.w2_scale[e], i, h, w.group_size, compute_dtype)         # [I, H]
        y = (act[sel].to(compute_dtype) @ w2) * topk_weights.reshape(-1)[sel].to(compute_dtype).unsqueeze(1)
        out.index_add_(0, token_of[sel], y)
    return out
