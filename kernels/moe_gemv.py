"""INT4 MoE for few tokens per expert: dot products on the CUDA cores, no tensor cores.

At decode and small-tree verify sizes each expert sees one or a few tokens, so a tensor-core
tile is mostly padding and the cost is turning nibbles into mma operands (docs/notes/moe.md).
Here each word is consumed where it is loaded: its 8 nibbles are 4 K rows x 2 columns of the
Marlin tile (DESIGN §4), multiplied by the 4 matching activations in packed half precision
(two values an instruction) and added into the 2 columns; the sum over K rows happens once,
after the loop. Same maths as `kernels.moe.fused_moe_ref`, no atomics (bit-for-bit repeatable).

Word `[kt, nb*128 + (4g + t)*4 + tile]` holds nibbles i = 4*kodd + 2*bn + bk: K row
16kt + 2t + kodd + 8bk, column 64nb + 16tile + g + 8bn. Nibbles i and i + 4 are the K rows
2t and 2t + 1 (bk = 0) or 2t + 8 and 2t + 9 (bk = 1) of one column, at bits 4i and 4i + 16:
one AND-OR (LOP3) with 0x64006400 makes them an fp16 pair 1024 + q (or 1024 + 16q for the odd
nibbles), one packed subtract (fma) gives q - 8 exactly. The activations are fp16 in their
natural order: the pair (x[16kt + 2t], x[16kt + 2t + 1]) is the int32 at 8kt + t and
(x[.. + 8], x[.. + 9]) the one at 8kt + t + 4, so a word costs 4 LOP3, 4 HSUB2/HFMA2 and 4
HFMA2 for its 8 products, whose two halves per column are added and widened to fp32 (the
scale and the sum over K are fp32). The packed maths is inline PTX (`_word_dot`); the CPU
interpreter, which cannot run PTX, takes the same nibbles and halves in fp32.
A program's word tile is `[8, BN/2]`: rows r = (kt, t) for the two k-tiles of one 32-row
step (one scale group), columns j = (nb, g, tile).

Launches (`fused_moe_gemv`): x to fp16; w13 (one program per row block, column tile and K
split; fp32 partial sums per split); SiLU(gate) * up * top-k weight in fp16; w2 (one row
per assignment); sum over k and cast. `block_m == 1`: a row block is one assignment, no sorting,
and (`fuse_act`) the SiLU launch is folded into w13: the last of an assignment's programs to
finish (kernels.ticket) computes that assignment's act row. `block_m > 1`: assignments sorted
by expert (`moe_align.align_tokens`), so an expert's words are read once for its rows;
compiled, such blocks run on the tensor cores (`_mma_loop`, `mma`): Marlin's layout gives
lane 4g + t of a warp the B fragments of an mma.m16n8k16 directly, the dequantized words are
multiplied by up to 16 rows at the cost of one (rows g and g + 8 of each lane; fp32 sums),
which is where rows share experts (a DDTree verify, `moe_triton.STREAM_TILES`). One row a
block stays on the packed fp16 dot: there the mma, 1/16 used, was slower (+570 us in the
c=1 decode step on the H200, docs/notes/decode.md).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ddbench.kernels import pdl, ticket
from ddbench.kernels.moe_align import _block_rows, _scale_col, align_tokens

STEP = 32  # K rows per loop step: two k-tiles, one scale group (group sizes are multiples of it)
ACT_BLOCK = 512  # act columns per step of that program's loop over I
# w13's K splits aim at this many programs per SM (`gemv_splits`), at most MAX_SPLITS: 4 took
# 0.9 ms off the c=10 decode step on the H200 against 2 (8: the same; c=1 is at the cap either
# way; results/h200/decode/decode_trials_*)
SPLIT_PROGRAMS_PER_SM = 4
MAX_SPLITS = 16


def _dequant_asm(word: str, pairs: tuple[str, str, str, str]) -> str:
    """PTX: word -> the fp16 pairs (q - 8) of its nibbles (0, 4), (1, 5), (2, 6), (3, 7), into
    the registers `pairs` (needs the .b32 registers m, c, k, b, s of `_DEQUANT_REGS`)."""
    p0, p1, p2, p3 = pairs
    return f"""shr.u32 s, {word}, 8;
