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
                      prefix_len: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference (fp32 softmax).

    q_lat `[B, T, H, L]`, q_rope `[B, T, H, R]`, ckv `[B, S, L]`, kpe `[B, S, R]`,
    prefix_len int `[B]`, visible bool `[B, T, T]` -> `[B, T, H, L]` in q's dtype.
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
    return torch.einsum("bths,bsl->bthl", p, ckv.float()).to(q_lat.dtype)


# --------------------------------------------------------------------------------------
# Triton: split-K (flash-decoding) over the cached prefix + tree nodes
# --------------------------------------------------------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

LOG2E = 1.4426950408889634


@triton.jit
def _mla_split_kernel(
    # queries [B, T, H, DL] and [B, T, H, DR] (last dim contiguous)
    q_lat_ptr, q_rope_ptr, sq_b, sq_t, sq_h, sr_b, sr_t, sr_h,
    # cache [B, S, DL] and [B, S, DR] (last dim contiguous)
    ckv_ptr, kpe_ptr, sc_b, sc_s, sk_b, sk_s,
    # per stream: prefix length [B]; visibility among the new tokens uint8 [B, T, T]
    plen_ptr, vis_ptr, sv_b, sv_t,
    # partials fp32: acc [B, NS, R, DL], running max and sum [B, NS, R]  (DIRECT: unused)
    o_part_ptr, m_part_ptr, l_part_ptr,
    # DIRECT: final output [B, T, H, DL]
    out_ptr, so_b, so_t, so_h,
    # sizes
    T, H, R, NS, chunk, qk_scale,       # R = T*H query rows; chunk = KV positions per split
    DL: tl.constexpr, DR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, PREC: tl.constexpr,
):
    """Program (query block, split, stream): BLOCK_M query rows (row = t*H + h) against KV
    positions [split*chunk, min((split+1)*chunk, prefix+T)) with an online softmax in
    base 2; writes unnormalized acc + (max, sum) for `_mla_combine_kernel`, or with
    DIRECT (one split) the normalized output."""
    mb, sp, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b64 = b.to(tl.int64)
    plen = tl.load(plen_ptr + b).to(tl.int32)
    kv_len = plen + T
    start = sp * chunk
    end = tl.minimum(start + chunk, kv_len)

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rok = rows < R
    t = rows // H
    h = rows % H
    dl = tl.arange(0, DL)
    dr = tl.arange(0, DR)
    q = tl.load(q_lat_ptr + b64 * sq_b + t[:, None] * sq_t + h[:, None] * sq_h + dl[None, :],
                mask=rok[:, None], other=0.0)                                     # [BM, DL]
    qr = tl.load(q_rope_ptr + b64 * sr_b + t[:, None] * sr_t + h[:, None] * sr_h + dr[None, :],
                 mask=rok[:, None], other=0.0)                                    # [BM, DR]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DL], tl.float32)
    ckv = ckv_ptr + b64 * sc_b
    kpe = kpe_ptr + b64 * sk_b
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pok = pos < end
        k = tl.load(ckv + pos[:, None] * sc_s + dl[None, :], mask=pok[:, None], other=0.0)   # [BN, DL]
        kr = tl.load(kpe + pos[:, None] * sk_s + dr[None, :], mask=pok[:, None], other=0.0)  # [BN, DR]
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        s = tl.dot(qr, tl.trans(kr), s, input_precision=PREC) * qk_scale                    # [BM, BN]
        node = pos - plen                                                                    # tree node or < 0
        mask = rok[:, None] & (pok & (node < 0))[None, :]
        if n0 + BLOCK_N > plen:                      # tile reaches the new tokens
            seen = tl.load(vis_ptr + b64 * sv_b + t[:, None] * sv_t + node[None, :],
                           mask=rok[:, None] & (pok & (node >= 0))[None, :], other=0)
            mask = mask | (seen != 0)
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(k.dtype), k, acc * alpha[:, None], input_precision=PREC)           # [BM, DL]
        m_i = m_new

    if DIRECT:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]         # l = 0 only on padding rows
        tl.store(out_ptr + b64 * so_b + t[:, None] * so_t + h[:, None] * so_h + dl[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=rok[:, None])
    else:
        live = rok & ((rows * 0 + start) < kv_len)
        part = (b64 * NS + sp) * R + rows                                                     # [BM]
        tl.store(o_part_ptr + part[:, None] * DL + dl[None, :], acc, mask=live[:, None])
        tl.store(m_part_ptr + part, m_i, mask=live)
        tl.store(l_part_ptr + part, l_i, mask=live)


@triton.jit
def _mla_combine_kernel(
    o_part_ptr, m_part_ptr, l_part_ptr,   # fp32 [B, NS, R, DL], [B, NS, R], [B, NS, R]
    plen_ptr,
    out_ptr, so_b, so_t, so_h,            # [B, T, H, DL]
    T, H, R, NS, chunk,
    DL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Program (query block, latent block, stream): merge the splits that hold any of this
    stream's KV, BLOCK_S splits per load so the loads are wide, not a chain of small ones."""
    mb, db, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b64 = b.to(tl.int64)
    kv_len = tl.load(plen_ptr + b).to(tl.int32) + T
    n_split = tl.minimum((kv_len + chunk - 1) // chunk, NS)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rok = rows < R
    t = rows // H
    h = rows % H
    dl = db * BLOCK_D + tl.arange(0, BLOCK_D)
    sp = tl.arange(0, BLOCK_S)
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s0 in range(0, n_split, BLOCK_S):
        ok = ((s0 + sp) < n_split)[:, None] & rok[None, :]                                 # [BS, BM]
        part = (b64 * NS + s0 + sp)[:, None] * R + rows[None, :]
        m_all = tl.maximum(m_all, tl.max(tl.load(m_part_ptr + part, mask=ok, other=float("-inf")), axis=0))
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    l_all = tl.zeros([BLOCK_M], tl.float32)
    for s0 in range(0, n_split, BLOCK_S):
        ok = ((s0 + sp) < n_split)[:, None] & rok[None, :]                                 # [BS, BM]
        part = (b64 * NS + s0 + sp)[:, None] * R + rows[None, :]
        w = tl.exp2(tl.load(m_part_ptr + part, mask=ok, other=float("-inf")) - m_all[None, :])
        l_all += tl.sum(w * tl.load(l_part_ptr + part, mask=ok, other=0.0), axis=0)
        o = tl.load(o_part_ptr + part[:, :, None] * DL + dl[None, None, :], mask=ok[:, :, None], other=0.0)
        acc += tl.sum(w[:, :, None] * o, axis=0)                                           # [BM, BD]
    o = acc / tl.where(l_all == 0.0, 1.0, l_all)[:, None]         # l = 0 only on padding rows
    tl.store(out_ptr + b64 * so_b + t[:, None] * so_t + h[:, None] * so_h + dl[None, :],
             o.to(out_ptr.dtype.element_ty), mask=rok[:, None])


def _n_sm(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def mla_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                  prefix_len: torch.Tensor, visible: torch.Tensor, scale: float, *,
                  block_m: int | None = None, block_n: int | None = None, num_splits: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """Triton MLA attention with `mla_attention_ref`'s signature and semantics.

    q_lat `[B, T, H, L]`, q_rope `[B, T, H, R]`, ckv `[B, S, L]`, kpe `[B, S, R]`, prefix_len
    int `[B]`, visible bool `[B, T, T]` -> `[B, T, H, L]` in q's dtype. Stream b attends to
    its prefix_len[b] cached positions plus the new tokens at prefix_len[b].. that
    `visible` allows (tree verify; T=1 decode; causal `visible` for prefill). Flash-decoding:
    the KV range [0, S) is cut into splits (sized from S, so no host sync) run in parallel
    and merged by a second kernel; splits past a stream's length exit at once. L and R
    must be powers of two (512 and 64 on K2.6). The keyword knobs override the heuristics.
    """
    b, t, h, dl = q_lat.shape
    s_len, dr = ckv.shape[1], kpe.shape[-1]
    for x in (q_lat, q_rope, ckv, kpe):
        if x.stride(-1) != 1:
            raise ValueError("mla_attention needs the last dim of q and the cache contiguous")
    if dl & (dl - 1) or dr & (dr - 1):
        raise ValueError(f"latent {dl} and rope {dr} dims must be powers of two")
    rows = t * h
    dev = q_lat.device
    if block_m is None:
        block_m = 16 if rows <= 16 else 32
    if block_n is None:
        block_n = 64 if dl >= 256 else 32
    if num_warps is None:
        num_warps = 4 if block_m <= 16 else 8
    if num_stages is None:
        num_stages = 2
    n_mb = triton.cdiv(rows, block_m)
    if num_splits is None:
        num_splits = max(1, min(2 * _n_sm(dev) // (b * n_mb), triton.cdiv(s_len, 4 * block_n)))
    chunk = triton.cdiv(triton.cdiv(s_len, num_splits), block_n) * block_n
    ns = triton.cdiv(s_len, chunk)
    direct = ns == 1
    out = torch.empty(b, t, h, dl, dtype=q_lat.dtype, device=dev)
    vis = visible if visible.stride(-1) == 1 else visible.contiguous()
    vis = vis.view(torch.uint8)
    if direct:
        o_part = m_part = l_part = out                 # unused
    else:
        o_part = torch.empty(b, ns, rows, dl, dtype=torch.float32, device=dev)
        m_part = torch.empty(b, ns, rows, dtype=torch.float32, device=dev)
        l_part = torch.empty(b, ns, rows, dtype=torch.float32, device=dev)
    prec = "ieee" if q_lat.dtype == torch.float32 else "tf32"
    plen = prefix_len if prefix_len.device == dev else prefix_len.to(dev)
    _mla_split_kernel[(n_mb, ns, b)](
        q_lat, q_rope, q_lat.stride(0), q_lat.stride(1), q_lat.stride(2),
        q_rope.stride(0), q_rope.stride(1), q_rope.stride(2),
        ckv, kpe, ckv.stride(0), ckv.stride(1), kpe.stride(0), kpe.stride(1),
        plen, vis, vis.stride(0), vis.stride(1),
        o_part, m_part, l_part,
        out, out.stride(0), out.stride(1), out.stride(2),
        t, h, rows, ns, chunk, scale * LOG2E,
        DL=dl, DR=dr, BLOCK_M=block_m, BLOCK_N=block_n, DIRECT=direct, PREC=prec,
        num_warps=num_warps, num_stages=num_stages)
    if not direct:
        bm, bd = min(16, triton.next_power_of_2(rows)), min(64, dl)
        _mla_combine_kernel[(triton.cdiv(rows, bm), dl // bd, b)](
            o_part, m_part, l_part, plen, out, out.stride(0), out.stride(1), out.stride(2),
            t, h, rows, ns, chunk, DL=dl, BLOCK_M=bm, BLOCK_D=bd, BLOCK_S=8, num_warps=4)
    return out
