"""The MoE block of one decode token in one launch (CUDA, `kernels/moe_block.cu`).

At concurrency 1 the MoE block was five dependent launches (the router GEMM with the ffn
norm and top-k, the routed w13 + act, the routed w2, the shared gate/up on a side stream,
the shared w2 + k-sum), and each boundary stops the DRAM stream: the routed w13 cannot load
anything before the router is done. Here one program an SM streams its share of every
weight through a ring of shared-memory slots (bulk copies by the TMA engine, one mbarrier a
slot): the static weights before the PDL wait, the routed experts' w13 as soon as every
program has the top-k (after a grid barrier), their w2 right behind it; a second grid
barrier hands w13's partial sums to the w2 programs.
The maths is the block's, in the engine's precisions: fp32 norm, router and shared gate/up
(rounded to bf16 as the GEMM outputs are), the routed dots in packed fp16 as
`kernels.moe_gemv`, bf16 out. `reference` is the same in torch.

The grid barriers need every program resident at once: one program an SM, and `fits` only
when the block's units fit the GPU's SMs (K2.6 at TP 8: 128 programs on an H200's 132).

Measured slower than the launches it replaces, so off by default (`ENABLED`):
scripts/gpu/moe_block_bench.py times it and shows where each program's time goes.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from kernels import marlin, ticket
from kernels.cuda import Kernel, tensor_map_2d
from kernels.moe import MarlinMoE
from kernels.moe_triton import sm_count

# read at each call; off by default: in the K2.6 TP-8 c=1 decode step on an H200 the block
# costs ~37 us a layer against ~32 for the five launches (docs/BENCHMARKS.md, decode session
# 13: a program's ~330 KB arrive at ~10-15 GB/s); environment DDBENCH_MOE_BLOCK=1 turns it on
ENABLED = os.environ.get("DDBENCH_MOE_BLOCK", "0") == "1"
SHARED_BYTES = 227 * 1024 - 2048   # dynamic shared memory a program (H200: 227 KB, less the static)
THREADS = 512
MAX_SLOTS = 16                     # ring slots at most


def config(h: int, e: int, top_k: int, inter: int, shared_inter: int, group: int, n_sm: int) -> dict[str, int]:
    """Compile-time shape of the kernel (kernels/moe_block.cu's defines) and its grid; raises
    ValueError when the block does not fit: programs > SMs, a piece > a slot, too few slots."""
    def bad(why):
        raise ValueError(f"moe_block does not fit H={h} E={e} k={top_k} I={inter} SI={shared_inter} "
                         f"G={group} on {n_sm} SMs: {why}")
    if h % 64 or inter % 64 or shared_inter % 64 or group % 16 or h % group or inter % group or group >= inter:
        bad("needs H, I, SI multiples of 64, grouped scales (G a multiple of 16 below I)")
    if top_k > 32:
        bad("top-k above 32")
    per_group = group // 16
    splits = [s for s in (16, 8, 4, 2, 1) if h // 16 % s == 0 and h // 16 // s % per_group == 0
              and top_k * (2 * inter // 64) * s <= n_sm]
    if not splits:
        bad("the w13 units outnumber the SMs")
    ks = splits[0]
    grid = max(top_k * (2 * inter // 64) * ks, h // 64)
    if grid > n_sm:
        bad(f"{grid} programs")
    slot = 2 * h

    def piece(kts):                      # k tiles a piece: the most that fit a slot, whole groups
        fit = [d for d in range(kts, 0, -1) if kts % d == 0 and d % per_group == 0
               and d * 512 + d * 16 // group * 128 <= slot]
        return fit[0] if fit else bad("a piece of one scale group is larger than a slot")
    slots = min(MAX_SLOTS, (SHARED_BYTES - 6 * h - 128 * shared_inter) // slot)
    rows = -(-e // grid) + 2 * -(-shared_inter // grid)
    if slots < max(2, rows):
        bad(f"{slots} slots of {slot} bytes for {rows} rows a program")
    if 4 * h < 2 * top_k * inter + 4 * shared_inter:
        bad("the k experts' act does not fit in x's space")
    return {"H": h, "E": e, "TOPK": top_k, "I": inter, "SI": shared_inter, "G": group, "KS": ks, "GRID": grid,
            "PK13": piece(h // 16 // ks), "PK2": piece(inter // 16), "SLOTS": slots, "SLOT": slot, "grid": grid}


@functools.lru_cache(maxsize=None)
def _kernel(defines: tuple, device: torch.device) -> Kernel:
    return Kernel("moe_block.cu", "moe_block", dict(defines), device)


@functools.lru_cache(maxsize=None)
def _config(key: tuple, n_sm: int) -> dict[str, int] | None:
    try:
        return config(*key, n_sm)
    except ValueError:
        return None


_MAPS: dict[tuple, object] = {}   # (address, dtype, shape, box) -> descriptor (holds no tensor)


def _map(t: torch.Tensor, rows: int, cols: int, box_rows: int, box_cols: int):
    key = (t.data_ptr(), t.dtype, rows, cols, box_rows, box_cols)
    if key not in _MAPS:
        _MAPS[key] = tensor_map_2d(t, rows, cols, box_rows, box_cols)
    return _MAPS[key]


def _maps(w: MarlinMoE, cfg: dict) -> list:
    """TMA descriptors of the Marlin tensors seen as 2-D [rows, words or scales]: a w13 / w2
    piece is one box of k tiles x one 64-column block (128 words), its scales one box."""
    h, i, g = cfg["H"], cfg["I"], cfg["G"]
    out = []
    for t, s, kt, n, pk in ((w.w13, w.w13_scale, h // 16, 2 * i, cfg["PK13"]), (w.w2, w.w2_scale, i // 16, h, cfg["PK2"])):
        e = t.shape[0]
        out.append(_map(t, e * kt, 2 * n, pk, 128))
        out.append(_map(s, e * kt * 16 // g, n, pk * 16 // g, 64))
    return out


def _key(gate: torch.Tensor, top_k: int, sw13: torch.Tensor, w: MarlinMoE) -> tuple:
    return (gate.shape[1], gate.shape[0], top_k, w.inter, sw13.shape[0] // 2, w.group_size)


def fits(x: torch.Tensor, gate: torch.Tensor, top_k: int, sw13: torch.Tensor, w: MarlinMoE) -> bool:
    """One bf16 row on a Hopper GPU whose SMs hold the block's programs (and ENABLED)."""
    return (ENABLED and x.is_cuda and x.dtype == torch.bfloat16 and x.numel() == x.shape[-1]
            and torch.cuda.get_device_capability(x.device)[0] >= 9
            and _config(_key(gate, top_k, sw13, w), sm_count(x.device)) is not None)


def moe_block(a, res, nw, eps: float, gate, bias, top_k: int, scaling: float, sw13, sw2, w: MarlinMoE,
              pdl: bool = False, times: torch.Tensor | None = None):
    """The MoE block of one token: h = a + res (bf16; res may be None), xn = rmsnorm(h) * nw,
    y = sum over the top-k experts of weight * expert(xn) + shared(xn). a, res, nw bf16 `[H]`;
    gate `[E, H]`, bias fp32 `[E]`; sw13 `[2 SI, H]` (gate rows, then up), sw2 `[H, SI]`;
    w the Marlin experts. -> (y bf16 `[1, H]`, h bf16 `[1, H]`, ids int32 `[1, k]`, weights
    fp32 `[1, k]`). pdl: launched as a dependent of the kernel before (kernels.pdl's rules).
    times: int64 `[grid, 11]`, filled with each program's clock64 at the kernel's marks (a
    build of the kernel with them; scripts/gpu/moe_block_bench.py)."""
    key, n_sm = _key(gate, top_k, sw13, w), sm_count(a.device)
    cfg = dict(_config(key, n_sm) or config(*key, n_sm))   # (config raises why the block does not fit)
    grid = cfg.pop("grid")
    cfg["TIMES"] = int(times is not None)
    h, dev = gate.shape[1], a.device
    for t in (a, res, nw, gate, sw13, sw2):
        if t is not None and (t.dtype != torch.bfloat16 or not t.is_contiguous() or t.data_ptr() % 16):
            raise ValueError("moe_block needs contiguous, 16-byte aligned bf16 a, res, nw, gate and shared weights")
    y = torch.empty(1, h, device=dev, dtype=torch.bfloat16)
    h_out = torch.empty(1, h, device=dev, dtype=torch.bfloat16)
    ids = torch.empty(1, top_k, device=dev, dtype=torch.int32)
    wts = torch.empty(1, top_k, device=dev, dtype=torch.float32)
    logits = torch.empty(cfg["E"], device=dev, dtype=torch.float32)
    sact = torch.empty(cfg["SI"], device=dev, dtype=torch.float32)
    part13 = torch.empty(cfg["KS"] * top_k * 2 * cfg["I"], device=dev, dtype=torch.float32)
    shared = 6 * h + cfg["SLOTS"] * cfg["SLOT"] + 128 * cfg["SI"]
    _kernel(tuple(sorted(cfg.items())), dev)(
        grid, THREADS, shared,
        [a, res, nw, float(eps), gate, bias.float().contiguous(), float(scaling), sw13, sw2,
         *_maps(w, cfg), y, h_out, ids, wts, logits, sact, part13,
         ticket.counters(dev, "moe_block", 2), int(pdl), times], pdl=pdl)
    return y, h_out, ids, wts


def reference(a, res, nw, eps: float, gate, bias, top_k: int, scaling: float, sw13, sw2, w: MarlinMoE):
    """`moe_block` in torch, fp32 with the kernel's roundings: -> (y fp32 `[1, H]`, h, ids, weights)."""
    hid, inter = gate.shape[1], w.inter
    h = (a.float() + res.float()).to(a.dtype) if res is not None else a
    hf = h.float().reshape(1, hid)
    xn = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * nw.float()
    scores = torch.sigmoid(xn @ gate.float().T)                                      # [1, E]
    ids = torch.topk(scores + bias.float(), top_k, dim=-1).indices
    wts = scores.gather(-1, ids)
    wts = wts / wts.sum(-1, keepdim=True) * scaling
    si = sw13.shape[0] // 2
    gu = (xn @ sw13.float().T).bfloat16().float()
    y = (F.silu(gu[:, :si]) * gu[:, si:]).bfloat16().float() @ sw2.float().T
    xh = xn.half().float()
    for j, e in enumerate(ids[0].tolist()):
        g13 = xh @ marlin.dequantize(w.w13[e], w.w13_scale[e], hid, 2 * inter, w.group_size)
        act = (F.silu(g13[:, :inter]) * g13[:, inter:] * wts[0, j]).half().float()
        y = y + act @ marlin.dequantize(w.w2[e], w.w2_scale[e], inter, hid, w.group_size)
    return y, h.reshape(1, hid), ids.to(torch.int32), wts
