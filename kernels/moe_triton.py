"""Fused INT4 W4A16 MoE in Triton, reading the Marlin layout directly (DESIGN §4).

`fused_moe_triton(x, topk_ids, topk_weights, w)` computes what `kernels.moe.fused_moe_ref`
computes, in six or seven launches and no host syncs (so the whole layer can be captured in a
CUDA graph):

1. memset of the per-expert counters;
2. `_count_kernel`: each (token, slot) assignment takes its rank inside its expert with an
   atomic increment;
3. `_scatter_kernel`: expert starts padded to BLOCK_M (an exclusive cumsum, redone by every
   program), the assignments scattered to their sorted position, and each BLOCK_M block of
   sorted rows told its expert (-1 past the end). Buffers are sized by the worst case
   `cdiv(T*k, BM) + min(E, T*k)` blocks, so no size ever comes back to the host;
4. `_w13_kernel`: per (row block, column tile, K split) the gate and up tiles of that
   block's expert, SiLU(gate) * up fused in the epilogue (or, with split-K, fp32 partial
   gate|up sums added atomically and the SiLU done by the next kernel as it loads them);
5. `_w2_kernel`: the down projection, each row scaled by its top-k weight, written per
   assignment and summed over the k slots by one `sum` (or added atomically into an fp32
   output: `atomic_out`).

Reading Marlin without the mma fragment: word `[kt, nb*128 + lane*4 + tile]` holds the 8
nibbles of lane `lane` (t = lane%4, g = lane//4) of the 16x16 tile at (16kt, 64nb + 16tile);
nibble i = 4*kodd + 2*bn + bk holds row 2t + kodd + 8bk, column g + 8bn. A K step of BK rows
loads the word tile as `[BK, BN/2]`, row r reading the word of (kt, t) = (r//16, (r%8)//2)
(each word is read by 4 rows; the repeats hit L1), so that shifting row r by
4*(4*(r%2) + 2*bn + (r%16)//8) gives the natural K order and the activation tile is a plain
`[BM, BK]` load. Column c of the word tile is (g, j) = (c // NJ, c % NJ) of the tile's
NJ = BN/16 sub-tiles, i.e. logical column 16j + g + 8bn: each GEMM makes two dots (bn = 0,
1) and stores them at those columns; scales are gathered at Marlin's permuted columns.
Dequantization, two variants: by default (q - 8) * scale is formed in fp32 with the magic
number 0x4B000000 (2^23 + q), cast to the activation dtype and accumulated by the dot;
with `acc_scale` (32-row steps, one group each) the operand is the exact 16-bit 128 + q
(bf16, q | 0x4300) or 1024 + q (fp16, q | 0x6400), the bias removed after the dot as
BIAS * rowsum(A) and the group scale applied to the `[BM, BN/2]` product.

Status (H200, docs/notes/moe.md): correct at every point (rel. error 3.8e-3 in bf16) and
40-439x faster than the torch reference, but only 21-25 % of the copy bandwidth at
16 <= T <= 512; the tile sweep says cost grows with per-CTA tile size (more warps, stages,
wider tiles all slower), which points at the layout conversion of the dequantized tile to
the dot operand, not at DRAM. `join=True` (each word loaded once, nibbles spread with
tl.join so each thread holds 4 consecutive K rows) halved the time and is the default where
it won (TILE_TABLE). The mma-fragment dequant is `kernels.moe_gemv`'s tensor-core loop (LOP3
on Marlin's words, which are the mma's B fragments as stored): with 16 sorted rows a block it
is 12-24 % faster than this kernel at T = 16-512 (CUDA graphs, 25-29 % of copy), so
TILE_TABLE sends those sizes there; this kernel runs above 10.7 tokens per expert.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ddbench.kernels.device import sm_count
from ddbench.kernels.moe_align import _block_rows, _scale_col, align_tokens

KMIN = 32  # K rows per sub-step: one scale group of 32 (group sizes must be multiples of it)
# operand kinds: fp32 (tests), fp16, bf16 -> magic-number bias left in the dequantized value
_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_BIAS = {0: 0.0, 1: 1032.0, 2: 136.0}


@dataclass(frozen=True)
class MoeTritonConfig:
    """Tile sizes and launch options (see `default_config`)."""
    block_m: int = 16       # sorted rows per program (also the alignment of each expert's rows)
    block_n13: int = 64     # gate (and up) columns per w13 program
    block_n2: int = 64      # output columns per w2 program
    block_k13: int = 128    # K rows per w13 loop step (a multiple of 32; lowered to divide H)
    block_k2: int = 128     # K rows per w2 loop step (lowered to divide I)
    acc_scale: bool = False  # 32-row steps, exact (q + bias) operands, scales on the products
    join: bool = False      # load each word once and spread its nibbles with tl.join
    split_k: int = 1        # K splits of w13 (fp32 atomics + SiLU in w2's load when > 1)
    atomic_out: bool = False  # w2 adds into an fp32 [T, H] instead of writing [T*k, H] + sum
    gemv: bool = False      # CUDA-core kernels (kernels.moe_gemv): block_m 1-16, block_n multiples of 64
    # the gemv path's options (each measured faster on the H200: docs/notes/moe.md)
    fuse_act: bool = True   # block_m 1: SiLU(gate) * up * weight in w13's last program per assignment
    mma: bool = True        # sorted row blocks (block_m > 1) through the tensor cores (else packed fp16)
    num_warps: int = 4
    num_stages: int = 3


# Tiles by tokens per expert (T*k/E): the first row whose bound is >= it applies.
# Fields as MoeTritonConfig; split_k is the heuristic's unless a row pins it. Chosen from
# the tile sweep on an H200 at the K2.6 TP-8 shard (results/h200/moe_tune_call2.csv,
# docs/notes/moe.md): 64-row K steps won at every T; 4 warps and 3 stages over 8 / 2 / 4.
# `join` (each word loaded once) then halved the time at T <= 512 (block_m 16) and won
# slightly at T = 4096, but lost at T = 1024-2048 with block_m 32 (3891 vs 3366 us,
# 7480 vs 6563 us): results/h200/moe_sweep_tp8_join.csv against moe_sweep_tp8.csv.
# kernels.moe_gemv, one row a block (packed fp16 dot), runs up to 0.3 per expert (T <= 14 at
# K2.6; decode c=10, T=10: 10.3 vs 17.4 ms, git show 101a95d:docs/BENCHMARKS.md); above, rows sorted by expert
# into blocks of 16 that it runs on the tensor cores, up to 10.7 per expert (T <= 512):
# `ddbench moe-sweep`, uniform routing, CUDA graphs, H200 2026-12-03 09:17
# (results/h200/moe_sweep_tp8_{default,gemv8,gemv16}-20261203-0917.csv), against this file's
# kernel (m16 join): T=16 365 -> 276 us, 32 597 -> 500, 64 872 -> 705, 128 1032 -> 903, 256
# 1129 -> 994, 512 1333 -> 1125; 8-row blocks 2-6 % faster than 16 at T = 32-256, slower at
# 16 and 512 (+7 % against m16 join), so 16 throughout. Up to 0.05 per expert (T <= 19 at
# K2.6: decode at c=1-2) w13 takes 512 columns a program: the c=1 decode step -27 / -26 us in
# two runs, c=10 +364 us (experiments/results/decode_variants_20261203-1907_w13_512.csv).
TILE_TABLE: list[tuple[float, dict]] = [
    (0.05, dict(gemv=True, block_m=1, block_n13=512, block_n2=256)),
    (0.3, dict(gemv=True, block_m=1, block_n13=256, block_n2=256)),
    (10.7, dict(gemv=True, block_m=16, block_n13=256, block_n2=256)),
    (42.7, dict(block_m=32, block_k13=64, block_k2=64)),
    (float("inf"), dict(block_m=64, block_k13=64, block_k2=64, join=True)),
]
# Calls whose tokens come several to a stream (a DDTree verify: a stream's tree nodes, which
# route to many of the same experts): up to `bound` tokens per expert, the CUDA-core path
# with the tokens sorted by expert into blocks of `rows` rows, which it runs on the tensor
# cores (kernels.moe_gemv `_mma_loop`: up to 16 rows for the cost of one), where one token a
# stream takes one row a block. (bound, rows), first match; beyond the last bound TILE_TABLE
# applies (16-row blocks up to 10.7 per expert); [] turns it off (read at each call). H200,
# `ddbench e2e` budget 8: c=1 (9 tokens a stream, 0.19 per expert) verify MoE 7609 us one row
# a block, 6434 with 8 rows, 6654 with 16; c=10 (1.9 per expert) 24419 us on the tl.dot
# path, 21973 with 8 rows, 20606 with 16 (docs/notes/e2e.md).
STREAM_TILES: list[tuple[float, int]] = [(0.3, 8)]


def default_config(tokens: int, top_k: int, n_experts: int, inter: int, hidden: int,
                   n_sms: int = 132, table: list | None = None, stream_rows: int = 1) -> MoeTritonConfig:
    """Tiles from `table` (default TILE_TABLE) by tokens per expert, narrowed to divide the
    shapes, and w13's K split while its grid would leave SMs idle. stream_rows: tokens a
    stream in this call (> 1: STREAM_TILES first)."""
    per_expert = tokens * top_k / n_experts
    rows = next((r for bound, r in STREAM_TILES if per_expert <= bound), 0) if stream_rows > 1 else 0
    if rows:  # TILE_TABLE's first row is the CUDA-core one
        fields = {**TILE_TABLE[0][1], "block_m": rows}
    else:
        fields = next(f for bound, f in (table or TILE_TABLE) if per_expert <= bound)
    cfg = replace(MoeTritonConfig(), **fields)
    if cfg.gemv:  # column tiles narrowed to divide 2I and H; K split from kernels.moe_gemv
        bn13, bn2 = cfg.block_n13, cfg.block_n2
        while (2 * inter) % bn13 and bn13 > 64:
            bn13 //= 2
        while hidden % bn2 and bn2 > 64:
            bn2 //= 2
        return replace(cfg, block_n13=bn13, block_n2=bn2, split_k=fields.get("split_k", 0))
    bn13 = cfg.block_n13
    while inter % bn13 and bn13 > 32:
        bn13 //= 2
    bn2 = cfg.block_n2
    while hidden % bn2 and bn2 > 32:
        bn2 //= 2
    bm = cfg.block_m
    blocks = min(n_experts, tokens * top_k) + tokens * top_k // bm
    programs = blocks * (inter // bn13)
    split = 1 if programs >= 2 * n_sms else min(8, -(-2 * n_sms // programs))
    if "split_k" in fields:  # a table may pin it
        split = fields["split_k"]
    return replace(cfg, block_n13=bn13, block_n2=bn2, split_k=split)


# ---------------------------------------------------------------- Marlin tile helpers

@triton.jit
def _tile_cols(n0, BN: tl.constexpr, VEC: tl.constexpr):
    """Word columns and logical columns (bn = 0; bn = 1 is +8) of the BN-wide tile at n0."""
    NJ: tl.constexpr = BN // 16
    c = tl.arange(0, BN // 2)
    g = c // NJ
    j16 = n0 // 16 + c % NJ                                  # 16-column tile index
    wcol = (j16 // 4) * 128 + g * 16 + j16 % 4               # word of lane (g, t=0)
    wcol = tl.max_contiguous(tl.multiple_of(wcol, VEC), VEC)
    return wcol, j16 * 16 + g


@triton.jit
def _as_operand(q, KIND: tl.constexpr):
    """Nibbles (int32 0..15) -> exact dot operand: fp32 q-8, or fp16 1024+q / bf16 128+q."""
    if KIND == 0:
        return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    elif KIND == 1:
        return (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        return (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _cast(a, KIND: tl.constexpr):
    if KIND == 0:
        return a.to(tl.float32)
    elif KIND == 1:
        return a.to(tl.float16)
    else:
        return a.to(tl.bfloat16)


@triton.jit
def _dot(a, b, KIND: tl.constexpr):
    if KIND == 0:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _join_nibbles(w, BN_SHIFT: tl.constexpr, BK: tl.constexpr, C: tl.constexpr):
    """Words `[BK/4, C]` (row = 4kt + t) -> nibbles `[BK, C]`, row 16kt + 4t + 2bk + kodd."""
    n00 = (w >> BN_SHIFT) & 0xF                                      # kodd 0, bk 0
    n01 = (w >> (BN_SHIFT + 4)) & 0xF                                # kodd 0, bk 1
    n10 = (w >> (BN_SHIFT + 16)) & 0xF                               # kodd 1, bk 0
    n11 = (w >> (BN_SHIFT + 20)) & 0xF                               # kodd 1, bk 1
    q = tl.join(tl.join(n00, n10), tl.join(n01, n11))                # [BK/4, C, kodd, bk]
    return tl.reshape(tl.permute(q, (0, 3, 2, 1)), (BK, C))          # [BK/4, bk, kodd, C] -> [BK, C]


@triton.jit
def _int4_step(a, acc0, acc1, w_ptrs, s_base, k0, stride_sg, GROUP, shift, n_lo,
               BK: tl.constexpr, C: tl.constexpr, ACC_SCALE: tl.constexpr,
               KIND: tl.constexpr, BIAS: tl.constexpr, PER_CHANNEL: tl.constexpr, JOIN: tl.constexpr):
    """One BK-row K step of one tile: acc0/acc1 `[BM, C]` (logical columns n_lo, n_lo + 8)
    += a `[BM, BK]` x the dequantized int4 words `[BK, C]` (row r shifted by shift[r]).

    ACC_SCALE (BK == 32, one group): exact (q + bias) operands, the bias removed as
    BIAS * rowsum(a) and the group scale applied to the `[BM, C]` product. Otherwise
    (any BK): (q - 8) * scale formed in fp32, cast to a's dtype and accumulated by the dot.
    JOIN: each word loaded once (`[BK/4, C]`) and its nibbles spread over 4 rows with
    tl.join (K rows in the order `_k_order` gives, which the caller's A load follows).
    """
    w = tl.load(w_ptrs)                                              # [BK, C] or [BK/4, C] int32
    if JOIN:
        q0 = _join_nibbles(w, 0, BK, C)
        q1 = _join_nibbles(w, 8, BK, C)
    else:
        q0 = (w >> shift[:, None]) & 0xF
        q1 = (w >> (shift[:, None] + 8)) & 0xF
    sc0 = _scale_col(n_lo, PER_CHANNEL)
    sc1 = _scale_col(n_lo + 8, PER_CHANNEL)
    if ACC_SCALE:
        s_row = s_base + (k0 // GROUP) * stride_sg
        s0 = tl.load(s_row + sc0).to(tl.float32)                     # [C]
        s1 = tl.load(s_row + sc1).to(tl.float32)
        a_bias = BIAS * tl.sum(a.to(tl.float32), 1)[:, None]         # [BM, 1]
        acc0 += (_dot(a, _as_operand(q0, KIND), KIND) - a_bias) * s0[None, :]
        acc1 += (_dot(a, _as_operand(q1, KIND), KIND) - a_bias) * s1[None, :]
    else:
        NG: tl.constexpr = BK // 32
        s_rows = s_base + ((k0 + 32 * tl.arange(0, NG)) // GROUP)[:, None] * stride_sg   # [NG, 1]
        s0 = tl.load(s_rows + sc0[None, :]).to(tl.float32)           # [NG, C]
        s1 = tl.load(s_rows + sc1[None, :]).to(tl.float32)
        s0 = tl.reshape(tl.broadcast_to(s0[:, None, :], (NG, 32, C)), (BK, C))
        s1 = tl.reshape(tl.broadcast_to(s1[:, None, :], (NG, 32, C)), (BK, C))
        b0 = _cast(((q0 | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0) * s0, KIND)
        b1 = _cast(((q1 | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0) * s1, KIND)
        acc0 = _dot_acc(a, b0, acc0, KIND)
        acc1 = _dot_acc(a, b1, acc1, KIND)
    return acc0, acc1


@triton.jit
def _dot_acc(a, b, acc, KIND: tl.constexpr):
    if KIND == 0:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _k_layout(stride_wk, BK: tl.constexpr, JOIN: tl.constexpr):
    """How a BK-row K step reads the words -> (shift `[BK]`: nibble of row r for bn = 0,
    wrow: word-row offsets, `[BK/4]` with JOIN else `[BK]`, kcol `[BK]`: the K row each
    operand row holds, which the A load follows)."""
    r = tl.arange(0, BK)
    shift = 16 * (r % 2) + 4 * ((r % 16) // 8)
    if JOIN:  # one row per word (kt, t); B rows come out as 16kt + 4t + 2bk + kodd
        rw = tl.arange(0, BK // 4)
        wrow = (rw // 4) * stride_wk + (rw % 4) * 4
        kcol = (r // 16) * 16 + ((r // 2) % 2) * 8 + ((r // 4) % 4) * 2 + r % 2
    else:     # row r reads the word of (kt, t) = (r // 16, (r % 8) // 2): natural K order
        wrow = (r // 16) * stride_wk + ((r % 8) // 2) * 4
        kcol = r
    return shift, wrow, kcol


# ---------------------------------------------------------------- GEMM kernels

@triton.jit
def _w13_kernel(
    # in: activations x [T, H], w13 int32 [E, H/16, 4I], scales [E, H/g, 2I]
    x_ptr, w_ptr, s_ptr,
    # routing from align_tokens
    sorted_ptr, block_expert_ptr, expert_start_ptr, counts_ptr,
    # out: act [T*k, I], or with SPLIT (K split over programs) fp32 gate|up [T*k, 2I] added atomically
    out_ptr,
    # strides (elements)
    stride_x, stride_we, stride_wk, stride_se, stride_sg, stride_o,
    # sizes
    I, TOP_K, GROUP, K_STEPS, STEPS_PER_SPLIT,
    # meta
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, ACC_SCALE: tl.constexpr,
    JOIN: tl.constexpr,
    VEC_G: tl.constexpr, VEC_U: tl.constexpr, KIND: tl.constexpr, BIAS: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
):
    e, assign, valid = _block_rows(block_expert_ptr, expert_start_ptr, counts_ptr, sorted_ptr, BM, tl.arange(0, BM))
    if e < 0:
        return
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    a_rows = x_ptr + (assign // TOP_K).to(tl.int64) * stride_x      # [BM]
    shift, wrow, kcol = _k_layout(stride_wk, BK, JOIN)
    n0 = pid_n * BN
    wcol_g, n_g = _tile_cols(n0, BN, VEC_G)
    wcol_u, n_u = _tile_cols(n0 + I, BN, VEC_U)
    w_e = w_ptr + e.to(tl.int64) * stride_we
    s_e = s_ptr + e.to(tl.int64) * stride_se
    g0 = tl.zeros((BM, BN // 2), tl.float32)
    g1 = tl.zeros((BM, BN // 2), tl.float32)
    u0 = tl.zeros((BM, BN // 2), tl.float32)
    u1 = tl.zeros((BM, BN // 2), tl.float32)
    k_first = pid_k * STEPS_PER_SPLIT
    k_last = tl.minimum(K_STEPS, k_first + STEPS_PER_SPLIT)
    for ks in range(k_first, k_last):
        k0 = ks * BK
        a = _cast(tl.load(a_rows[:, None] + (k0 + kcol)[None, :], mask=valid[:, None], other=0.0), KIND)
        w_k = w_e + (k0 // 16) * stride_wk + wrow[:, None]          # [BK, 1]
        g0, g1 = _int4_step(a, g0, g1, w_k + wcol_g[None, :], s_e, k0, stride_sg, GROUP, shift, n_g,
                            BK, BN // 2, ACC_SCALE, KIND, BIAS, PER_CHANNEL, JOIN)
        u0, u1 = _int4_step(a, u0, u1, w_k + wcol_u[None, :], s_e, k0, stride_sg, GROUP, shift, n_u,
                            BK, BN // 2, ACC_SCALE, KIND, BIAS, PER_CHANNEL, JOIN)
    rows = out_ptr + assign.to(tl.int64)[:, None] * stride_o
    if not SPLIT:  # SiLU(gate) * up, stored at logical columns n_g, n_g + 8
        act0 = g0 / (1.0 + tl.exp(-g0)) * u0
        act1 = g1 / (1.0 + tl.exp(-g1)) * u1
        tl.store(rows + n_g[None, :], act0.to(out_ptr.dtype.element_ty), mask=valid[:, None])
        tl.store(rows + (n_g + 8)[None, :], act1.to(out_ptr.dtype.element_ty), mask=valid[:, None])
    else:
        tl.atomic_add(rows + n_g[None, :], g0, mask=valid[:, None])
        tl.atomic_add(rows + (n_g + 8)[None, :], g1, mask=valid[:, None])
        tl.atomic_add(rows + n_u[None, :], u0, mask=valid[:, None])
        tl.atomic_add(rows + (n_u + 8)[None, :], u1, mask=valid[:, None])


@triton.jit
def _w2_kernel(
    # in: act [T*k, I] or fp32 gate|up [T*k, 2I] (GATED), w2 int32 [E, I/16, 2H], scales [E, I/g, H]
    a_ptr, w_ptr, s_ptr,
    # routing from align_tokens, top-k weights fp32 [T*k]
    sorted_ptr, block_expert_ptr, expert_start_ptr, counts_ptr, topk_w_ptr,
    # out: y [T*k, H] (weighted, per assignment) or fp32 [T, H] (ATOMIC: summed over k)
    out_ptr,
    # strides (elements)
    stride_a, stride_we, stride_wk, stride_se, stride_sg, stride_o,
    # sizes
    I, TOP_K, GROUP, K_STEPS,
    # meta
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACC_SCALE: tl.constexpr, JOIN: tl.constexpr,
    GATED: tl.constexpr, ATOMIC: tl.constexpr,
    VEC: tl.constexpr, KIND: tl.constexpr, BIAS: tl.constexpr, PER_CHANNEL: tl.constexpr,
):
    e, assign, valid = _block_rows(block_expert_ptr, expert_start_ptr, counts_ptr, sorted_ptr, BM, tl.arange(0, BM))
    if e < 0:
        return
    pid_n = tl.program_id(1)
    a_rows = a_ptr + assign.to(tl.int64) * stride_a                 # [BM]
    shift, wrow, kcol = _k_layout(stride_wk, BK, JOIN)
    wcol, n_lo = _tile_cols(pid_n * BN, BN, VEC)
    w_e = w_ptr + e.to(tl.int64) * stride_we
    s_e = s_ptr + e.to(tl.int64) * stride_se
    acc0 = tl.zeros((BM, BN // 2), tl.float32)
    acc1 = tl.zeros((BM, BN // 2), tl.float32)
    for ks in range(0, K_STEPS):
        k0 = ks * BK
        a_ptrs = a_rows[:, None] + (k0 + kcol)[None, :]
        if GATED:  # SiLU(gate) * up from w13's fp32 split-K sums
            gate = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            up = tl.load(a_ptrs + I, mask=valid[:, None], other=0.0)
            a = _cast(gate / (1.0 + tl.exp(-gate)) * up, KIND)
        else:
            a = _cast(tl.load(a_ptrs, mask=valid[:, None], other=0.0), KIND)
        w_k = w_e + (k0 // 16) * stride_wk + wrow[:, None]
        acc0, acc1 = _int4_step(a, acc0, acc1, w_k + wcol[None, :], s_e, k0, stride_sg, GROUP, shift, n_lo,
                                BK, BN // 2, ACC_SCALE, KIND, BIAS, PER_CHANNEL, JOIN)
    wt = tl.load(topk_w_ptr + assign, mask=valid, other=0.0).to(tl.float32)[:, None]
    if ATOMIC:
        rows = out_ptr + (assign // TOP_K).to(tl.int64)[:, None] * stride_o
        tl.atomic_add(rows + n_lo[None, :], acc0 * wt, mask=valid[:, None])
        tl.atomic_add(rows + (n_lo + 8)[None, :], acc1 * wt, mask=valid[:, None])
    else:
        rows = out_ptr + assign.to(tl.int64)[:, None] * stride_o
        ty = out_ptr.dtype.element_ty
        tl.store(rows + n_lo[None, :], (acc0 * wt).to(ty), mask=valid[:, None])
        tl.store(rows + (n_lo + 8)[None, :], (acc1 * wt).to(ty), mask=valid[:, None])


# ---------------------------------------------------------------- wrapper

def _vec(n0_align: int, bn: int) -> int:
    """Contiguous words per run in a tile whose first column is a multiple of n0_align."""
    run = min(bn // 16, 4)
    while run > 1 and n0_align % (16 * run):
        run //= 2
    return run


def _fit_bk(cfg: MoeTritonConfig, k: int, bk: int) -> int:
    """The K step actually used: 32 with acc_scale, else bk halved until it divides K."""
    if cfg.acc_scale:
        return KMIN
    while k % bk:
        bk //= 2
    return bk


def check_inputs(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w, cfg: MoeTritonConfig):
    """Raise ValueError on shapes, dtypes or tiles the kernels do not handle."""
    if x.dim() != 2 or x.shape[1] != w.hidden:
        raise ValueError(f"x must be [T, {w.hidden}], got {tuple(x.shape)}")
    if x.dtype not in _KIND:
        raise ValueError(f"x dtype {x.dtype} not supported (bf16, fp16 or fp32)")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids/topk_weights must be [T, k] with T = {x.shape[0]}")
    if w.group_size % KMIN:
        raise ValueError(f"group size {w.group_size} is not a multiple of {KMIN}")
    h, i = w.hidden, w.inter
    if i % KMIN or h % KMIN:
        raise ValueError(f"hidden {h} and intermediate {i} must be multiples of {KMIN}")
    for name, bk in [("block_k13", cfg.block_k13), ("block_k2", cfg.block_k2)]:
        if bk < KMIN or bk & (bk - 1):
            raise ValueError(f"{name}={bk} must be a power of two >= {KMIN}")
    if cfg.gemv:
        if not 1 <= cfg.block_m <= 16 or cfg.block_m & (cfg.block_m - 1):
            raise ValueError(f"block_m {cfg.block_m} must be a power of two in 1..16 with gemv")
        for name, bn, n in [("block_n13", cfg.block_n13, 2 * i), ("block_n2", cfg.block_n2, h)]:
            if bn < 64 or bn & (bn - 1) or n % bn:
                raise ValueError(f"{name}={bn} must be a power of two >= 64 dividing {n} with gemv")
        return
    if cfg.block_m < 16 or cfg.block_m & (cfg.block_m - 1):
        raise ValueError(f"block_m {cfg.block_m} must be a power of two >= 16")
    for name, bn, n in [("block_n13", cfg.block_n13, i), ("block_n2", cfg.block_n2, h)]:
        if bn < 32 or bn & (bn - 1) or n % bn:
            raise ValueError(f"{name}={bn} must be a power of two >= 32 dividing {n}")


def fused_moe_triton(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w,
                     config: MoeTritonConfig | None = None) -> torch.Tensor:
    """Triton INT4 MoE on Marlin weights: x `[T, H]`, routing `[T, k]`, `MarlinMoE` -> `[T, H]`.

    Same maths as `kernels.moe.fused_moe_ref`; fp32 accumulation, intermediate
    activations in x's dtype (fp32 when w13 is split over K). No host syncs.
    """
    cfg = config or default_config(topk_ids.shape[0], topk_ids.shape[1], w.n_experts, w.inter,
                                   w.hidden, sm_count(x.device))
    check_inputs(x, topk_ids, topk_weights, w, cfg)
    if cfg.gemv:
        from ddbench.kernels.moe_gemv import fused_moe_gemv
        return fused_moe_gemv(x, topk_ids, topk_weights, w, cfg, sm_count(x.device))
    routing = align_tokens(topk_ids, w.n_experts, cfg.block_m)
    mid = triton_w13(x, routing, topk_ids.shape[1], w, cfg)
    return triton_w2(mid, routing, topk_weights, w, cfg, x.dtype)


def _meta(dtype: torch.dtype, cfg: MoeTritonConfig) -> dict:
    kind = _KIND[dtype]
    return dict(KIND=kind, BIAS=_BIAS[kind], num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def triton_w13(x: torch.Tensor, routing: tuple, top_k: int, w, cfg: MoeTritonConfig) -> torch.Tensor:
    """The w13 GEMM alone (routing from `align_tokens` with cfg.block_m): x `[T, H]` ->
    SiLU(gate)*up `[T*k, I]` in x's dtype, or with split-K fp32 gate|up sums `[T*k, 2I]`."""
    t, h, i = x.shape[0], w.hidden, w.inter
    x = x.contiguous()
    n_blocks = routing[1].numel()
    bk = _fit_bk(cfg, h, cfg.block_k13)
    k_steps = h // bk
    per_split = triton.cdiv(k_steps, max(1, min(cfg.split_k, k_steps)))
    split = triton.cdiv(k_steps, per_split)
    if split == 1:
        mid = torch.empty(t * top_k, i, dtype=x.dtype, device=x.device)
    else:
        mid = torch.zeros(t * top_k, 2 * i, dtype=torch.float32, device=x.device)
    w13, s13 = w.w13, w.w13_scale
    _w13_kernel[(n_blocks, i // cfg.block_n13, split)](
        x, w13, s13, *routing, mid,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), mid.stride(0),
        i, top_k, w.group_size, k_steps, per_split,
        BM=cfg.block_m, BN=cfg.block_n13, BK=bk, SPLIT=split > 1, ACC_SCALE=cfg.acc_scale, JOIN=cfg.join,
        VEC_G=_vec(cfg.block_n13, cfg.block_n13), VEC_U=_vec(i, cfg.block_n13),
        PER_CHANNEL=h == w.group_size, **_meta(x.dtype, cfg))
    return mid


def triton_w2(mid: torch.Tensor, routing: tuple, topk_weights: torch.Tensor, w,
              cfg: MoeTritonConfig, dtype: torch.dtype) -> torch.Tensor:
    """The w2 GEMM alone, top-k weights and the sum over k included: `triton_w13`'s output
    -> `[T, H]` in `dtype` (x's dtype)."""
    t, k = topk_weights.shape
    h, i = w.hidden, w.inter
    gated = mid.shape[1] == 2 * i                 # fp32 gate|up sums from a split-K w13
    n_blocks = routing[1].numel()
    bk = _fit_bk(cfg, i, cfg.block_k2)
    w2, s2 = w.w2, w.w2_scale
    tw = topk_weights.reshape(-1).float().contiguous()
    if cfg.atomic_out:
        y = torch.zeros(t, h, dtype=torch.float32, device=mid.device)
    else:
        y = torch.empty(t * k, h, dtype=dtype, device=mid.device)
    _w2_kernel[(n_blocks, h // cfg.block_n2)](
        mid, w2, s2, *routing, tw, y,
        mid.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0),
        i, k, w.group_size, i // bk,
        BM=cfg.block_m, BN=cfg.block_n2, BK=bk, ACC_SCALE=cfg.acc_scale, JOIN=cfg.join,
        GATED=gated, ATOMIC=cfg.atomic_out,
        VEC=_vec(cfg.block_n2, cfg.block_n2), PER_CHANNEL=i == w.group_size, **_meta(dtype, cfg))
    if cfg.atomic_out:
        return y.to(dtype)
    return y.view(t, k, h).sum(1)                                          # [T, H]