lop3.b32 {p0}, {word}, 0x000f000f, m, 0xea;
lop3.b32 {p1}, {word}, 0x00f000f0, m, 0xea;
lop3.b32 {p2}, s, 0x000f000f, m, 0xea;
lop3.b32 {p3}, s, 0x00f000f0, m, 0xea;
sub.rn.f16x2 {p0}, {p0}, c;
fma.rn.f16x2 {p1}, {p1}, k, b;
sub.rn.f16x2 {p2}, {p2}, c;
fma.rn.f16x2 {p3}, {p3}, k, b;
"""


# magic 0x6400 (fp16 1024): OR-ed onto a nibble pair it makes 1024 + q; minus 1032 or (x 1/16) - 72
_DEQUANT_REGS = """.reg .b32 m, s, c, k, b;
mov.b32 m, 0x64006400;
mov.b32 c, 0x64086408;
mov.b32 k, 0x2c002c00;
mov.b32 b, 0xd480d480;
"""
# word -> the 4 pairs as int32
_DEQUANT_PTX = tl.constexpr("{\n" + _DEQUANT_REGS + _dequant_asm("$4", ("$0", "$1", "$2", "$3")) + "}")
# (pairs p0..p3, activation pairs xa, xb) -> fp32 (column g, column g + 8)
_DOT_PTX = tl.constexpr("""{
.reg .b32 lo, hi;
.reg .f16 a, b;
mul.rn.f16x2 lo, $2, $6;
fma.rn.f16x2 lo, $3, $7, lo;
mul.rn.f16x2 hi, $4, $6;
fma.rn.f16x2 hi, $5, $7, hi;
mov.b32 {a, b}, lo;
add.rn.f16 a, a, b;
cvt.f32.f16 $0, a;
mov.b32 {a, b}, hi;
add.rn.f16 a, a, b;
cvt.f32.f16 $1, a;
}""")


@triton.jit
def _half(v, HIGH: tl.constexpr):
    """The low or high fp16 of int32 v, as fp32 (interpreter path of `_word_dot`)."""
    bits = (v >> 16) & 0xFFFF if HIGH else v & 0xFFFF
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q(w, SHIFT: tl.constexpr):
    """Nibble at bit SHIFT as fp32 q - 8 (interpreter path of `_word_dot`)."""
    return ((w >> SHIFT) & 0xF).to(tl.float32) - 8.0


@triton.jit
def _word_dot(w, xa, xb, PTX: tl.constexpr):
    """Words `[1, 8, C]` times the activation pairs xa, xb `[BM, 8, 1]` (int32: two fp16 each)
    -> (lo, hi) fp32 `[BM, 8, C]`: column g and g + 8 of each word's 4 K rows (still to be
    scaled and summed over the 8 word rows)."""
    if PTX:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(_DEQUANT_PTX, "=r,=r,=r,=r,r", [w], dtype=(tl.int32,) * 4,
                                                   is_pure=True, pack=1)
        lo, hi = tl.inline_asm_elementwise(_DOT_PTX, "=f,=f,r,r,r,r,r,r", [p0, p1, p2, p3, xa, xb],
                                           dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        a0, a1, b0, b1 = _half(xa, False), _half(xa, True), _half(xb, False), _half(xb, True)
        lo = (_q(w, 0) * a0 + _q(w, 16) * a1) + (_q(w, 4) * b0 + _q(w, 20) * b1)
        hi = (_q(w, 8) * a0 + _q(w, 24) * a1) + (_q(w, 12) * b0 + _q(w, 28) * b1)
    return lo, hi


@triton.jit
def _tile(n0, BN: tl.constexpr):
    """Word columns (for lane t = 0) and logical columns (bn = 0) of the BN-wide tile at n0."""
    j = tl.arange(0, BN // 2)
    nb, g, tile = j // 32, (j % 32) // 4, j % 4
    wcol = (n0 // 64 + nb) * 128 + g * 16 + tile
    return tl.max_contiguous(tl.multiple_of(wcol, 4), 4), n0 + nb * 64 + tile * 16 + g


@triton.jit
def _scales(s_row, sc_pair, PER_CHANNEL: tl.constexpr, n_lo):
    """Group scales of columns n_lo and n_lo + 8 as fp32 `[1, 1, C]` each. With groups,
    Marlin's 8x8 column transpose puts the two side by side: one int32 holds both."""
    if PER_CHANNEL:
        s_lo = tl.load(s_row + _scale_col(n_lo, True)).to(tl.float32)
        s_hi = tl.load(s_row + _scale_col(n_lo + 8, True)).to(tl.float32)
    else:
        pair = tl.load(s_row.to(tl.pointer_type(tl.int32), bitcast=True) + sc_pair)      # [C]
        s_lo = (pair << 16).to(tl.float32, bitcast=True)
        s_hi = (pair & -65536).to(tl.float32, bitcast=True)
    return s_lo[None, None, :], s_hi[None, None, :]


