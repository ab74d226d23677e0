"""MLA attention in the absorbed form over a position-indexed latent KV cache.

One function serves prefill (causal), decode (one token) and tree verification: stream b
has `prefix_len[b]` cached positions, all visible, and T new tokens already written to
cache positions prefix_len[b] .. prefix_len[b]+T-1; new token i sees new token j iff
`visible[b, i, j]`. Scores use the 512 latent dims (query absorbed through wkv_b's key
part) plus the 64 rope dims; the output stays in the latent space (before v/o).
"""
from __future__ import annotations

import torch


def mla_attention_ref(q_lat: torch.Tensor, q_rope: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                      prefix_len: torch.Tensor, visible: torch.Tensor, scale: float,
                      out_proj: torch.Tensor | None = None) -> torch.Tensor:
    """Reference (fp32 softmax).

    q_lat `[B, T, H, L]`, q_rope `[B, T, H, R]`, ckv `[B, S, L]`, kpe `[B, S, R]`,
    prefix_len int `[B]`, visible bool `[B, T, T]` -> `[B, T, H, L]` in q's dtype; with
    out_proj (each head's value projection `[H, Dv, L]`) that output times its head's
    projection, `[B, T, H, Dv]` (`project`: the rounded output's products).
    """
    b, t, h, _ = q_lat.shape
    s = ckv.shape[1]
    scores = (torch.einsum("bthl,bsl->bths", q_lat.float(), ckv.float())
              + torch.einsum("bthr,bsr->bths", q_rope.float(), kpe.float())) * scale  # [B, T, H, S]
    pos = torch.arange(s, device=ckv.device)                                             # [S]
    plen = prefix_len.to(ckv.device).long().view(b, 1, 1)
    rel = pos.view(1, 1, s) - plen                                                       # [B, 1, S]
    in_prefix = rel < 0                                                                   # [B, 1, S]
    node = rel.clamp(0, t - 1).expand(b, t, s)                                           # [B, T, S]
    sees_node = visible.gather(2, node) & (rel < t)                                      # [B, T, S]
    mask = in_prefix | sees_node                                                          # [B, T, S]
    scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out = torch.einsum("bths,bsl->bthl", p, ckv.float()).to(q_lat.dtype)
    return out if out_proj is None else project(out, out_proj)


def project(o: torch.Tensor, out_proj: torch.Tensor) -> torch.Tensor:
    """o `[B, T, H, L]` times each head's out_proj `[H, Dv, L]` -> `[B, T, H, Dv]` in o's dtype
    (`kernels.skinny.heads_linear`: its few-row kernel on the GPU, einsum elsewhere)."""
    return heads_linear(o, out_proj.to(o.dtype))


# --------------------------------------------------------------------------------------
# Triton: split-K (flash-decoding) over the cached prefix + tree nodes
# --------------------------------------------------------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ddbench.kernels import pdl  # noqa: E402
from ddbench.kernels.skinny import heads_linear  # noqa: E402

LOG2E = 1.4426950408889634
# at most this many chunks per stream (0: no cap): with min_chunk 32 a short decode cache is
# cut fine (1 x 160: 10.2 us vs 12.5 at 64) while a long single stream is not cut into
# hundreds of partials to merge (1 x 8k: 18.9 us at chunks of 128 vs 23.3 at 32;
# results/h200/attn_probe.csv, H200)
MAX_CHUNKS = 64
MIN_CHUNK = 32    # default min_chunk of decode-size calls (num_splits not given)
# default `waves` (work items per SM) of decode-size calls (<= 16 query rows), read at each
# call: 1 took 60 us off the c=1 decode step on the H200 against 2 (c=10: 33 us; 4: +100,
# +140; results/h200/decode/decode_trials_20261202-2002.csv); larger calls keep 2
DECODE_WAVES = 1.0
# tile of decode-size calls (read at each call): KV positions per step, warps, stages
DECODE_BLOCK_N, DECODE_WARPS, DECODE_STAGES = 32, 4, 3
# out_proj at decode sizes: the merge programs do the value projection (one launch fewer), BLOCK_V
# projection rows each (both read at each call)
FUSE_PROJ = True
PROJ_BLOCK_V = 16


