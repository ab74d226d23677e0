"""W4A16 MoE on Marlin-packed INT4 experts in CUDA (`kernels/moe_marlin.cu`), the weights as the
mma's 16-row A operand and up to 8 tokens of one expert as its 8-column B operand, so 1-8
tokens an expert waste no tensor-core rows.

`fused_moe_marlin(x, topk_ids, topk_weights, w)` computes what `kernels.moe.fused_moe_ref`
computes in three launches and no host syncs (CUDA-graph safe):

1. `moe_plan` (one program): the T*k assignments sorted by expert, each expert padded to
   blocks of CH = 8*NG rows; the number of blocks stays on the GPU;
2. `moe_w13`: one work item a (block, 64 gate + 64 up rows, K split), taken by the warps of
   a persistent grid; SiLU(gate) * up in the epilogue (a split-K item's partials are summed,
   in split order, by the last split to finish);
3. `moe_w2`: one work item a (block, 64*w2b output columns); each row times its top-k weight,
   and the last of a token's k items sums its k rows in slot order and writes bf16.

`plan_ref` is the planning in torch (runs on the CPU) and `work_split` the host's choice of
tiles; `tiles_for` picks them by tokens per expert (TILES), `fits` says whether a call
qualifies (CUDA sm_90+, bf16 x, group size a multiple of 32 with at least two groups, H a
multiple of 128, I of 64, at most 1024 experts).
"""
from __future__ import annotations

import functools

import torch

from ddbench.kernels import pdl, ticket

MAXE = 1024            # experts the planning program takes (one thread each)
VECTOR = 16            # bytes of one cp.async copy; a stage is counted in these
MAX_SPLITS = 32
# (max tokens per expert T*k/E, NG 8-token groups an item, STAGES, WARPS a program, W2B w2's
# 64-column Marlin blocks an item, SPLITS); first match.
# H200, K2.6 TP-8 shard, uniform, CUDA graphs (scripts/gpu/moe_marlin_check.py, whole layer, us,
# NG 1/2/4): T=64 338/374/658, T=128 436/429/780, T=512 755/670/959, T=2048 2372/1829/1988,
# T=4096 4468/3367/3379; w2b 1/2/4 at NG 1: T=2 32.4/33.8/37.2, T=8 69.4/71.8/75.6, T=64
# 340.5/335.2/351.9 (moe_marlin_check_w2_blocks.csv). Stages 4/5 at NG 2 (H100, after the
# ldmatrix stage layout): T=16 144.2/141.8, T=64 362.8/364.0, T=128 460.8/431.8, T=256
# 521.3/494.7, T=512 615.3/644.5. SPLITS: w13's K splits, 0 = work_split's count; 1 vs 2 at NG 2,
# 4 stages (H100, 2026-12-07, experiments/results/moe_crossover_check_h100_20261207-1516.csv,
# moe_marlin_check_h100_20261207-1514_splits.csv): T=384 570.3/555.2, 448 594.2/573.1, 512
# 619.8/598.1 (3 and 4 splits slower: 629.7, 656.5), 576 653.4/664.2; T=256 at 5 stages 495.9/516.2.
# Above 8 an expert (H100, 2026-12-07 16:49, moe_crossover_check_h100_20261207-1649_stages.csv),
# 1 split 5 stages / 2 splits 3 stages / 2 splits 4 stages: T=448 536.5/550.4/558.5, 480
# 555.4/558.5/570.2, 512 630.0/566.9/581.9, 544 649.4/600.9/618.5, 640 682.3/654.0/676.8.
# NG 1 4 stages / NG 2 5 stages from 0.9 an expert (H200, 2026-12-07 17:55, after the ldmatrix
# layout, moe_crossover_check_h200_20261207-1755_ng.csv): T=40 235.4/259.9, 48 275.2/266.5, 64
# 305.9/280.9, 80 357.2/299.0, 96 367.7/314.6; e2e c=10 budget 8 (T=90) verify MoE 22.7 -> 19.2 ms.
TILES: list[tuple[float, int, int, int, int, int]] = [
    (0.17, 1, 4, 4, 1, 0),
    (0.9, 1, 4, 4, 2, 0),
    (10.0, 2, 5, 4, 2, 0),
    (float("inf"), 2, 3, 4, 2, 2),
]


