"""W4A16 MoE for many tokens an expert in CUDA (`kernels/moe_wide.cu`): the tokens as the mma's
16-row A operand (MT 16-row tiles a block, read with ldmatrix), the Marlin words as its
8-column B operand, so each dequantized word feeds 2*MT tensor-core products where
`moe_marlin` (weights as A, at most 16 tokens an item) feeds 2: the large-T path.

`fused_moe_wide(x, topk_ids, topk_weights, w)` computes what `kernels.moe.fused_moe_ref`
computes in four launches and no host syncs (CUDA-graph safe): `moe_marlin.plan` with blocks
of 16*MT rows, then `wide_w13` (one item a (block, 32*warps gate + up columns), SiLU(gate) * up
in the epilogue), `wide_w2` (one item a (block, 64*warps output columns); each row times its
top-k weight, written to its slot's row) and `wide_ksum` (each token's k rows summed in slot
order). A program of 4 or 8 warps (each launch its own count: TILES; 4 for both, measured)
streams its block's rows, words and scales a 32-row K stage at a time through one shared ring;
no K split. The weight is (q - 8) * scale rounded to bf16 once (moe_marlin keeps q - 8 exact and
scales the fp32 product): relative error ~4e-3 against the fp32 reference (moe_marlin's ~3e-3).

`tiles_for` picks MT, stages, warps and `minb` (the programs an SM the registers are capped
for: MT 2 at 4 takes 128 registers, so 16 warps an SM) by tokens per expert and the experts'
intermediate size (TILES); `fits` says whether a call qualifies.
"""
from __future__ import annotations

import functools

import torch

from ddbench.kernels import moe_marlin, pdl

WARPS = 8                 # the most warps a program (shapes_ok's bound); 4 or 8
# (max tokens per expert T*k/E, max I (the expert's intermediate dims on the rank, w2's K), MT
# 16-row tiles a block, STAGES, w13's warps a program, w2's, MINB); first match. H100, 2026-12-07,
# whole layer us (scripts/gpu/moe_marlin_check.py): MT 2 with registers capped for 4 programs an
# SM (MINB 4) wins only at the TP-8 shard's I = 256, whose w2 items are 8 K stages; from I = 512
# MT 4 does. T = 4096, MT 4 / MT 2 MINB 4: I = 256 2376 / 2253, 512 3997 / 4141, 1024 7124 / 7830,
# 2048 13669 / 15482 (experiments/results/moe_wide_check_h100_20261207-1634_inter.csv); at 16-32
# tokens an expert MT 2 beats MT 4 at I = 256 and 2048 alike (T = 1024: 752 / 891, 5159 / 5692;
# -1636_inter.csv).
TILES: list[tuple[float, float, int, int, int, int, int]] = [
    (32.0, float("inf"), 2, 4, 4, 4, 1),
    (64.0, float("inf"), 4, 4, 4, 4, 1),
    (float("inf"), 256, 2, 4, 4, 4, 4),
    (float("inf"), float("inf"), 4, 4, 4, 4, 1),
]


def fits(x: torch.Tensor, topk_ids: torch.Tensor, w) -> bool:
    """Whether `fused_moe_wide` takes these arguments (bf16 on sm_90+, shapes as `shapes_ok`)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == w.hidden
            and torch.cuda.get_device_capability(x.device) >= (9, 0) and shapes_ok(w)
            and topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0])


def shapes_ok(w) -> bool:
    """moe_marlin's shape conditions (its words, scales and planning), and I a multiple of
    32*WARPS (w13's chunk), H of 64*WARPS (w2's)."""
    return moe_marlin.shapes_ok(w) and w.inter % (32 * WARPS) == 0 and w.hidden % (64 * WARPS) == 0


def tile_name(tiles: dict) -> str:
    """The tile string result files record: 'mt4s4w8' (both launches 8 warps a program),
    'mt4s4w8v4' (w13 8, w2 4), 'mt2s4w4b4' (registers capped for 4 programs an SM)."""
    w2 = "" if tiles["w2_warps"] == tiles["warps"] else f"v{tiles['w2_warps']}"
    minb = f"b{tiles['minb']}" if tiles.get("minb", 1) > 1 else ""
    return "mt{mt}s{stages}w{warps}".format(**tiles) + w2 + minb


def tiles_for(tokens: int, top_k: int, n_experts: int, inter: int, table: list | None = None) -> dict:
    """{"mt", "stages", "warps", "w2_warps", "minb"} of the first TILES row whose bounds hold T*k/E
    and the experts' intermediate size `inter`."""
    per_expert = tokens * top_k / n_experts
    row = next(r for r in (table or TILES) if per_expert <= r[0] and inter <= r[1])
    _, _, mt, stages, warps, w2_warps, minb = row
    return {"mt": mt, "stages": stages, "warps": warps, "w2_warps": w2_warps, "minb": minb}