@triton.jit
def _work_split(plen_ptr, B, T, P, BB: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
                MAX_CHUNKS: tl.constexpr):
    """Split every stream's live KV (prefix + T) into chunks of one common size, chosen on
    the device from the total live length so that all streams together make at most P + B
    work items (chunk >= MIN_CHUNK, a multiple of BLOCK_N) and no stream more than
    MAX_CHUNKS (0: no cap; a long single stream then merges fewer partials). Returns, per
    stream ([BB], zero-padded): live length, number of chunks, index of its first work item;
    and the chunk size."""
    sb = tl.arange(0, BB)
    sok = sb < B
    lens = tl.load(plen_ptr + sb, mask=sok, other=0).to(tl.int32) + tl.where(sok, T, 0)   # [BB]
    chunk = tl.cdiv(tl.cdiv(tl.sum(lens, axis=0), P), BLOCK_N) * BLOCK_N
    chunk = tl.maximum(chunk, MIN_CHUNK)
    if MAX_CHUNKS > 0:
        chunk = tl.maximum(chunk, tl.cdiv(tl.cdiv(tl.max(lens, axis=0), MAX_CHUNKS), BLOCK_N) * BLOCK_N)
    n_chunks = tl.cdiv(lens, chunk)                                                         # [BB]
    first = tl.cumsum(n_chunks, axis=0) - n_chunks                                          # [BB]
    return lens, n_chunks, first, chunk


@triton.jit
def _attend_tile(q_lo, q_hi, qr, ckv, kpe, sc_s, sk_s, n0, end, plen, m_i, l_2d, acc_lo, acc_hi, qk_scale,
                 vis_rows, rok, DL: tl.constexpr, DR: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
                 NEW: tl.constexpr):
    """One online-softmax step over cache positions n0 .. min(n0 + BLOCK_N, end): scores of the
    query rows (latent halves q_lo/q_hi, rope qr) against the cached latent + rope, masked to
    the rows `rok` and, for NEW tiles (tree nodes at positions >= plen), to `vis_rows`
    (per row, a pointer to its uint8 visibility row); returns the updated (max, sum, acc).
    The softmax sum is kept per score column, `l_2d` [BM, BN], and summed over the columns
    once after the loop: one cross-warp reduction per tile (the max) instead of two."""
    half: tl.constexpr = DL // 2
    dl = tl.arange(0, half)
    dr = tl.arange(0, DR)
    pos = n0 + tl.arange(0, BLOCK_N)
    pok = pos < end
    k_rows = ckv + pos[:, None] * sc_s + dl[None, :]
    k_lo = tl.load(k_rows, mask=pok[:, None], other=0.0)                                  # [BN, DL/2]
    k_hi = tl.load(k_rows + half, mask=pok[:, None], other=0.0)                           # [BN, DL/2]
    kr = tl.load(kpe + pos[:, None] * sk_s + dr[None, :], mask=pok[:, None], other=0.0)  # [BN, DR]
    # three independent MMA chains (latent halves, rope) instead of one over 576 dims; each
    # product is scaled before the sum so the compiler does not chain them as accumulators
    s = (tl.dot(q_lo, tl.trans(k_lo), input_precision=PREC) * qk_scale
         + tl.dot(q_hi, tl.trans(k_hi), input_precision=PREC) * qk_scale
         + tl.dot(qr, tl.trans(kr), input_precision=PREC) * qk_scale)                    # [BM, BN]
    mask = rok[:, None] & pok[None, :]
    if NEW:
        mask &= tl.load(vis_rows + (pos - plen)[None, :], mask=mask, other=0) != 0
    s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_2d = l_2d * alpha[:, None] + p
    p = p.to(k_lo.dtype)
    acc_lo = tl.dot(p, k_lo, acc_lo * alpha[:, None], input_precision=PREC)             # [BM, DL/2]
    acc_hi = tl.dot(p, k_hi, acc_hi * alpha[:, None], input_precision=PREC)
    return m_new, l_2d, acc_lo, acc_hi