def fits(x: torch.Tensor, topk_ids: torch.Tensor, w) -> bool:
    """Whether `fused_moe_marlin` takes these arguments."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == w.hidden
            and torch.cuda.get_device_capability(x.device) >= (9, 0) and shapes_ok(w)
            and topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0])


def shapes_ok(w) -> bool:
    """The shape conditions of `fits` on the experts w: group a multiple of 32 with at least two
    groups a column, H a multiple of 128, I of 64, at most MAXE experts (the planning)."""
    return (w.group_size % 32 == 0 and w.inter // w.group_size >= 2 and w.hidden // w.group_size >= 2
            and w.hidden % 128 == 0 and w.inter % 64 == 0 and w.n_experts <= MAXE)


def tile_name(tiles: dict) -> str:
    """The tile string result files record, e.g. 'ng2s4w4k1b2'."""
    return "ng{ng}s{stages}w{warps}k{splits}b{w2b}".format(**tiles)


def tiles_for(tokens: int, top_k: int, n_experts: int, table: list | None = None) -> dict:
    """{"ng", "stages", "warps", "w2b"[, "splits"]} of the first TILES row whose bound holds T*k/E
    ("splits" where the row names a count; resolve_tiles fills in work_split's otherwise)."""
    per_expert = tokens * top_k / n_experts
    _, ng, stages, warps, w2b, splits = next(r for r in (table or TILES) if per_expert <= r[0])
    return {"ng": ng, "stages": stages, "warps": warps, "w2b": w2b} | ({"splits": splits} if splits else {})


def shared_bytes(tiles: dict, kernel: str = "moe_w13") -> int:
    """A program's ring: warps x stages x (72 vectors a Marlin block (w13: 2, w2: w2b): 2 k-tiles
    of 32 lanes' words + 8 of scales; + 32 a group of 8 tokens) x 16 bytes."""
    blocks = 2 if kernel == "moe_w13" else tiles["w2b"]
    return tiles["warps"] * tiles["stages"] * (72 * blocks + 32 * tiles["ng"]) * VECTOR


def max_blocks(assignments: int, n_experts: int, ch: int) -> int:
    """Bound on the padded blocks of `assignments` rows over n_experts: cdiv(n, CH) + min(E, n)."""
    return -(-assignments // ch) + min(n_experts, assignments)


def work_split(tokens: int, top_k: int, n_experts: int, inter: int, hidden: int, warps_total: int) -> int:
    """w13's K splits: enough items (blocks touched at most min(E, T*k), I/64 row pairs each)
    for every warp of the grid, at most MAX_SPLITS and at most one split per 32-row stage pair."""
    items = min(n_experts, tokens * top_k) * (inter // 64)
    return max(1, min(MAX_SPLITS, hidden // 64, warps_total // items))


def plan_ref(topk_ids: torch.Tensor, n_experts: int, ch: int):
    """The planning in torch, any device: (sorted int32 `[max_blocks*CH]` (assignment t*k + j,
    ascending within an expert; -1 in padding), block_expert, block_rows int32 `[max_blocks]`
    (-1 / 0 past the last block), n_blocks int32 `[1]`). The CUDA `moe_plan` writes the same
    except the order of assignments inside an expert (any) and the padding (unwritten)."""
    ids = topk_ids.reshape(-1).long()
    n = ids.numel()
    nmax = max_blocks(n, n_experts, ch)
    counts = torch.bincount(ids, minlength=n_experts)
    nblk = (counts + ch - 1) // ch
    first = torch.cumsum(nblk, 0) - nblk                                   # [E] first block
    order = torch.argsort(ids, stable=True)
    rank = torch.arange(n, device=ids.device) - (torch.cumsum(counts, 0) - counts)[ids[order]]
    sorted_ids = torch.full((nmax * ch,), -1, dtype=torch.int32, device=ids.device)
    sorted_ids[first[ids[order]] * ch + rank] = order.to(torch.int32)
    total = int(nblk.sum())
    blk_expert = torch.repeat_interleave(torch.arange(n_experts, device=ids.device), nblk)
    within = torch.arange(total, device=ids.device) - first[blk_expert]
    block_expert = torch.full((nmax,), -1, dtype=torch.int32, device=ids.device)
    block_rows = torch.zeros(nmax, dtype=torch.int32, device=ids.device)
    block_expert[:total] = blk_expert.to(torch.int32)
    block_rows[:total] = torch.clamp(counts[blk_expert] - within * ch, max=ch).to(torch.int32)
    return sorted_ids, block_expert, block_rows, torch.tensor([total], dtype=torch.int32, device=ids.device)


def nibble_pairs(word: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Each lane's four nibble pairs (i, i + 4), i = 0..3, of its Marlin word (int32 `[32]`):
    what the kernels' LOP3 of q >> 4i makes of it, before any fragment mapping."""
    w = word.to(torch.int64) & 0xFFFFFFFF
    return [[(int(w[lane] >> (4 * i)) & 0xF, int(w[lane] >> (16 + 4 * i)) & 0xF) for i in range(4)] for lane in range(32)]


def emulate_a_fragment(word: torch.Tensor) -> torch.Tensor:
    """The kernel's dequant of one lane's Marlin words (int32 `[32]`, lanes 4g + t) read back as
    the 16x16 A matrix (rows n, columns k) of m16n8k16 by PTX's fragment layout (values q, no
    zero point): the CPU check that the A-operand mapping in moe_marlin.cu is the tile's
    transpose."""
    a = torch.zeros(16, 16, dtype=torch.int64)
    for lane, p in enumerate(nibble_pairs(word)):
        g, t = lane // 4, lane % 4
        regs = [p[0], p[2], p[1], p[3]]                                      # a0a1, a2a3, a4a5, a6a7
        for r, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            a[row, col], a[row, col + 1] = regs[r]
    return a


# ---------------------------------------------------------------- the CUDA launches

@functools.lru_cache(maxsize=None)
def _kernel(name: str, ng: int, stages: int, warps: int, group: int, hidden: int, inter: int, top_k: int,
            device: torch.device, w2b: int = 2):
    from ddbench.kernels.cuda import Kernel
    return Kernel("moe_marlin.cu", name, {"NG": ng, "STAGES": stages, "WARPS": warps, "G": group, "H": hidden,
                                          "I": inter, "TOPK": top_k, "W2B": w2b}, device)


@functools.lru_cache(maxsize=None)
def _grid(name: str, tiles: tuple, group: int, hidden: int, inter: int, top_k: int, device: torch.device) -> int:
    from ddbench.kernels.cuda import occupancy

    t = dict(tiles)
    k = _kernel(name, t["ng"], t["stages"], t["warps"], group, hidden, inter, top_k, device, t["w2b"])
    per_sm = occupancy(k, 32 * t["warps"], shared_bytes(t, name))
    if per_sm < 1:
        raise ValueError(f"moe_marlin: tiles {t} do not fit one SM")
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def _key(tiles: dict) -> tuple:
    return tuple((k, tiles[k]) for k in ("ng", "stages", "warps", "w2b"))


def tickets(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 ticket counters of the marlin kernels: w13's split sums and w2's k sums (the
    kernels of one MoE call never run at the same time, so they share one key). 4 MB covers w2
    at T = 9362 (K2.6 TP-8, 112 tickets a token), so graphs captured first rarely grow it."""
    return ticket.counters(device, "moe_marlin", n, size=1 << 20)


def resolve_tiles(tokens: int, top_k: int, w, device: torch.device, tiles: dict | None = None) -> dict:
    """The full tile dict a call runs: tiles_for's (or `tiles`'), plus w13's `splits`."""
    t = dict(tiles or tiles_for(tokens, top_k, w.n_experts))
    t.setdefault("w2b", 2)
    if t["w2b"] not in (1, 2, 4) or w.hidden % (64 * t["w2b"]):
        raise ValueError(f"moe_marlin: w2b {t['w2b']} must be 1, 2 or 4 and divide H/64 = {w.hidden // 64}")
    grid = _grid("moe_w13", _key(t), w.group_size, w.hidden,
                 w.inter, top_k, device)
    t.setdefault("splits", work_split(tokens, top_k, w.n_experts, w.inter, w.hidden, grid * t["warps"]))
    return t


def plan(topk_ids: torch.Tensor, n_experts: int, ch: int, pdl_mode: int = 2):
    """The CUDA planning: as `plan_ref` (one launch, no host sync; PDL mode as kernels.pdl.on)."""
    if n_experts > MAXE:
        raise ValueError(f"moe_marlin plans at most {MAXE} experts, got {n_experts}")
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    n, dev = ids.numel(), ids.device
    nmax = max_blocks(n, n_experts, ch)
    sorted_ids = torch.empty(nmax * ch, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nmax, dtype=torch.int32, device=dev)
    block_rows = torch.empty(nmax, dtype=torch.int32, device=dev)
    n_blocks = torch.empty(1, dtype=torch.int32, device=dev)
    # the plan program's CH is NG's; any NG with 8*NG = ch compiles it (G, H, I, TOPK unused there)
    mode = pdl.on(ids, pdl_mode)
    _kernel("moe_plan", ch // 8, 2, 1, 32, 128, 64, 1, dev)(1, 1024, 0, [ids, n, n_experts, sorted_ids, block_expert,
                                                                        block_rows, n_blocks, mode], pdl=mode > 0)
    return sorted_ids, block_expert, block_rows, n_blocks


def marlin_w13(x: torch.Tensor, routing: tuple, top_k: int, w, tiles: dict, pdl_mode: int = 2) -> torch.Tensor:
    """The w13 GEMM alone (routing from `plan` with CH = 8*tiles['ng']): x bf16 `[T, H]` ->
    SiLU(gate)*up bf16 `[rows, I]` in the plan's sorted rows."""
    sorted_ids, block_expert, block_rows, n_blocks = routing
    h, i, dev = w.hidden, w.inter, x.device
    splits = tiles["splits"]
    rows = sorted_ids.numel()
    act = torch.empty(rows, i, dtype=torch.bfloat16, device=dev)
    part = torch.empty(splits * rows * 2 * i if splits > 1 else 1, dtype=torch.float32, device=dev)
    tk = tickets(dev, block_expert.numel() * (i // 64))
    key = _key(tiles)
    k = _kernel("moe_w13", tiles["ng"], tiles["stages"], tiles["warps"], w.group_size, h, i, top_k, dev, tiles["w2b"])
    grid = _grid("moe_w13", key, w.group_size, h, i, top_k, dev)
    mode = pdl.on(x, pdl_mode)
    k(grid, 32 * tiles["warps"], shared_bytes(tiles, "moe_w13"),
      [x.contiguous(), w.w13, w.w13_scale, sorted_ids, block_expert, block_rows, n_blocks, splits, rows, part, tk, act,
       mode], pdl=mode > 0)
    return act


def marlin_w2(act: torch.Tensor, routing: tuple, topk_weights: torch.Tensor, w, tiles: dict,
              pdl_mode: int = 2) -> torch.Tensor:
    """The w2 GEMM alone, top-k weights and the sum over k included: `marlin_w13`'s output ->
    bf16 `[T, H]`."""
    sorted_ids, block_expert, block_rows, n_blocks = routing
    t, top_k = topk_weights.shape
    h, i, dev = w.hidden, w.inter, act.device
    out = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
    ypart = torch.empty(t * top_k, h, dtype=torch.bfloat16, device=dev)   # each slot's weighted row
    tk = tickets(dev, t * (h // (64 * tiles["w2b"])))
    key = _key(tiles)
    k = _kernel("moe_w2", tiles["ng"], tiles["stages"], tiles["warps"], w.group_size, h, i, top_k, dev, tiles["w2b"])
    grid = _grid("moe_w2", key, w.group_size, h, i, top_k, dev)
    mode = pdl.on(act, pdl_mode)
    k(grid, 32 * tiles["warps"], shared_bytes(tiles, "moe_w2"),
      [act, w.w2, w.w2_scale, sorted_ids, block_expert, block_rows, n_blocks,
       topk_weights.reshape(-1).float().contiguous(), ypart, tk, out, mode], pdl=mode > 0)
    return out


def fused_moe_marlin(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w,
                     tiles: dict | None = None, pdl_mode: int = 2) -> torch.Tensor:
    """x bf16 `[T, H]`, routing `[T, k]`, `MarlinMoE` -> bf16 `[T, H]` (as fused_moe_ref).
    pdl_mode: kernels.pdl's mode of the three launches (2: each may start while the one before
    ends; a GPU without PDL runs 0)."""
    if not fits(x, topk_ids, w):
        raise ValueError(f"moe_marlin does not take x {x.dtype} {tuple(x.shape)} on {x.device} with experts of "
                         f"H = {w.hidden}, I = {w.inter}, group {w.group_size} (kernels.moe_marlin.fits)")
    t = resolve_tiles(topk_ids.shape[0], topk_ids.shape[1], w, x.device, tiles)
    routing = plan(topk_ids, w.n_experts, 8 * t["ng"], pdl_mode)
    act = marlin_w13(x, routing, topk_ids.shape[1], w, t, pdl_mode)
    return marlin_w2(act, routing, topk_weights, w, t, pdl_mode)