def shared_bytes(tiles: dict, warps: int | None = None) -> int:
    """The ring of a program of `warps` (w13's by default): stages x (x rows 16*MT x 64 bytes +
    words 64 vectors a warp + scales 8 a warp) x 16 bytes."""
    return tiles["stages"] * (64 * tiles["mt"] + 72 * (warps or tiles["warps"])) * moe_marlin.VECTOR


def emulate_b_fragments(word: torch.Tensor) -> torch.Tensor:
    """The kernel's dequant of one lane's Marlin words (int32 `[32]`, lanes 4g + t) read back as
    the two m16n8k16 B operands (k 16 x n 8, PTX's fragment layout: b0b1 = (k 2t, 2t+1; n g),
    b2b3 = (k 2t+8, 2t+9; n g)) side by side, values q: the CPU check that the words are the
    16x16 tile (k, n) as moe_wide.cu reads them."""
    b = torch.zeros(16, 16, dtype=torch.int64)
    for lane, p in enumerate(moe_marlin.nibble_pairs(word)):
        g, t = lane // 4, lane % 4
        for reg, (k, n) in enumerate([(2 * t, g), (2 * t + 8, g), (2 * t, g + 8), (2 * t + 8, g + 8)]):
            b[k, n], b[k + 1, n] = p[reg]
    return b


# ---------------------------------------------------------------- the CUDA launches

@functools.lru_cache(maxsize=None)
def _kernel(name: str, mt: int, stages: int, warps: int, minb: int, group: int, hidden: int, inter: int, top_k: int,
            device: torch.device):
    from ddbench.kernels.cuda import Kernel
    return Kernel("moe_wide.cu", name, {"MT": mt, "STAGES": stages, "WARPS": warps, "MINB": minb, "G": group,
                                        "H": hidden, "I": inter, "TOPK": top_k}, device)


@functools.lru_cache(maxsize=None)
def _grid(name: str, mt: int, stages: int, warps: int, minb: int, group: int, hidden: int, inter: int, top_k: int,
          device: torch.device) -> int:
    from ddbench.kernels.cuda import occupancy

    k = _kernel(name, mt, stages, warps, minb, group, hidden, inter, top_k, device)
    per_sm = occupancy(k, 32 * warps, shared_bytes({"mt": mt, "stages": stages}, warps))
    if per_sm < 1:
        raise ValueError(f"moe_wide: {name} with MT {mt}, {stages} stages, {warps} warps does not fit one SM")
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def resolve_tiles(tokens: int, top_k: int, w, tiles: dict | None = None) -> dict:
    """The tile dict a call runs: tiles_for's, or `tiles` ({"mt"[, "stages", "warps", "w2_warps",
    "minb"]}; stages 4, WARPS warps, w2's warps as w13's, minb 1 where not given)."""
    t = dict(tiles or tiles_for(tokens, top_k, w.n_experts, w.inter))
    t.setdefault("stages", 4)
    t.setdefault("warps", WARPS)
    t.setdefault("w2_warps", t["warps"])
    t.setdefault("minb", 1)
    if (t["mt"] not in (1, 2, 4) or not 2 <= t["stages"] <= 8 or {t["warps"], t["w2_warps"]} - {4, 8}
            or t["minb"] not in (1, 2, 3, 4)):
        raise ValueError(f"moe_wide: mt must be 1, 2 or 4, stages 2..8, warps 4 or 8 and minb 1..4, got {t}")
    return t


