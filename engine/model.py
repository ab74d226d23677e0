"""Kimi K2.6 (DeepSeek-V3 architecture): MLA + MoE transformer, tensor parallel.

Reads top to bottom: RMSNorm -> MLA (absorbed) -> MLP / MoE -> Block -> Transformer.

`Transformer.forward` takes any set of new tokens per stream with their positions and a
visibility mask among them (causal for prefill, one token for decode, ancestor-only for a
DDTree verify), writes their latent KV to the cache after each stream's prefix, and
returns full-vocab fp32 logits for every new token. It never advances `prefix_len`.

Weights are allocated uninitialised; `engine.weights` fills them (random init or a
checkpoint), sharded for `comm`'s rank. BF16 everywhere except the routed experts, which
are INT4 in Marlin layout and run through `kernels.moe.fused_moe`.

Which kernel runs where is the model's `kernels` (a frozen `kernels.select.KernelChoice`,
given at construction and handed to every call that depends on it); the model reads no
kernel module's switches.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from ddbench.engine.config import ConfigError, ModelConfig
from ddbench.engine.kv_cache import KVCache
from ddbench.engine.parallel import (ColumnParallelLinear, Comm, Linear, LocalComm, ParallelLMHead,
                                     RowParallelLinear, VocabParallelEmbedding, linear)
from ddbench.engine.phases import phase
from ddbench.engine.rope import rope_cos_sin, yarn_freqs
from ddbench.kernels import fused_ops, mla_decode, pdl, skinny
from ddbench.kernels.moe import MarlinMoE, fused_moe, route, takes_rows, uses_gemv
from ddbench.kernels.select import KernelChoice


class Ops:
    """The small fused ops of the step under the kernel choice `kernels`: Triton kernels
    (GPU) or their torch references."""

    def __init__(self, kind: str, kernels: KernelChoice | None = None):
        if kind not in ("torch", "triton"):
            raise ConfigError(f"unknown fused-ops backend {kind!r}; choose torch or triton")
        tri = kind == "triton"
        self.kind, self.kernels = kind, kernels or KernelChoice()
        self.pdl_mode = self.kernels.pdl_mode
        self.rope_ = fused_ops.rope_ if tri else fused_ops.rope_ref_
        self.silu_mul = fused_ops.silu_mul if tri else fused_ops.silu_mul_ref
        self._side: dict[torch.device, torch.cuda.Stream] = {}

    def rms_norm(self, x, w, eps, residual=None):
        if self.kind == "torch":
            return fused_ops.rms_norm_ref(x, w, eps, residual)
        return fused_ops.rms_norm(x, w, eps, residual, pdl_mode=self.pdl_mode)

    def mla_a_post(self, qkv, q_w, kv_w, cos, sin, ckv, kpe, prefix_len, eps):
        if self.kind == "torch":
            return fused_ops.mla_a_post_ref(qkv, q_w, kv_w, cos, sin, ckv, kpe, prefix_len, eps)
        return fused_ops.mla_a_post(qkv, q_w, kv_w, cos, sin, ckv, kpe, prefix_len, eps, pdl_mode=self.pdl_mode)

    def linear(self, x, w, add=None, reuse_add=False, kind="linear"):
        """x W^T (+ add) under the kernel choice (`engine.parallel.linear`)."""
        return linear(self.kernels, x, w, add, reuse_add, kind)

    def side_stream(self, x: torch.Tensor):
        """A second CUDA stream on x's device for work beside the main chain (one per device,
        kept), or None off CUDA or with the choice's stream=off."""
        if not (self.kernels.side_stream and x.is_cuda):
            return None
        if x.device not in self._side:
            self._side[x.device] = torch.cuda.Stream(x.device)
        return self._side[x.device]

    def route(self, x, gate, bias, top_k, scaling):
        """Router: the reference is kernels.moe.route (fp32 gate GEMM); the Triton path runs the
        gate GEMM in the model dtype (fp32 accumulate) and fuses sigmoid/top-k/renorm."""
        if self.kind == "torch":
            return route(x, gate, bias, top_k, scaling)
        return self.route_logits(self.linear(x, gate), bias, top_k, scaling)

    def route_logits(self, logits, bias, top_k, scaling):
        """The router after its gate GEMM (`fused_ops.route`)."""
        return fused_ops.route(logits, bias, top_k, scaling, pdl_mode=self.pdl_mode)

    def fuses(self, x, w) -> bool:
        """Whether a norm before x W^T, or SiLU(gate) * up, rope or the router's top-k after it,
        rides in the skinny GEMM: Triton ops and `skinny.fits` (CUDA, at most the choice's
        `skinny` rows; 0 turns it off)."""
        return self.kind == "triton" and skinny.fits(x, w, self.kernels.skinny)

    def gemv(self, kind: str) -> bool:
        """Whether the choice runs a one-row call of `kind` on kernels.gemv."""
        return kind in self.kernels.gemv

    def norm_linear(self, norm, x, residual, w, glu=False):
        """-> (y, h): h = residual + x (x when residual is None), y = norm(h) W^T, with glu
        SiLU(gate) * up of the [gate | up] product. One skinny kernel where `fuses`, else
        the norm kernel, the GEMM and silu_mul."""
        if self.fuses(x, w):
            y, h, _, _ = skinny.norm_linear(x, norm.weight, norm.eps, w, residual, glu=glu,
                                            cuda_gemv=self.gemv("norm"), pdl_mode=self.pdl_mode)
            return y, (x if residual is None else h)
        xn, h = norm(x, residual=residual) if residual is not None else (norm(x), x)
        return self.glu_linear(xn, w) if glu else self.linear(xn, w), h

    def rope_linear(self, x, w, cos, sin, head, offset):
        """x W^T `[.., N]` as heads of `head` columns with interleaved rope (cos/sin `[.., R/2]`)
        on columns offset.. of each: the skinny GEMM's epilogue where `fuses`, else rope_ after."""
        if self.fuses(x, w):
            return skinny.skinny_linear(x, w, rope=(cos, sin, head, offset), cuda_gemv=self.gemv("rope"),
                                        pdl_mode=self.pdl_mode)
        y = self.linear(x, w)
        self.rope_(y.view(*y.shape[:-1], -1, head), cos, sin, offset)            # [.., N/head, head], in place
        return y

    def glu_linear(self, x, w):
        """SiLU(x gate^T) * (x up^T) for w = [gate | up] rows `[2I, K]` -> `[.., I]`."""
        if self.fuses(x, w):
            return skinny.skinny_linear(x, w, glu=True, pdl_mode=self.pdl_mode)
        return self.silu_mul(self.linear(x, w))

    def heads_linear(self, x, w):
        """Per-head products (`skinny.heads_linear`) under the choice."""
        return skinny.heads_linear(x, w, max_rows=self.kernels.skinny, pdl_mode=self.pdl_mode)


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in fp32; with `residual`, first h = residual + x and
    returns (norm(h), h) (one fused kernel)."""

    def __init__(self, dim: int, eps: float, ops: Ops, device=None, dtype=None):
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x, residual=None):
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


def _attention_fn(backend: str, pdl_mode: int):
    if backend == "torch":
        from ddbench.kernels.mla_attn import mla_attention_ref
        return mla_attention_ref
    if backend == "triton":
        from ddbench.kernels import mla_attn
        return functools.partial(mla_attn.mla_attention, pdl_mode=pdl_mode)
    raise ConfigError(f"unknown attention backend {backend!r}; choose torch or triton")


class MLA(nn.Module):
    """Multi-head latent attention, absorbed form (DeepSeek-V3), heads split over TP ranks.

    q = wq_b(q_norm(wq_a x)) split into nope/rope parts; the nope part is absorbed through
    wkv_b's key rows into the kv latent, so attention runs against the cached latent
    (kv_lora_rank) + roped shared key (qk_rope_dim); the latent output goes through
    wkv_b's value rows and wo (row parallel: all-reduce). wq_a and wkv_a (both replicated,
    same input) are one GEMM: `wqkv_a` holds wq_a's rows then wkv_a's.
    """

    def __init__(self, cfg: ModelConfig, comm: Comm, layer: int, attn_backend: str, ops: Ops, device, dtype):
        super().__init__()
        self.cfg, self.layer, self.ops = cfg, layer, ops
        h, nh = cfg.hidden, cfg.n_heads
        k = ops.kernels
        self.wqkv_a = Linear(h, cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_dim, device, dtype, k)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, ops, device, dtype)   # weights used by mla_a_post
        self.wq_b = ColumnParallelLinear(cfg.q_lora_rank, nh * cfg.qk_head_dim, comm, device, dtype, k)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps, ops, device, dtype)
        self.wkv_b = ColumnParallelLinear(cfg.kv_lora_rank, nh * (cfg.qk_nope_dim + cfg.v_head_dim), comm,
                                          device, dtype, k)
        self.wo = RowParallelLinear(nh * cfg.v_head_dim, h, comm, device, dtype, k)
        self.attend = _attention_fn(attn_backend, ops.pdl_mode)
        # decode: kernels.mla_decode where it fits, for calls of up to this many streams (None: any)
        self.one_launch = attn_backend == "triton" and k.attn_streams() != 0
        self.one_launch_streams = k.attn_streams()

    def forward(self, qkv, cos, sin, cache: KVCache, prefix_len, visible):
        """qkv = wqkv_a(x) `[B, T, Q+L+Dr]` (the Block fuses the pre-norm into that GEMM)."""
        cfg = self.cfg
        b, t, _ = qkv.shape
        nh, dn, dr, dv, lat = cfg.n_local_heads, cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_head_dim, cfg.kv_lora_rank
        # one kernel: q_norm(q latent) -> q_a; kv_norm(kv latent) and rope(k_pe) straight
        # into the cache at prefix_len[b] + j
        ckv, kpe = cache.ckv[self.layer], cache.kpe[self.layer]
        q_a = self.ops.mla_a_post(qkv, self.q_norm.weight, self.kv_norm.weight, cos, sin, ckv, kpe, prefix_len,
                                  cfg.norm_eps)
        q = self.ops.rope_linear(q_a, self.wq_b.weight, cos, sin, dn + dr, dn)  # wq_b, rope on the rope dims
        q = q.view(b, t, nh, dn + dr)                                           # [B, T, nh, Dn+Dr]
        if self.one_launch and mla_decode.fits(q, self.wkv_b.weight, ckv, kpe, prefix_len, visible,
                                               self.one_launch_streams):
            o = mla_decode.mla_decode(q, self.wkv_b.weight, ckv, kpe, prefix_len, visible, cfg.softmax_scale,
                                      pdl=pdl.on(q, self.ops.pdl_mode) > 0)      # [B, 1, nh, Dv]
            return self.wo(o.reshape(b, t, nh * dv))
        q_nope, q_pe = q.split([dn, dr], dim=-1)                               # [B, T, nh, Dn], [.., Dr]
        wkv_b = self.wkv_b.weight.view(nh, dn + dv, lat)                       # [nh, Dn+Dv, L]
        q_lat = self.ops.heads_linear(q_nope, wkv_b[:, :dn].transpose(1, 2))   # [B, T, nh, L]
        # attention in the latent space, then each head's value rows of wkv_b (the attention's
        # merge launch does that product at decode sizes)
        o = self.attend(q_lat, q_pe.to(q_lat.dtype), ckv, kpe, prefix_len, visible, cfg.softmax_scale,
                        out_proj=wkv_b[:, dn:])                                 # [B, T, nh, Dv]
        return self.wo(o.reshape(b, t, nh * dv))                                # [B, T, H]


class MLP(nn.Module):
    """SwiGLU MLP, intermediate dim split over ranks: w2(silu(w1 x) * w3 x).

    w1 and w3 are one GEMM: `w13`'s local rows are this rank's w1 (gate) rows, then its
    w3 (up) rows."""

    def __init__(self, hidden: int, inter: int, comm: Comm, ops: Ops, device, dtype):
        super().__init__()
        self.ops, self.inter_local = ops, inter // comm.tp
        self.w13 = ColumnParallelLinear(hidden, 2 * inter, comm, device, dtype, ops.kernels)
        self.w2 = RowParallelLinear(inter, hidden, comm, device, dtype, ops.kernels)

    def forward(self, x, reduce: bool = True, add=None, add_rows: int = 1):
        """`add` (same shape as the output, overwritten) is summed into the down GEMM (addmm_, one
        kernel); with add_rows > 1 add has that many rows per row of x, summed into the skinny
        down GEMM's epilogue (the routed experts' k rows of each token)."""
        return self.down(self.gate_up(x), reduce, add, add_rows)

    def gate_up(self, x):
        """SiLU(x w1^T) * (x w3^T): `[.., H]` -> `[.., I/tp]` (one GEMM over w13)."""
        return self.ops.glu_linear(x, self.w13.weight)

    def forward_normed(self, a, h, norm: RMSNorm):
        """The dense block's FFN: -> (mlp(norm(h + a)), h + a); the norm rides in w13's GEMM."""
        act, h = self.ops.norm_linear(norm, a, h, self.w13.weight, glu=True)   # [.., I/tp]
        return self.down(act), h

    def down(self, act, reduce: bool = True, add=None, add_rows: int = 1):
        if add is None:
            return self.w2(act, reduce=reduce)                                 # [.., H]
        if add_rows > 1:                                                       # sum of add's rows + act W2^T
            y = skinny.skinny_linear(act, self.w2.weight, add=add, add_rows=add_rows,
                                     cuda_gemv=self.ops.gemv("add"), pdl_mode=self.ops.pdl_mode)
        else:                                                                  # add + act W2^T (into add)
            y = self.ops.linear(act, self.w2.weight, add=add, reuse_add=True, kind="add")
        return self.w2.comm.all_reduce(y) if reduce else y


class MoE(nn.Module):
    """K2.6 MoE: sigmoid router with selection bias (replicated), routed INT4 experts
    (intermediate dim split over ranks, Marlin layout) and one shared expert; the routed
    and shared partial sums share one all-reduce."""

    def __init__(self, cfg: ModelConfig, comm: Comm, moe_backend: str, ops: Ops, device, dtype):
        super().__init__()
        self.cfg, self.comm, self.backend, self.ops = cfg, comm, moe_backend, ops
        self.routing = None   # engine.routing.Routing: replaces / counts the router's choice
        e, h, i, g = cfg.n_experts, cfg.hidden, cfg.moe_inter_local, cfg.group_size
        self.gate = nn.Parameter(torch.empty(e, h, device=device, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(e, device=device, dtype=torch.float32), requires_grad=False)
        self.shared = MLP(h, cfg.moe_inter * cfg.n_shared_experts, comm, ops, device, dtype)
        # Marlin shards (kernels.moe.MarlinMoE), filled by engine.weights
        self.register_buffer("w13", torch.empty(e, h // 16, 4 * i, device=device, dtype=torch.int32))
        self.register_buffer("w13_scale", torch.empty(e, h // g, 2 * i, device=device, dtype=torch.bfloat16))
        self.register_buffer("w2", torch.empty(e, i // 16, 2 * h, device=device, dtype=torch.int32))
        self.register_buffer("w2_scale", torch.empty(e, i // g, h, device=device, dtype=torch.bfloat16))

    def experts(self) -> MarlinMoE:
        return MarlinMoE(self.w13, self.w13_scale, self.w2, self.w2_scale, self.cfg.group_size)

    def forward(self, a, res, norm: RMSNorm):
        """-> (moe(norm(res + a)), res + a). Where the ops fuse it, the norm rides in the
        router's gate GEMM, which also writes the normed x and, for the CUDA-core expert path, its
        fp16 copy, that path's input (saves its cast launch) and, with the choice's route=fused,
        routes the tokens in its last program (saves the route launch)."""
        b, t, h = a.shape
        cfg, experts = self.cfg, self.experts()
        af, res = a.reshape(b * t, h), res.reshape(b * t, h)                  # [N, H]
        xh = None
        if self.ops.fuses(af, self.gate):
            with phase("moe"):
                want_xh = self.backend == "triton" and uses_gemv(b * t, cfg.top_k, experts, af.device,
                                                                 kernel=self.ops.kernels.moe, dtype=af.dtype)
                route = (self.bias, cfg.top_k, cfg.routed_scaling)
                logits, res, xf, xh, *topk = skinny.norm_linear(
                    af, norm.weight, norm.eps, self.gate, res, out_xn=True, out_xh=want_xh,
                    route=route if self.ops.kernels.fuse_route else None, pdl_mode=self.ops.pdl_mode)  # [N, E]
                ids, w = topk or self.ops.route_logits(logits, *route)            # [N, k] each
        else:
            with phase("mlp"):
                xf, res = norm(af, residual=res)                              # res += a; xf = norm(res)
            with phase("moe"):
                ids, w = self.ops.route(xf, self.gate, self.bias, cfg.top_k, cfg.routed_scaling)  # [N, k]
        if self.routing is not None:                                          # engine.routing
            with phase("moe"):
                ids, w = self.routing(ids, w, b, t)
        # on the skinny path, where the expert kernel takes it (gemv, decode), the k expert rows of
        # each token are summed in the shared expert's down GEMM, not by the MoE's own last launch
        rows = self.ops.fuses(af, self.gate) and self.backend == "triton" and takes_rows(
            b * t, cfg.top_k, experts, af.device, kernel=self.ops.kernels.moe, dtype=af.dtype)
        k_rows = cfg.top_k if rows else 1
        # the shared expert's gate/up GEMM does not depend on the routed experts: on the skinny
        # path it runs on a side stream beside them (its time then overlaps the "moe" phase;
        # at 10 rows, cuBLAS path, the step was 5.5 ms slower with it: docs/notes/decode.md)
        side = self.ops.side_stream(xf) if rows else None
        if side is not None:
            main = torch.cuda.current_stream(xf.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                act = self.shared.gate_up(xf)                                 # [N, I/tp]
        with phase("moe"):
            y = fused_moe(xf, ids, w, experts, self.backend, x_half=xh, sum_k=k_rows == 1,
                          stream_rows=t, kernel=self.ops.kernels.moe, pdl_mode=self.ops.pdl_mode)  # [N * k_rows, H]
        with phase("mlp"):
            if side is None:
                act = self.shared.gate_up(xf)
            else:
                main.wait_stream(side)
            y = self.shared.down(act, reduce=False, add=y, add_rows=k_rows)   # routed + shared [N, H]
        return self.comm.all_reduce(y).view(b, t, h), res.view(b, t, h)       # [B, T, H] each


class Block(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += ffn(norm(h)), ffn dense (layer 0) or MoE.

    Residual adds are fused into the next norm: a block takes the residual stream `h`
    without the previous block's output `delta` and returns (h, its own output), so each
    add rides in an RMSNorm kernel (h, x = h + delta, norm(h + delta)). On the skinny path
    (few rows, Triton ops) that norm is itself the prologue of the GEMM after it: wqkv_a,
    the router gate (MoE) or w13 (dense), so a norm costs no launch of its own."""

    def __init__(self, cfg: ModelConfig, comm: Comm, layer: int, moe_backend, attn_backend, ops: Ops,
                 device, dtype):
        super().__init__()
        self.dense, self.ops = layer < cfg.n_dense_layers, ops
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps, ops, device, dtype)
        self.attn = MLA(cfg, comm, layer, attn_backend, ops, device, dtype)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.norm_eps, ops, device, dtype)
        self.ffn = (MLP(cfg.hidden, cfg.dense_inter, comm, ops, device, dtype) if self.dense
                    else MoE(cfg, comm, moe_backend, ops, device, dtype))

    def forward(self, h, delta, cos, sin, cache, prefix_len, visible):
        """-> (h + delta + attn output, ffn output): the residual stream after this block
        is the sum of the two. Each norm rides in the GEMM after it where the ops fuse it."""
        with phase("attention"):
            x, res = (delta, h) if delta is not None else (h, None)
            qkv, h = self.ops.norm_linear(self.attn_norm, x, res, self.attn.wqkv_a.weight)  # h += delta
            a = self.attn(qkv, cos, sin, cache, prefix_len, visible)
        if self.dense:
            with phase("mlp"):
                y, h = self.ffn.forward_normed(a, h, self.ffn_norm)             # h += a
            return h, y
        y, h = self.ffn(a, h, self.ffn_norm)                                    # h += a
        return h, y