@triton.jit
def _mla_split_kernel(
    # queries [B, T, H, DL] and [B, T, H, DR] (last dim contiguous)
    q_lat_ptr, q_rope_ptr, sq_b, sq_t, sq_h, sr_b, sr_t, sr_h,
    # cache [B, S, DL] and [B, S, DR] (last dim contiguous)
    ckv_ptr, kpe_ptr, sc_b, sc_s, sk_b, sk_s,
    # per stream: prefix length [B]; visibility among the new tokens uint8 [B, T, T]
    plen_ptr, vis_ptr, sv_b, sv_t,
    # partials fp32 per work item: acc [W, R, DL], running max and sum [W, R]  (DIRECT: unused)
    o_part_ptr, m_part_ptr, l_part_ptr,
    # DIRECT: final output [B, T, H, DL]
    out_ptr, so_b, so_t, so_h,
    # sizes
    B, T, H, R, P, qk_scale,           # R = T*H query rows; P = target number of work items
    DL: tl.constexpr, DR: tl.constexpr, BB: tl.constexpr, MIN_CHUNK: tl.constexpr, MAX_CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
):
    """Program (query block, work item): BLOCK_M query rows (row = t*H + h) against one
    chunk [start, end) of one stream's live KV, online softmax in base 2; writes the
    unnormalized acc + (max, sum) of work item w for `_mla_combine_kernel`. Work item w
    belongs to the stream whose chunks (numbered stream after stream, `_work_split`) hold
    it; items past the last chunk do nothing. DIRECT: work item = stream, whole live KV,
    normalized output. PDL: launched as a dependent of the previous kernel (kernels.pdl)."""
    pdl.enter(PDL)
    mb, w = tl.program_id(0), tl.program_id(1)
    if DIRECT:
        b = w
        kv_len = tl.load(plen_ptr + b).to(tl.int32) + T
        start = kv_len * 0
        end = kv_len
    else:
        lens, n_chunks, first, chunk = _work_split(plen_ptr, B, T, P, BB, BLOCK_N, MIN_CHUNK, MAX_CHUNKS)
        sb = tl.arange(0, BB)
        b = tl.sum((first + n_chunks <= w).to(tl.int32), axis=0)     # padding ends at the total
        b = tl.minimum(b, B - 1)                                      # w past the total: empty range
        kv_len = tl.sum(tl.where(sb == b, lens, 0), axis=0)
        start = (w - tl.sum(tl.where(sb == b, first, 0), axis=0)) * chunk
        end = tl.minimum(start + chunk, kv_len)
    b64 = b.to(tl.int64)
    plen = kv_len - T
    ckv = ckv_ptr + b64 * sc_b
    kpe = kpe_ptr + b64 * sk_b

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rok = rows < R
    t = rows // H
    h = rows % H
    half: tl.constexpr = DL // 2
    dl = tl.arange(0, half)
    dr = tl.arange(0, DR)
    q_rows = q_lat_ptr + b64 * sq_b + t[:, None] * sq_t + h[:, None] * sq_h + dl[None, :]
    q_lo = tl.load(q_rows, mask=rok[:, None], other=0.0)                          # [BM, DL/2]
    q_hi = tl.load(q_rows + half, mask=rok[:, None], other=0.0)                   # [BM, DL/2]
    qr = tl.load(q_rope_ptr + b64 * sr_b + t[:, None] * sr_t + h[:, None] * sr_h + dr[None, :],
                 mask=rok[:, None], other=0.0)                                    # [BM, DR]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_2d = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, half], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, half], tl.float32)
    # prefix tiles (all visible), then the tiles of new tokens (visibility mask): two loops so
    # the long one has no mask load (with one, Triton 3.6 kept the softmax state in two layouts
    # and converted every score tile between them)
    for n0 in range(start, tl.minimum(end, plen), BLOCK_N):
        m_i, l_2d, acc_lo, acc_hi = _attend_tile(
            q_lo, q_hi, qr, ckv, kpe, sc_s, sk_s, n0, tl.minimum(end, plen), plen, m_i, l_2d, acc_lo, acc_hi,
            qk_scale, vis_ptr + b64 * sv_b + t[:, None] * sv_t, rok, DL, DR, BLOCK_N, PREC, False)
    for n0 in range(tl.maximum(start, plen), end, BLOCK_N):
        m_i, l_2d, acc_lo, acc_hi = _attend_tile(
            q_lo, q_hi, qr, ckv, kpe, sc_s, sk_s, n0, end, plen, m_i, l_2d, acc_lo, acc_hi,
            qk_scale, vis_ptr + b64 * sv_b + t[:, None] * sv_t, rok, DL, DR, BLOCK_N, PREC, True)

    l_i = tl.sum(l_2d, axis=1)
    if DIRECT:
        inv = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)[:, None]          # l = 0 only on padding rows
        o_rows = out_ptr + b64 * so_b + t[:, None] * so_t + h[:, None] * so_h + dl[None, :]
        tl.store(o_rows, (acc_lo * inv).to(out_ptr.dtype.element_ty), mask=rok[:, None])
        tl.store(o_rows + half, (acc_hi * inv).to(out_ptr.dtype.element_ty), mask=rok[:, None])
    else:
        live = rok & ((rows * 0 + start) < end)
        part = w.to(tl.int64) * R + rows                                                      # [BM]
        tl.store(o_part_ptr + part[:, None] * DL + dl[None, :], acc_lo, mask=live[:, None])
        tl.store(o_part_ptr + part[:, None] * DL + half + dl[None, :], acc_hi, mask=live[:, None])
        tl.store(m_part_ptr + part, m_i, mask=live)
        tl.store(l_part_ptr + part, l_i, mask=live)