def _key(tiles: dict, warps: int, w, top_k: int, device: torch.device) -> tuple:
    """_kernel's and _grid's arguments after the name: one compile of moe_wide.cu serves every
    kernel of a launch with these."""
    return tiles["mt"], tiles["stages"], warps, tiles["minb"], w.group_size, w.hidden, w.inter, top_k, device


def _launch(name: str, tiles: dict, warps: int, w, top_k: int, device: torch.device, args: list, mode: int) -> None:
    key = _key(tiles, warps, w, top_k, device)
    _kernel(name, *key)(_grid(name, *key), 32 * warps, shared_bytes(tiles, warps), args + [mode], pdl=mode > 0)


def wide_w13(x: torch.Tensor, routing: tuple, top_k: int, w, tiles: dict, pdl_mode: int = 2) -> torch.Tensor:
    """The w13 GEMM alone (routing from moe_marlin.plan with CH = 16*tiles['mt']): x bf16
    `[T, H]` -> SiLU(gate)*up bf16 `[rows, I]` in the plan's sorted rows."""
    sorted_ids, block_expert, block_rows, n_blocks = routing
    act = torch.empty(sorted_ids.numel(), w.inter, dtype=torch.bfloat16, device=x.device)
    _launch("wide_w13", tiles, tiles["warps"], w, top_k, x.device,
            [x.contiguous(), w.w13, w.w13_scale, sorted_ids, block_expert, block_rows, n_blocks, act],
            pdl.on(x, pdl_mode))
    return act


def wide_w2(act: torch.Tensor, routing: tuple, topk_weights: torch.Tensor, w, tiles: dict,
            pdl_mode: int = 2) -> torch.Tensor:
    """The w2 GEMM alone, top-k weights and the sum over k (its own launch) included:
    `wide_w13`'s output -> bf16 `[T, H]`."""
    sorted_ids, block_expert, block_rows, n_blocks = routing
    t, top_k = topk_weights.shape
    h, dev = w.hidden, act.device
    out = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
    ypart = torch.empty(t * top_k, h, dtype=torch.bfloat16, device=dev)   # each slot's weighted row
    mode = pdl.on(act, pdl_mode)
    _launch("wide_w2", tiles, tiles["w2_warps"], w, top_k, dev,
            [act, w.w2, w.w2_scale, sorted_ids, block_expert, block_rows, n_blocks,
             topk_weights.reshape(-1).float().contiguous(), ypart], mode)
    ksum = _kernel("wide_ksum", *_key(tiles, tiles["w2_warps"], w, top_k, dev))   # wide_w2's compile
    ksum(-(-t * (h // 8) // 256), 256, 0, [ypart, out, t, mode], pdl=mode > 0)
    return out


def fused_moe_wide(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w,
                   tiles: dict | None = None, pdl_mode: int = 2) -> torch.Tensor:
    """x bf16 `[T, H]`, routing `[T, k]`, `MarlinMoE` -> bf16 `[T, H]` (as fused_moe_ref).
    pdl_mode: kernels.pdl's mode of the three launches."""
    if not fits(x, topk_ids, w):
        raise ValueError(f"moe_wide does not take x {x.dtype} {tuple(x.shape)} on {x.device} with experts of "
                         f"H = {w.hidden}, I = {w.inter}, group {w.group_size} (kernels.moe_wide.fits)")
    t = resolve_tiles(topk_ids.shape[0], topk_ids.shape[1], w, tiles)
    routing = moe_marlin.plan(topk_ids, w.n_experts, 16 * t["mt"], pdl_mode)
    act = wide_w13(x, routing, topk_ids.shape[1], w, t, pdl_mode)
    return wide_w2(act, routing, topk_weights, w, t, pdl_mode)