@triton.jit
def _step(acc_lo, acc_hi, a_ptrs, a_mask, w_e, s_e, ks, wrow, wcol, sc_pair, n_lo, stride_wk, stride_sg,
          GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr, PTX: tl.constexpr):
    """acc `[BM, 8, C]` += one 32-row step (K rows 32ks..): activation pairs at `a_ptrs`
    `[BM, 8]` (int32, word row r's pair xa; xb is 4 further), words of the expert, group scales."""
    a = a_ptrs + ks * 16
    xa = tl.load(a, mask=a_mask, other=0)[:, :, None]                            # [BM, 8, 1]
    xb = tl.load(a + 4, mask=a_mask, other=0)[:, :, None]
    w = tl.load(w_e + (2 * ks) * stride_wk + wrow[:, None] + wcol[None, :])      # [8, C] int32
    s_lo, s_hi = _scales(s_e + (32 * ks // GROUP) * stride_sg, sc_pair, PER_CHANNEL, n_lo)
    lo, hi = _word_dot(w[None, :, :], xa, xb, PTX)
    return acc_lo + lo * s_lo, acc_hi + hi * s_hi


@triton.jit
def _store_cols(ptrs, acc_lo, acc_hi, n_lo, valid):
    """Sum `[BM, 8, C]` over the 8 word rows and store at columns n_lo and n_lo + 8."""
    ty = ptrs.dtype.element_ty
    tl.store(ptrs + n_lo[None, :], tl.sum(acc_lo, 1).to(ty), mask=valid[:, None])
    tl.store(ptrs + (n_lo + 8)[None, :], tl.sum(acc_hi, 1).to(ty), mask=valid[:, None])


# two words of one lane (K tiles 2ks and 2ks + 1 of its Marlin block) and the activation
# pairs (xa, xb of each tile) of rows g and g + 8 -> fp32 (rows g, g + 8; columns 2t, 2t + 1
# of the block's two 8-column mma tiles): per word the dequant gives the B fragments of both
# tiles, 2 mma.m16n8k16 multiply them; the second K tile's mma add into the first's sums
_MMA_PTX = tl.constexpr("{\n.reg .b32 p0, p1, p2, p3;\n.reg .f32 f;\nmov.f32 f, 0f00000000;\n" + _DEQUANT_REGS
                        + _dequant_asm("$8", ("p0", "p1", "p2", "p3")) + """\
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $4, $5}, {$10, $14, $11, $15}, {p0, p1}, {f, f, f, f};
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$2, $3, $6, $7}, {$10, $14, $11, $15}, {p2, p3}, {f, f, f, f};
""" + _dequant_asm("$9", ("p0", "p1", "p2", "p3")) + """\
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $4, $5}, {$12, $16, $13, $17}, {p0, p1}, {$0, $1, $4, $5};
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$2, $3, $6, $7}, {$12, $16, $13, $17}, {p2, p3}, {$2, $3, $6, $7};
}""")


@triton.jit
def _mma_scales(s_row, col, sc_pair, PER_CHANNEL: tl.constexpr):
    """fp32 scales of columns col, col + 1, col + 8, col + 9 (col % 16 even and < 8); with
    groups the int32 pairs sc_pair (columns col, col + 8) and sc_pair + 4 (col + 1, col + 9)."""
    if PER_CHANNEL:
        return (tl.load(s_row + _scale_col(col, True)).to(tl.float32),
                tl.load(s_row + _scale_col(col + 1, True)).to(tl.float32),
                tl.load(s_row + _scale_col(col + 8, True)).to(tl.float32),
                tl.load(s_row + _scale_col(col + 9, True)).to(tl.float32))
    pairs = s_row.to(tl.pointer_type(tl.int32), bitcast=True)
    p = tl.load(pairs + sc_pair)
    q = tl.load(pairs + sc_pair + 4)
    return ((p << 16).to(tl.float32, bitcast=True), (q << 16).to(tl.float32, bitcast=True),
            (p & -65536).to(tl.float32, bitcast=True), (q & -65536).to(tl.float32, bitcast=True))


@triton.jit
def _mma_pairs(x_row, valid, ks):
    """Activation pairs (xa, xb) of K tiles 2ks and 2ks + 1 at x_row (`[BN/2]` int32 pointers,
    pair t of the row; zero where not valid) as `[BN/2, 1]` each."""
    return (tl.load(x_row + 16 * ks, mask=valid, other=0)[:, None],
            tl.load(x_row + 16 * ks + 4, mask=valid, other=0)[:, None],
            tl.load(x_row + 16 * ks + 8, mask=valid, other=0)[:, None],
            tl.load(x_row + 16 * ks + 12, mask=valid, other=0)[:, None])


@triton.jit
def _mma_store(out, col, acc0, acc1, acc2, acc3, valid):
    m = valid[:, None]
    ty = out.dtype.element_ty
    tl.store(out + col, acc0.to(ty), mask=m)
    tl.store(out + col + 1, acc1.to(ty), mask=m)
    tl.store(out + col + 8, acc2.to(ty), mask=m)
    tl.store(out + col + 9, acc3.to(ty), mask=m)


@triton.jit
def _mma_loop(a_rows, valid, out, a_rows_u, valid_u, out_u, w_e, s_e, n0, k_first, k_last, stride_wk, stride_sg,
              GROUP: tl.constexpr, BN: tl.constexpr, PER_CHANNEL: tl.constexpr, NUM_STAGES: tl.constexpr,
              UPPER: tl.constexpr):
    """The K steps k_first..k_last of a BN-column tile on the tensor cores for rows g (and,
    UPPER, g + 8) of each lane: activation rows a_rows / a_rows_u (`[BN/2]` pointers, zero
    where not valid / valid_u), results stored at out / out_u (`[BN/2, 1]` row pointers) +
    column.

    Lane slot i = 32 nb + l (l = 4g + t: a warp's lanes, the Marlin block nb of 64 columns)
    holds the words 4i..4i+3 of each K tile row, i.e. its 4 column tiles `[BN/2, 4]`: exactly
    the B fragments that lane l gives an mma of that block (DESIGN §4). It relies on Triton's
    coalesced layout giving a warp's 32 lanes 32 consecutive slots, 4 words each (BN >= 64
    x warps; the GPU tests against the reference check it). The sum over K stays in each
    mma's fp32 accumulator; the group scale multiplies each step's (one group's) sum."""
    i = tl.arange(0, BN // 2)
    t = i % 4                                                               # lane % 4
    tile = tl.arange(0, 4)
    wcol = (n0 // 64) * 128 + i[:, None] * 4 + tile[None, :]                # [BN/2, 4] words
    col = n0 + (i // 32)[:, None] * 64 + tile[None, :] * 16 + (2 * t)[:, None]   # d0's column
    # its scale pair in Marlin's 8x8 transpose (`_scale_col` / 2): 4 consecutive int32 a lane
    sc_pair = (n0 // 64 + i // 32)[:, None] * 32 + (8 * t)[:, None] + tile[None, :]
    sc_pair = tl.max_contiguous(tl.multiple_of(sc_pair, [4, 4]), [1, 4])
    acc0 = tl.zeros([BN // 2, 4], tl.float32)
    acc1, acc2, acc3, up0, up1, up2, up3 = acc0, acc0, acc0, acc0, acc0, acc0, acc0
    for ks in tl.range(k_first, k_last, num_stages=NUM_STAGES):
        w0 = tl.load(w_e + (2 * ks) * stride_wk + wcol)
        w1 = tl.load(w_e + (2 * ks + 1) * stride_wk + wcol)
        xa0, xb0, xa1, xb1 = _mma_pairs(a_rows + t, valid, ks)
        if UPPER:
            ya0, yb0, ya1, yb1 = _mma_pairs(a_rows_u + t, valid_u, ks)
        else:
            ya0 = tl.zeros_like(xa0)
            yb0, ya1, yb1 = ya0, ya0, ya0
        d0, d1, d2, d3, e0, e1, e2, e3 = tl.inline_asm_elementwise(
            _MMA_PTX, "=f,=f,=f,=f,=f,=f,=f,=f,r,r,r,r,r,r,r,r,r,r", [w0, w1, xa0, xb0, xa1, xb1, ya0, yb0, ya1, yb1],
            dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        s0, s1, s2, s3 = _mma_scales(s_e + (32 * ks // GROUP) * stride_sg, col, sc_pair, PER_CHANNEL)
        acc0 += d0 * s0
        acc1 += d1 * s1
        acc2 += d2 * s2
        acc3 += d3 * s3
        if UPPER:
            up0 += e0 * s0
            up1 += e1 * s1
            up2 += e2 * s2
            up3 += e3 * s3
    _mma_store(out, col, acc0, acc1, acc2, acc3, valid)
    if UPPER:
        _mma_store(out_u, col, up0, up1, up2, up3, valid_u)


@triton.jit
def _row_ptrs(assign, a_ptr, stride_a, A_DIV, out_k, stride_oa):
    """Assignments' activation rows (`assign // A_DIV` of a) and output rows `[.., 1]` of out_k."""
    return a_ptr + (assign // A_DIV).to(tl.int64) * stride_a, out_k + assign.to(tl.int64)[:, None] * stride_oa


@triton.jit
def _gemv_kernel(
    a_ptr, w_ptr, s_ptr,                  # fp16 activations [rows, K] seen as int32 pairs; int32 words [E, K/16, 2N]; scales [E, K/g, N]
    ids_ptr, sorted_ptr, block_expert_ptr, expert_start_ptr, counts_ptr,   # routing
    out_ptr,                              # [S, T*k, N]: one row per assignment and K split
    act_ptr, topk_w_ptr, count_ptr,       # ACT: act fp16 [T*k, N/2]; weights fp32 [T*k]; tickets [T*k]
    stride_a, stride_we, stride_wk, stride_se, stride_sg, stride_os, stride_oa, stride_act,
    A_DIV, STEPS_PER_SPLIT, K_STEPS,
    GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PER_CHANNEL: tl.constexpr, NUM_STAGES: tl.constexpr,
    ACT: tl.constexpr, ACT_BLOCK: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr, PTX: tl.constexpr,
    MMA: tl.constexpr,
):
    """Program (row block, column tile, K split). Row block = one assignment when BM == 1
    (expert from topk_ids), else BM sorted assignments of one expert; assignment a reads
    activation row a // A_DIV (A_DIV = k for x, 1 for the per-assignment act).
    ACT (w13, BM == 1): the last of assignment a's programs (column tiles x K splits) to store
    its partials then writes a's act row, as `_half_kernel` GATED would (SP: splits, next
    power of two). PDL: launched as a dependent of the previous kernel (kernels.pdl).
    PTX: packed fp16 maths in inline PTX (False: the interpreter's fp32 version).
    MMA (PTX, BM > 1): the words go through the tensor cores instead (`_mma_loop`)."""
    pdl.enter(PDL)
    # rows of the program's assignments: [BM], or with MMA (BM > 1) one per lane slot (row g of lane 4g + t)
    r = (tl.arange(0, BN // 2) % 32) // 4 if MMA else tl.arange(0, BM)
    if BM == 1:
        a = tl.program_id(0)
        e = tl.load(ids_ptr + a)
        assign = a + tl.zeros([1], tl.int32)
        valid = assign >= 0
    else:
        e, assign, valid = _block_rows(block_expert_ptr, expert_start_ptr, counts_ptr, sorted_ptr, BM, r)
        if e < 0:
            return
    pid_n, pid_k = tl.program_id(1), tl.program_id(2)
    w_e = w_ptr + e.to(tl.int64) * stride_we
    s_e = s_ptr + e.to(tl.int64) * stride_se
    k_first = pid_k * STEPS_PER_SPLIT
    k_last = tl.minimum(K_STEPS, k_first + STEPS_PER_SPLIT)
    out_k = out_ptr + pid_k.to(tl.int64) * stride_os
    a_rows, out = _row_ptrs(assign, a_ptr, stride_a, A_DIV, out_k, stride_oa)
    if MMA:  # rows g (above) and g + 8 of each lane (the latter used only when BM > 8)
        assign_u, valid_u = assign, valid
        if BM > 8:
            _, assign_u, valid_u = _block_rows(block_expert_ptr, expert_start_ptr, counts_ptr, sorted_ptr, BM, r + 8)
        a_rows_u, out_u = _row_ptrs(assign_u, a_ptr, stride_a, A_DIV, out_k, stride_oa)
        _mma_loop(a_rows, valid, out, a_rows_u, valid_u, out_u, w_e, s_e, pid_n * BN, k_first, k_last, stride_wk,
                  stride_sg, GROUP, BN, PER_CHANNEL, NUM_STAGES, BM > 8)
    else:
        r8 = tl.arange(0, 8)
        wrow = (r8 // 4) * stride_wk + (r8 % 4) * 4                       # word row (kt, t)
        wcol, n_lo = _tile(pid_n * BN, BN)
        sc_pair = (wcol // 128) * 32 + (wcol % 128) // 16 * 4 + wcol % 4   # scale pair (n_lo, n_lo + 8)
        a_ptrs = a_rows[:, None] + ((r8 // 4) * 8 + r8 % 4)[None, :]       # [BM, 8]
        acc_lo = tl.zeros([BM, 8, BN // 2], tl.float32)
        acc_hi = tl.zeros([BM, 8, BN // 2], tl.float32)
        for ks in tl.range(k_first, k_last, num_stages=NUM_STAGES):
            acc_lo, acc_hi = _step(acc_lo, acc_hi, a_ptrs, valid[:, None], w_e, s_e, ks, wrow, wcol, sc_pair,
                                   n_lo, stride_wk, stride_sg, GROUP, PER_CHANNEL, PTX)
        _store_cols(out, acc_lo, acc_hi, n_lo, valid)
    if ACT:
        a = tl.program_id(0)
        if ticket.last_to_arrive(count_ptr + a, tl.num_programs(1) * tl.num_programs(2)):
            half = tl.num_programs(1) * (BN // 2)                     # I
            for k0 in range(0, half, ACT_BLOCK):
                _act_cols(out_ptr + a.to(tl.int64) * stride_oa, stride_os, act_ptr + a.to(tl.int64) * stride_act,
                          topk_w_ptr + a, k0 + tl.arange(0, ACT_BLOCK), half, tl.num_programs(2), SP)


@triton.jit
def _half_kernel(
    src_ptr, dst_ptr, topk_w_ptr,
    stride_ss, stride_sr, stride_d,
    K, SPLITS,
    GATED: tl.constexpr, SP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """Row `pid` of src -> fp16 dst `[K]`, the GEMV's activations. GATED: src is w13's fp32
    partials `[S, T*k, 2K]`, the row becomes SiLU(sum gate) * sum up * top-k weight first.
    PDL: kernels.pdl."""
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if GATED:
        _act_cols(src_ptr + row * stride_sr, stride_ss, dst_ptr + row * stride_d, topk_w_ptr + row, k, K, SPLITS, SP)
    else:
        ok = k < K
        x = tl.load(src_ptr + row * stride_sr + k, mask=ok)
        tl.store(dst_ptr + row * stride_d + k, x.to(tl.float16), mask=ok)


@triton.jit
def _act_cols(part, stride_ss, dst_row, weight_ptr, k, K, SPLITS, SP: tl.constexpr):
    """Act values of K rows k (those < K) of one assignment: SiLU(gate) * up * its top-k weight,
    gate and up summed over w13's SPLITS fp32 partial rows `part` + s * stride_ss (columns k
    and K + k), split by split in order (the same bits wherever it runs), stored as fp16 at
    dst_row. `.cg` loads (past L1): the partials may be other programs' (kernels.ticket)."""
    ok = k < K
    g = tl.load(part + k, mask=ok, other=0.0, cache_modifier=".cg")
    u = tl.load(part + K + k, mask=ok, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SP):
        m = k < tl.where(s < SPLITS, K, 0)                 # (ok & (s < SPLITS) upsets the interpreter)
        g += tl.load(part + s * stride_ss + k, mask=m, other=0.0, cache_modifier=".cg")
        u += tl.load(part + s * stride_ss + K + k, mask=m, other=0.0, cache_modifier=".cg")
    x = g / (1.0 + tl.exp(-g)) * u * tl.load(weight_ptr).to(tl.float32)
    tl.store(dst_row + k, x.to(tl.float16), mask=ok)


@triton.jit
def _sum_k_kernel(y_ptr, out_ptr, H, TOP_K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
                  PDL: tl.constexpr):
    """out[t] = sum over the k rows of token t in y fp32 `[T*k, H]`, cast to out's dtype."""
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, KP)
    y = tl.load(y_ptr + (t * TOP_K + j)[:, None] * H + c[None, :], mask=(j < TOP_K)[:, None] & (c < H)[None, :],
                other=0.0)
    tl.store(out_ptr + t * H + c, tl.sum(y, 0).to(out_ptr.dtype.element_ty), mask=c < H)


def gemv_splits(blocks: int, col_tiles: int, k_steps: int, n_sms: int) -> int:
    """K splits of w13 so its grid has about SPLIT_PROGRAMS_PER_SM programs per SM, each
    with >= 8 steps."""
    want = -(-SPLIT_PROGRAMS_PER_SM * n_sms // (blocks * col_tiles))
    return max(1, min(want, k_steps // 8, MAX_SPLITS))


def _ptx(t: torch.Tensor) -> bool:
    """Whether the kernels run compiled (inline PTX) rather than under the Triton interpreter."""
    return t.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1"


def half_rows(src: torch.Tensor, topk_weights: torch.Tensor | None = None, splits: int = 1) -> torch.Tensor:
    """The GEMV's activations, fp16 `[rows, K]` (`_half_kernel`): x `[T, K]` cast; with
    topk_weights, w13's partials `[S, T*k, 2K]` -> SiLU(gate)*up*weight `[T*k, K]`."""
    gated = topk_weights is not None
    rows, k = (src.shape[1], src.shape[2] // 2) if gated else src.shape
    dst = torch.empty(rows, k, dtype=torch.float16, device=src.device)
    block = min(1024, triton.next_power_of_2(k))
    tw = topk_weights if gated else dst
    _half_kernel[(rows, triton.cdiv(k, block))](
        src, dst, tw, src.stride(0) if gated else 0, src.stride(-2), dst.stride(0), k, splits,
        GATED=gated, SP=triton.next_power_of_2(splits), BLOCK=block, num_warps=4, **pdl.args(pdl.on(src)))
    return dst


def gemv(a: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, group: int, ids: torch.Tensor, routing,
         n_assign: int, a_div: int, cfg, bn: int, split: int, topk_weights: torch.Tensor | None = None) -> torch.Tensor:
    """One INT4 GEMM on the CUDA cores: fp16 activations `a` `[rows, K]` -> fp32 `[split, n_assign, N]`
    (rows of each assignment, one slice per K split; `routing` None = one block per assignment).
    topk_weights fp32 `[n_assign]` (w13, routing None): SiLU(gate) * up * weight fused in ->
    the act fp16 `[n_assign, N/2]` instead (`half_rows(out, topk_weights, split)`)."""
    k, n = w.shape[1] * 16, w.shape[2] // 2
    k_steps = k // STEP
    per_split = triton.cdiv(k_steps, split)
    split = triton.cdiv(k_steps, per_split)
    out = torch.empty(split, n_assign, n, dtype=torch.float32, device=a.device)
    blocks = n_assign if routing is None else routing[1].numel()
    route = (ids,) * 4 if routing is None else routing
    fuse = topk_weights is not None
    if fuse:
        act = torch.empty(n_assign, n // 2, dtype=torch.float16, device=a.device)   # [T*k, I]
        tw, count = topk_weights, ticket.counters(a.device, "moe_act", n_assign)
        act_block, sp = min(ACT_BLOCK, triton.next_power_of_2(n // 2)), triton.next_power_of_2(split)
    else:
        act = tw = count = out
        act_block, sp = 1, 1
    mma = cfg.mma and _ptx(a) and cfg.block_m > 1
    _gemv_kernel[(blocks, n // bn, split)](
        a.view(torch.int32), w, scales, ids, *route, out, act, tw, count,
        a.stride(0) // 2, w.stride(0), w.stride(1), scales.stride(0), scales.stride(1), out.stride(0), out.stride(1),
        act.stride(0), a_div, per_split, k_steps,
        GROUP=group, BM=cfg.block_m, BN=bn, PER_CHANNEL=k == group, NUM_STAGES=cfg.num_stages,
        num_warps=min(cfg.num_warps, bn // 64) if mma else cfg.num_warps,
        ACT=fuse, ACT_BLOCK=act_block, SP=sp, PTX=_ptx(a), MMA=mma,
        **pdl.args(pdl.on(a)))
    return act if fuse else out


def gemv_routing(topk_ids: torch.Tensor, w, cfg):
    """None (block_m 1: one row block per assignment) or `align_tokens`' sorted routing."""
    return None if cfg.block_m == 1 else align_tokens(topk_ids, w.n_experts, cfg.block_m)


def _flat_weights(topk_weights: torch.Tensor) -> torch.Tensor:
    return topk_weights.reshape(-1).float().contiguous()   # [T*k]


def gemv_w13(x: torch.Tensor, topk_ids: torch.Tensor, routing, w, cfg, n_sms: int = 132,
             x_half: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None) -> torch.Tensor:
    """x to fp16 (unless x_half = `half_rows(x)` is given), then w13: -> fp32 gate|up
    partial sums `[S, T*k, 2I]` (S K splits). With topk_weights, where the act can be fused
    (cfg.fuse_act, routing None, T*k <= ticket.MAX_COUNTERS): w2's input SiLU(gate)*up*weight,
    fp16 `[T*k, I]`, from the same launch. `gemv_w2` takes either."""
    t, k = topk_ids.shape
    ids = topk_ids.reshape(-1).to(torch.int32)
    blocks = t * k if routing is None else routing[1].numel()
    split = cfg.split_k or gemv_splits(blocks, 2 * w.inter // cfg.block_n13, w.hidden // STEP, n_sms)
    a = half_rows(x) if x_half is None else x_half
    fuse = topk_weights is not None and cfg.fuse_act and routing is None and t * k <= ticket.MAX_COUNTERS
    return gemv(a, w.w13, w.w13_scale, w.group_size, ids, routing, t * k, k, cfg,
                cfg.block_n13, split, _flat_weights(topk_weights) if fuse else None)


def gemv_w2(mid: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, routing, w, cfg,
            dtype: torch.dtype, sum_k: bool = True) -> torch.Tensor:
    """SiLU(gate)*up*weight in fp16 (unless `gemv_w13` fused it: mid is then the act
    `[T*k, I]`, else its partials `[S, T*k, 2I]`), w2, sum over k -> `[T, H]` in dtype;
    without sum_k the weighted rows fp32 `[T*k, H]` (row t*k + j: slot j of token t)."""
    t, k = topk_ids.shape
    h = w.hidden
    ids = topk_ids.reshape(-1).to(torch.int32)
    act = mid if mid.dim() == 2 else half_rows(mid, _flat_weights(topk_weights), mid.shape[0])   # [T*k, I]
    y = gemv(act, w.w2, w.w2_scale, w.group_size, ids, routing, t * k, 1, cfg, cfg.block_n2, 1)   # [1, T*k, H]
    if not sum_k:
        return y[0]
    out = torch.empty(t, h, dtype=dtype, device=mid.device)
    block = min(1024, triton.next_power_of_2(h))
    _sum_k_kernel[(t, triton.cdiv(h, block))](y, out, h, TOP_K=k, KP=triton.next_power_of_2(k), BLOCK=block,
                                               num_warps=4, **pdl.args(pdl.on(y)))
    return out


def fused_moe_gemv(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w, cfg,
                   n_sms: int = 132, x_half: torch.Tensor | None = None, sum_k: bool = True) -> torch.Tensor:
    """x `[T, H]`, routing `[T, k]`, `MarlinMoE` -> `[T, H]` in x's dtype, on the CUDA cores.
    x_half: `half_rows(x)` if the caller already has it (kernels.skinny.norm_linear writes it).
    sum_k False: the k weighted rows per token, fp32 `[T*k, H]`, for the caller to sum.

    cfg (a `moe_triton.MoeTritonConfig`) gives block_m (1: no sorting, act fused into w13
    when cfg.fuse_act; the other gemv option: mma), block_n13, block_n2 (multiples of 64), split_k (0: `gemv_splits`),
    num_warps, num_stages.
    """
    routing = gemv_routing(topk_ids, w, cfg)
    mid = gemv_w13(x, topk_ids, routing, w, cfg, n_sms, x_half, topk_weights)
    return gemv_w2(mid, topk_ids, topk_weights, routing, w, cfg, x.dtype, sum_k=sum_k)