class Transformer(nn.Module):
    """The K2.6 target model (one TP rank's shard when comm.tp > 1)."""

    def __init__(self, cfg: ModelConfig, comm: Comm | None = None, moe_backend: str = "torch",
                 attn_backend: str = "torch", device=None, dtype=torch.bfloat16, fused: str = "auto",
                 kernels: KernelChoice | None = None):
        super().__init__()
        comm = comm or LocalComm()
        if (comm.tp, comm.rank) != (cfg.tp, cfg.rank):
            raise ConfigError(f"config is rank {cfg.rank} of tp={cfg.tp} but comm is rank {comm.rank} "
                              f"of {comm.tp}")
        if moe_backend not in ("torch", "triton"):
            raise ConfigError(f"unknown MoE backend {moe_backend!r}; choose torch or triton")
        cfg.check_marlin()
        self.cfg, self.comm, self.dtype = cfg, comm, dtype
        self.moe_backend, self.attn_backend = moe_backend, attn_backend
        if fused == "auto":  # the Triton kernels on GPU; the references on CPU
            fused = "triton" if torch.device(device or "cpu").type == "cuda" else "torch"
        self.kernels = kernels or KernelChoice()
        self.ops = ops = Ops(fused, self.kernels)
        self.tok_embed = VocabParallelEmbedding(cfg.vocab, cfg.hidden, comm, device, dtype)
        self.layers = nn.ModuleList(Block(cfg, comm, i, moe_backend, attn_backend, ops, device, dtype)
                                    for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps, ops, device, dtype)
        self.head = ParallelLMHead(cfg.hidden, cfg.vocab, comm, device, dtype, self.kernels)
        self.register_buffer("freqs", yarn_freqs(cfg).to(device), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens long `[B, T]` -> hidden `[B, T, H]` (vocab-parallel lookup)."""
        return self.tok_embed(tokens)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """hidden `[.., H]` -> full-vocab fp32 logits `[.., vocab]`: final norm + lm_head + gather."""
        with phase("lm_head"):
            return self.head(self.norm(h))

    def forward(self, tokens, positions, cache: KVCache, prefix_len, visible, hidden_layers=()):
        """Run T new tokens per stream.

        tokens long `[B, T]`, positions long `[B, T]` (rope positions), prefix_len int `[B]`
        (cached tokens per stream; new token j is written at prefix_len[b] + j), visible bool
        `[B, T, T]` (new token i sees new token j). Returns (logits fp32 `[B, T, vocab]`,
        hiddens `[B, T, len(hidden_layers), H]` or None): hidden of layer i is the residual
        stream after block i.
        """
        h, delta = self.embed(tokens), None                                    # [B, T, H]
        cos, sin = rope_cos_sin(positions, self.freqs)                         # [B, T, Dr/2] each
        keep = {}
        for i, layer in enumerate(self.layers):
            h, delta = layer(h, delta, cos, sin, cache, prefix_len, visible)
            if i in hidden_layers:
                keep[i] = h + delta
        hiddens = torch.stack([keep[i] for i in hidden_layers], dim=2) if hidden_layers else None  # [B, T, n, H]
        with phase("lm_head"):
            x, _ = self.norm(delta, residual=h)
            return self.head(x), hiddens

    def new_cache(self, n_streams: int, max_len: int, dtype=None) -> KVCache:
        """A KV cache for this model on its device."""
        return KVCache(self.cfg, n_streams, max_len, self.device, dtype or self.dtype)

    def hf_weights(self) -> dict[str, tuple[torch.Tensor, int | None]]:
        """Every dense tensor by its Hugging Face DeepSeek-V3 name -> (local shard, split dim).

        Split dim is the dim of the full tensor that is divided over TP ranks (None:
        replicated). Routed experts are not listed: see `MoE.w13` etc. and engine.weights.
        """
        out = {"model.embed_tokens.weight": (self.tok_embed.weight, 0),
               "model.norm.weight": (self.norm.weight, None),
               "lm_head.weight": (self.head.weight, 0)}
        for i, blk in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = blk.attn
            q = self.cfg.q_lora_rank
            out.update({
                p + "input_layernorm.weight": (blk.attn_norm.weight, None),
                p + "post_attention_layernorm.weight": (blk.ffn_norm.weight, None),
                p + "self_attn.q_a_proj.weight": (a.wqkv_a.weight[:q], None),
                p + "self_attn.q_a_layernorm.weight": (a.q_norm.weight, None),
                p + "self_attn.q_b_proj.weight": (a.wq_b.weight, 0),
                p + "self_attn.kv_a_proj_with_mqa.weight": (a.wqkv_a.weight[q:], None),
                p + "self_attn.kv_a_layernorm.weight": (a.kv_norm.weight, None),
                p + "self_attn.kv_b_proj.weight": (a.wkv_b.weight, 0),
                p + "self_attn.o_proj.weight": (a.wo.weight, 1),
            })
            mlp = blk.ffn if blk.dense else blk.ffn.shared
            m, il = p + ("mlp." if blk.dense else "mlp.shared_experts."), mlp.inter_local
            out.update({m + "gate_proj.weight": (mlp.w13.weight[:il], 0),
                        m + "up_proj.weight": (mlp.w13.weight[il:], 0),
                        m + "down_proj.weight": (mlp.w2.weight, 1)})
            if not blk.dense:
                out[p + "mlp.gate.weight"] = (blk.ffn.gate, None)
                out[p + "mlp.gate.e_score_correction_bias"] = (blk.ffn.bias, None)
        return out

    def moe_blocks(self) -> dict[int, MoE]:
        """Layer index -> its MoE module."""
        return {i: blk.ffn for i, blk in enumerate(self.layers) if not blk.dense}


def causal_visible(b: int, t: int, device=None) -> torch.Tensor:
    """bool `[B, T, T]`: new token i sees new tokens j <= i."""
    return torch.ones(t, t, dtype=torch.bool, device=device).tril().expand(b, t, t).contiguous()