@triton.jit
def _merge(o_part_ptr, m_part_ptr, l_part_ptr, w0, n_split, R, rows, rok, dl,
           DL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """The normalized output `[BLOCK_M, BLOCK_D]` of query rows `rows` (valid where rok),
    latent columns dl, from the n_split work items w0.. of their stream: one online pass,
    BLOCK_S items per load (one load for up to BLOCK_S chunks: no chain of small dependent
    loads)."""
    sp = tl.arange(0, BLOCK_S)
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_all = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s0 in range(0, n_split, BLOCK_S):
        ok = ((s0 + sp) < n_split)[:, None] & rok[None, :]                                 # [BS, BM]
        part = (w0 + s0 + sp)[:, None] * R + rows[None, :]                                 # [BS, BM]
        m = tl.load(m_part_ptr + part, mask=ok, other=float("-inf"))
        l = tl.load(l_part_ptr + part, mask=ok, other=0.0)
        o = tl.load(o_part_ptr + part[:, :, None] * DL + dl[None, None, :], mask=ok[:, :, None], other=0.0)
        m_new = tl.maximum(m_all, tl.max(m, axis=0))                                       # [BM]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_all - m_safe)
        w = tl.exp2(m - m_safe[None, :])                                                   # [BS, BM]
        l_all = l_all * alpha + tl.sum(w * l, axis=0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, axis=0)                     # [BM, BD]
        m_all = m_new
    return acc / tl.where(l_all == 0.0, 1.0, l_all)[:, None]      # l = 0 only on padding rows


@triton.jit
def _stream_items(plen_ptr, b, B, T, P, BB: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
                  MAX_CHUNKS: tl.constexpr):
    """(first work item, number of items) of stream b under `_work_split`."""
    lens, n_chunks, first, chunk = _work_split(plen_ptr, B, T, P, BB, BLOCK_N, MIN_CHUNK, MAX_CHUNKS)
    sb = tl.arange(0, BB)
    return tl.sum(tl.where(sb == b, first, 0), axis=0).to(tl.int64), tl.sum(tl.where(sb == b, n_chunks, 0), axis=0)


@triton.jit
def _mla_combine_kernel(
    o_part_ptr, m_part_ptr, l_part_ptr,   # fp32 [W, R, DL], [W, R], [W, R]
    plen_ptr,
    out_ptr, so_b, so_t, so_h,            # [B, T, H, DL]
    B, T, H, R, P,
    DL: tl.constexpr, BB: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr, MAX_CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    """Program (query block, latent block, stream): merge the stream's work items (the same
    `_work_split` as the split kernel), `_merge`."""
    mb, db, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    w0, n_split = _stream_items(plen_ptr, b, B, T, P, BB, BLOCK_N, MIN_CHUNK, MAX_CHUNKS)
    pdl.enter(PDL)                                     # the split kernel's partials are written
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rok = rows < R
    t = rows // H
    h = rows % H
    dl = db * BLOCK_D + tl.arange(0, BLOCK_D)
    o = _merge(o_part_ptr, m_part_ptr, l_part_ptr, w0, n_split, R, rows, rok, dl, DL, BLOCK_M, BLOCK_D, BLOCK_S)
    tl.store(out_ptr + b.to(tl.int64) * so_b + t[:, None] * so_t + h[:, None] * so_h + dl[None, :],
             o.to(out_ptr.dtype.element_ty), mask=rok[:, None])


@triton.jit
def _mla_combine_proj_kernel(
    o_part_ptr, m_part_ptr, l_part_ptr,   # fp32 [W, R, DL], [W, R], [W, R]
    plen_ptr,
    wv_ptr, s_wh, s_wv,                   # value projection [H, DV, DL] (unit last stride)
    out_ptr, so_b, so_t, so_h,            # [B, T, H, DV]
    B, T, H, R, P,
    DL: tl.constexpr, BB: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr, MAX_CHUNKS: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    """Program (query row, value block, stream): the row's merged output over all DL latent
    columns (`_merge`), rounded to out's dtype as a stored output would be, times its head's
    projection rows v (BLOCK_V of them; fp32 products). The projection tile is static, so
    it is loaded before the PDL wait."""
    r, vb, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    w0, n_split = _stream_items(plen_ptr, b, B, T, P, BB, BLOCK_N, MIN_CHUNK, MAX_CHUNKS)
    t, h = r // H, r % H
    v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    dl = tl.arange(0, DL)
    wv = tl.load(wv_ptr + h.to(tl.int64) * s_wh + v[:, None] * s_wv + dl[None, :])            # [BV, DL]
    pdl.enter(PDL)                                     # the split kernel's partials are written
    rows = r + tl.zeros([1], tl.int32)
    o = _merge(o_part_ptr, m_part_ptr, l_part_ptr, w0, n_split, R, rows, rows < R, dl, DL, 1, DL, BLOCK_S)  # [1, DL]
    o = o.to(out_ptr.dtype.element_ty).to(tl.float32)
    y = tl.sum(wv.to(tl.float32) * o, axis=1)                                                    # [BV]
    tl.store(out_ptr + b.to(tl.int64) * so_b + t * so_t + h * so_h + v, y.to(out_ptr.dtype.element_ty))


def _chunks_per_load(tile_values: int) -> int:
    """Work items a merge program loads at once for a partial tile of `tile_values` fp32
    (rows x latent columns): 8192 values a load, 2 to 32 items."""
    return max(2, min(32, 8192 // tile_values))


def _n_sm(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def mla_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                  prefix_len: torch.Tensor, visible: torch.Tensor, scale: float, *,
                  block_m: int | None = None, block_n: int | None = None, num_splits: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  waves: float | None = None, min_chunk: int | None = None, use_pdl: bool | None = None,
                  merge_tile: tuple[int, int, int] | None = None, out_proj: torch.Tensor | None = None,
                  pdl_mode: int | None = None, max_chunks: int | None = None) -> torch.Tensor:
    """Triton MLA attention with `mla_attention_ref`'s signature and semantics.

    q_lat `[B, T, H, L]`, q_rope `[B, T, H, R]`, ckv `[B, S, L]`, kpe `[B, S, R]`, prefix_len
    int `[B]`, visible bool `[B, T, T]` -> `[B, T, H, L]` in q's dtype. Stream b attends to
    its prefix_len[b] cached positions plus the new tokens at prefix_len[b].. that
    `visible` allows (tree verify; T=1 decode; causal `visible` for prefill). S (the cache
    capacity) may be far larger than the live lengths: only prefix + T positions are read,
    and the work is sized from the live lengths, not from S.

    Flash-decoding without a host sync (CUDA-graph safe): the grid has a fixed number of
    work items, P + B, with P = `waves` x SMs / query blocks (default 2, two programs per
    SM; DECODE_WAVES = 1 for decode-size calls). The kernel reads `prefix_len` on the
    device and cuts the live KV of all streams into chunks of one size (at least `min_chunk`
    positions, default 32, and long enough that no stream has more than `MAX_CHUNKS`) so
    that they fill at most those items; streams of different lengths get different numbers of chunks,
    surplus items exit at once, and a second kernel merges each stream's chunks
    (`merge_tile` = (latent columns, chunks per load, warps) of its programs). Both launch
    with programmatic dependent launch in `kernels.pdl` mode `pdl_mode` where the GPU has it
    (None: its default; `use_pdl` True / False: mode 2 / off).
    `max_chunks` overrides `MAX_CHUNKS` (0: no cap). `num_splits` = n sets P = n x B instead (n = 1: one program per stream, no merge).
    L and R must be powers of two (512 and 64 on K2.6). The keyword knobs override the
    heuristics (tuned on the H200: `docs/notes/tree.md`).
    out_proj: each head's value projection `[H, Dv, L]` (unit last stride) -> the output
    times it, `[B, T, H, Dv]`, as `mla_attention_ref(.., out_proj)`; for decode-size calls
    with a merge the merge programs do the product (`_mla_combine_proj_kernel`: one launch
    fewer), else it is `project` after the attention.
    """
    b, t, h, dl = q_lat.shape
    dr = kpe.shape[-1]
    max_chunks = MAX_CHUNKS if max_chunks is None else max_chunks
    for x in (q_lat, q_rope, ckv, kpe):
        if x.stride(-1) != 1:
            raise ValueError("mla_attention needs the last dim of q and the cache contiguous")
    if dl & (dl - 1) or dr & (dr - 1):
        raise ValueError(f"latent {dl} and rope {dr} dims must be powers of two")
    rows = t * h
    dev = q_lat.device
    small = rows <= 16                                 # decode / tiny tree: bandwidth-bound
    if block_m is None:
        block_m = 16 if small else 32
    if block_n is None:
        block_n = DECODE_BLOCK_N if small else 32 if dl < 256 else 64
    if num_warps is None:
        num_warps = DECODE_WARPS if small else 4 if block_m <= 16 else 8
    if num_stages is None:
        num_stages = DECODE_STAGES if small else 2     # 32 x 576 bf16 tiles: 2 in flight, 2 programs/SM
    if min_chunk is None:
        # 32 with the MAX_CHUNKS cap (see there; experiments/scripts/attn_probe.py)
        min_chunk = MIN_CHUNK if num_splits is None else block_n
    min_chunk = triton.cdiv(min_chunk, block_n) * block_n
    n_mb = triton.cdiv(rows, block_m)
    if num_splits is not None:
        n_work = num_splits * b
    else:
        if waves is None:
            waves = DECODE_WAVES if small else 2.0
        n_work = max(b, int(waves * _n_sm(dev)) // n_mb)
    direct = n_work <= b
    out = torch.empty(b, t, h, dl, dtype=q_lat.dtype, device=dev)
    vis = visible if visible.stride(-1) == 1 else visible.contiguous()
    vis = vis.view(torch.uint8)
    n_prog = b if direct else n_work + b               # chunks never exceed P + B (see _work_split)
    if direct:
        o_part = m_part = l_part = out                 # unused
    else:
        o_part = torch.empty(n_prog, rows, dl, dtype=torch.float32, device=dev)
        m_part = torch.empty(n_prog, rows, dtype=torch.float32, device=dev)
        l_part = torch.empty(n_prog, rows, dtype=torch.float32, device=dev)
    prec = "ieee" if q_lat.dtype == torch.float32 else "tf32"
    on = (pdl.on(q_lat) if pdl_mode is None else pdl.on(q_lat, pdl_mode)) if use_pdl is None else 2 * bool(use_pdl)
    plen = prefix_len if prefix_len.device == dev else prefix_len.to(dev)
    bb = triton.next_power_of_2(b)
    _mla_split_kernel[(n_mb, n_prog)](
        q_lat, q_rope, q_lat.stride(0), q_lat.stride(1), q_lat.stride(2),
        q_rope.stride(0), q_rope.stride(1), q_rope.stride(2),
        ckv, kpe, ckv.stride(0), ckv.stride(1), kpe.stride(0), kpe.stride(1),
        plen, vis, vis.stride(0), vis.stride(1),
        o_part, m_part, l_part,
        out, out.stride(0), out.stride(1), out.stride(2),
        b, t, h, rows, n_work, scale * LOG2E,
        DL=dl, DR=dr, BB=bb, MIN_CHUNK=min_chunk, MAX_CHUNKS=max_chunks, BLOCK_M=block_m, BLOCK_N=block_n, DIRECT=direct,
        PREC=prec, num_warps=num_warps, num_stages=num_stages, **pdl.args(on))
    if not direct and out_proj is not None and small and FUSE_PROJ:
        dv = out_proj.shape[1]
        if out_proj.stride(-1) != 1 or out_proj.shape[0] != h or out_proj.shape[2] != dl:
            raise ValueError(f"mla_attention: out_proj {tuple(out_proj.shape)} is not [{h}, Dv, {dl}] with unit last stride")
        bv = min(PROJ_BLOCK_V, triton.next_power_of_2(dv))
        if dv % bv:
            raise ValueError(f"mla_attention: out_proj's Dv = {dv} is not a multiple of {bv}")
        o = torch.empty(b, t, h, dv, dtype=q_lat.dtype, device=dev)
        _mla_combine_proj_kernel[(rows, dv // bv, b)](
            o_part, m_part, l_part, plen, out_proj, out_proj.stride(0), out_proj.stride(1),
            o, o.stride(0), o.stride(1), o.stride(2), b, t, h, rows, n_work,
            DL=dl, BB=bb, BLOCK_N=block_n, MIN_CHUNK=min_chunk, MAX_CHUNKS=max_chunks, BLOCK_V=bv,
            BLOCK_S=_chunks_per_load(dl), num_warps=4, **pdl.args(on))
        return o
    if not direct:
        # [BLOCK_S, BM, BD] fp32 partials per load, 8192 values; decode (<= 16 rows): 2 warps
        # (1.0 us less than 4 at 10 x 8k on the H200: less of the sum over chunks crosses warps)
        bm, bd = min(16, triton.next_power_of_2(rows)), min(32, dl)
        bs = _chunks_per_load(bm * bd)
        bd, bs, merge_warps = merge_tile or (bd, bs, 2 if small else 4)
        _mla_combine_kernel[(triton.cdiv(rows, bm), dl // bd, b)](
            o_part, m_part, l_part, plen, out, out.stride(0), out.stride(1), out.stride(2),
            b, t, h, rows, n_work, DL=dl, BB=bb, BLOCK_N=block_n, MIN_CHUNK=min_chunk, MAX_CHUNKS=max_chunks,
            BLOCK_M=bm, BLOCK_D=bd, BLOCK_S=bs, num_warps=merge_warps, **pdl.args(on))
    return out if out_proj is None else project(out, out_proj)
