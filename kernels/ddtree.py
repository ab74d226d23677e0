"""DDTree kernels: top-K extraction, tree builder, greedy accept and KV commit (docs/DESIGN.md §5).

Everything is batched over streams (one tree per stream) and free of host syncs, so a
decode step that uses these can be captured in a CUDA graph. Each kernel has a plain
torch/Python reference beside it (`*_ref`) that the tests compare against.

Tree layout, per stream, N = budget + 1 nodes: node 0 is the root (the bonus token the
caller already has), nodes 1..budget in the order the best-first search popped them, so
parent < child. A node at depth d took its token from drafter position d-1.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass
class Tree:
    """A batch of draft trees, N = budget + 1 nodes per stream.

    parent int32 `[B, N]`: -1 for the root, else parent < child.
    depth  int32 `[B, N]`: 0 for the root; also the position offset (`pos`).
    rank   int32 `[B, N]`: index into the top-K of drafter position depth-1; -1 for the root.
    token  `[B, N]` (token_ids' dtype): the node's token; the root's is -1, for the caller to fill.
    visible bool `[B, N, N]`: visible[b, i, j] iff node j is node i or one of its ancestors.
    """
    parent: torch.Tensor
    depth: torch.Tensor
    rank: torch.Tensor
    token: torch.Tensor
    visible: torch.Tensor

    @property
    def pos(self) -> torch.Tensor:
        """Position offset of each node from the root's position (= depth)."""
        return self.depth


def max_nodes(n_pos: int, k: int) -> int:
    """Number of distinct non-root prefixes over n_pos positions with k choices each."""
    total, level = 0, 1
    for _ in range(n_pos):
        level *= k
        total += level
        if total > 1 << 40:
            break
    return total


def _check_tree_inputs(logp: torch.Tensor, token_ids: torch.Tensor, budget: int) -> None:
    if logp.dim() != 3 or token_ids.shape != logp.shape:
        raise ValueError(f"logp and token_ids must both be [B, L, K]; got {tuple(logp.shape)} "
                         f"and {tuple(token_ids.shape)}")
    _, n_pos, k = logp.shape
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if budget > max_nodes(n_pos, k):
        raise ValueError(f"budget {budget} exceeds the {max_nodes(n_pos, k)} prefixes that "
                         f"{n_pos} positions x top-{k} allow")


# --------------------------------------------------------------------------------------
# top-K extraction
# --------------------------------------------------------------------------------------

def topk_from_logits(logits: torch.Tensor, k: int, chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position top-k of log_softmax(logits), sorted descending.

    logits `[B, L, V]` (any float dtype) -> (logp fp32 `[B, L, k]`, token ids int64 `[B, L, k]`).
    Runs on the logits' device with no host sync: topk of the raw logits (same order as of
    the log-probs) minus each position's logsumexp in fp32. A long vocab is cut into
    `chunk`-wide pieces (top-k of each, then of the candidates), which keeps the GPU busy
    where one top-k per position would run only B*L blocks.
    """
    b, n_pos, v = logits.shape
    if k < 1 or k > v:
        raise ValueError(f"k must be in 1..{v}, got {k}")
    if v % chunk == 0 and v >= 2 * chunk and k <= chunk:
        pv, pi = logits.view(b, n_pos, v // chunk, chunk).topk(k, dim=-1)          # [B, L, V/chunk, k]
        pi = pi + torch.arange(0, v, chunk, device=logits.device).view(1, 1, -1, 1)
        vals, j = pv.reshape(b, n_pos, -1).topk(k, dim=-1, sorted=True)          # [B, L, k]
        ids = pi.reshape(b, n_pos, -1).gather(-1, j)
    else:
        vals, ids = torch.topk(logits, k, dim=-1, sorted=True)                    # [B, L, k]
    lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True)                   # [B, L, 1]
    return vals.float() - lse, ids


# --------------------------------------------------------------------------------------
# tree builder
# --------------------------------------------------------------------------------------

def build_tree_ref(logp: torch.Tensor, token_ids: torch.Tensor, budget: int) -> Tree:
    """Plain-Python heap reference of the best-first builder (docs/DESIGN.md §5).

    logp `[B, L, K]` top-K log-probs sorted descending along K, token_ids `[B, L, K]`.
    A candidate is a tuple of ranks (one per depth) scored by the float32 sum of its
    log-probs; pop the best (ties: the lexicographically smaller rank tuple), append it as
    a node, push its next sibling and its first child; stop after `budget` nodes.
    """
    import numpy as np

    _check_tree_inputs(logp, token_ids, budget)
    b, n_pos, k = logp.shape
    n = budget + 1
    lp = logp.detach().float().cpu().numpy()
    tid = token_ids.detach().cpu()
    parent = torch.full((b, n), -1, dtype=torch.int32)
    depth = torch.zeros((b, n), dtype=torch.int32)
    rank = torch.full((b, n), -1, dtype=torch.int32)
    token = torch.full((b, n), -1, dtype=token_ids.dtype)
    for s in range(b):
        node_of = {(): 0}                                   # rank tuple -> node index
        score_of = {(): np.float32(0.0)}
        heap = [(-float(lp[s, 0, 0]), (0,))]
        for i in range(1, n):
            neg, ranks = heapq.heappop(heap)
            d, r = len(ranks), ranks[-1]
            up = ranks[:-1]
            node_of[ranks] = i
            score_of[ranks] = sc = np.float32(score_of[up] + lp[s, d - 1, r])
            parent[s, i], depth[s, i], rank[s, i] = node_of[up], d, r
            token[s, i] = tid[s, d - 1, r]
            if r + 1 < k:                                   # next sibling
                heapq.heappush(heap, (-float(np.float32(score_of[up] + lp[s, d - 1, r + 1])), up + (r + 1,)))
            if d < n_pos:                                   # first child
                heapq.heappush(heap, (-float(np.float32(sc + lp[s, d, 0])), ranks + (0,)))
    dev = logp.device
    vis = _visible_ref(parent, depth)
    return Tree(parent.to(dev), depth.to(dev), rank.to(dev), token.to(dev), vis.to(dev))


def _visible_ref(parent: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self matrix from parents: row i has node i and each ancestor set."""
    b, n = parent.shape
    vis = torch.zeros(b, n, n, dtype=torch.bool)
    for s in range(b):
        for i in range(n):
            j = i
            while j >= 0:
                vis[s, i, j] = True
                j = int(parent[s, j])
    return vis


@triton.jit
def _build_tree_kernel(
    # inputs: per-position top-K, last dim contiguous
    logp_ptr, tok_ptr,            # [B, L, K] fp32 log-probs sorted descending; token ids
    s_lb, s_ll, s_tb, s_tl,       # strides of logp and token_ids (stream, position)
    # outputs, contiguous [B, N]
    parent_ptr, depth_ptr, rank_ptr, token_ptr,
    # sizes
    N, L, K,                      # nodes (budget + 1), positions, top-K
    F: tl.constexpr,              # node slots, a power of two >= N
):
    """One program per stream. Slot v holds tree node v and its one candidate: v's next
    child (rank nchild[v] at position depth[v]). The best candidate is one int64 max:
    [score as ordered int32 | 2047 - postorder(v) | v | depth(v)]; candidates compare like
    their rank tuples when the scores tie because lexicographic order of the candidates
    is the postorder of their parents (a deeper candidate of the same line sorts first)."""
    b = tl.program_id(0)
    idx = tl.arange(0, F)
    lp = logp_ptr + b * s_lb
    tk = tok_ptr + b * s_tb
    out = b * N
    neg_inf = float("-inf")
    zero = idx * 0                                     # int32 zeros, to splat a scalar address

    is_root = idx == 0
    exists = is_root
    score = tl.zeros([F], tl.float32)                  # path score of node v
    depth = tl.zeros([F], tl.int32)
    parent = tl.where(is_root, -1, 0)
    nchild = tl.zeros([F], tl.int32)                   # children popped = rank of v's candidate
    post = tl.where(is_root, 0, 4095)                  # postorder index among existing nodes
    live = is_root                                     # v has a candidate (L, K >= 1)
    cand = tl.load(lp + zero, mask=live, other=neg_inf)
    tl.store(rank_ptr + out + idx, -1 + zero, mask=is_root)

    for n in range(1, N):
        # -- pick the best candidate --
        s = tl.where(cand == 0.0, 0.0, cand)                        # -0.0 -> +0.0
        bits = s.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)       # int order == float order
        key = ((ordered.to(tl.int64) << 32) | ((2047 - post).to(tl.int64) << 21)
               | (idx.to(tl.int64) << 10) | depth.to(tl.int64))
        key = tl.where(live, key, -2**63)
        best = tl.max(key, axis=0)
        v = ((best >> 10) & 2047).to(tl.int32)
        dv = (best & 1023).to(tl.int32)
        pv = (2047 - ((best >> 21) & 2047)).to(tl.int32)
        hi = (best >> 32).to(tl.int32)
        sn = tl.where(hi < 0, hi ^ 0x7FFFFFFF, hi).to(tl.float32, bitcast=True)
        sel = idx == v

        # -- node n = (v, nchild[v]); its rank is known only in v's lane --
        tl.store(rank_ptr + out + n + zero, nchild, mask=sel)

        # -- v's candidate moves to its next child rank --
        nchild = nchild + sel.to(tl.int32)
        more = nchild < K
        lpv = tl.load(lp + depth * s_ll + nchild, mask=sel & more, other=neg_inf)
        cand = tl.where(sel, score + lpv, cand)
        live = tl.where(sel, more, live)

        # -- n enters the tree: postorder right before v; its candidate is its first child --
        post = tl.where(exists & (post >= pv), post + 1, post)
        seln = idx == n
        post = tl.where(seln, pv, post)
        exists = exists | seln
        score = tl.where(seln, sn, score)
        depth = tl.where(seln, dv + 1, depth)
        parent = tl.where(seln, v, parent)
        deeper = dv + 1 < L
        lpn = tl.load(lp + tl.minimum(dv + 1, L - 1) * s_ll)            # one scalar load
        cand = tl.where(seln, tl.where(deeper, sn + lpn, neg_inf), cand)
        live = tl.where(seln, deeper, live)

    # -- outputs: whole vectors; tokens gathered by (depth - 1, rank) after the rank stores --
    ok = idx < N
    tl.store(parent_ptr + out + idx, parent, mask=ok)
    tl.store(depth_ptr + out + idx, depth, mask=ok)
    tl.debug_barrier()                                 # rank was stored lane-by-lane above
    rank = tl.load(rank_ptr + out + idx, mask=ok & (idx > 0), other=0)
    tok = tl.load(tk + (depth - 1) * s_tl + rank, mask=ok & (idx > 0), other=-1)
    tl.store(token_ptr + out + idx, tok.to(token_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _visible_kernel(
    parent_ptr,                   # int32 [B, N]
    vis_ptr,                      # uint8 [B, N, N] (a bool tensor's bytes)
    N, max_depth,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Tile (rows, cols) of stream b: walk each row's ancestor chain (<= max_depth + 1
    nodes including itself) and mark the columns it passes."""
    b, rb, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cur = tl.where(rows < N, rows, -1)
    hit = tl.zeros([BLOCK_R, BLOCK_C], tl.int1)
    for _ in range(max_depth + 1):
        hit = hit | (cols[None, :] == cur[:, None])
        up = tl.load(parent_ptr + b * N + cur, mask=cur >= 0, other=-1)
        cur = tl.where(cur >= 0, up, -1)
    mask = (rows[:, None] < N) & (cols[None, :] < N)
    tl.store(vis_ptr + b * N * N + rows[:, None] * N + cols[None, :], hit.to(tl.uint8), mask=mask)


def visible_from_parent(parent: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Ancestor-or-self matrix bool `[B, N, N]` from parent int32 `[B, N]` (tree depth <= max_depth)."""
    b, n = parent.shape
    vis = torch.empty(b, n, n, dtype=torch.bool, device=parent.device)
    blk = 64 if n >= 64 else triton.next_power_of_2(n)
    grid = (b, triton.cdiv(n, blk), triton.cdiv(n, blk))
    _visible_kernel[grid](parent.contiguous(), vis.view(torch.uint8), n, max_depth,
                          BLOCK_R=blk, BLOCK_C=blk, num_warps=4)
    return vis


def build_tree(logp: torch.Tensor, token_ids: torch.Tensor, budget: int, num_warps: int | None = None) -> Tree:
    """Best-first DDTree builder on the GPU (or the Triton interpreter); equals `build_tree_ref`.

    logp `[B, L, K]` per-position top-K log-probs sorted descending along K (fp32 scores;
    other float dtypes are converted), token_ids int `[B, L, K]`, budget <= 2046
    (may exceed K). One program per stream; no host sync, CUDA-graph capturable.
    Returns a `Tree` (root token -1 and root rank -1: the caller fills the root's token).
    """
    _check_tree_inputs(logp, token_ids, budget)
    if budget > 2046:
        raise ValueError(f"budget {budget} > 2046 (node indices are packed in 11 bits)")
    b, n_pos, k = logp.shape
    if n_pos > 1023:
        raise ValueError(f"{n_pos} positions > 1023 (depths are packed in 10 bits)")
    n = budget + 1
    lp = logp.float()
    if lp.stride(-1) != 1:
        lp = lp.contiguous()
    tid = token_ids if token_ids.stride(-1) == 1 else token_ids.contiguous()
    dev = logp.device
    parent = torch.empty(b, n, dtype=torch.int32, device=dev)
    depth = torch.empty_like(parent)
    rank = torch.empty_like(parent)
    token = torch.empty(b, n, dtype=tid.dtype, device=dev)
    f = max(triton.next_power_of_2(n), 32)
    if num_warps is None:
        num_warps = min(max(f // 128, 1), 16)
    _build_tree_kernel[(b,)](lp, tid, lp.stride(0), lp.stride(1), tid.stride(0), tid.stride(1),
                             parent, depth, rank, token, n, n_pos, k, F=f, num_warps=num_warps)
    vis = visible_from_parent(parent, min(n_pos, budget))
    return Tree(parent, depth, rank, token, vis)


# --------------------------------------------------------------------------------------
# greedy accept
# --------------------------------------------------------------------------------------

def greedy_accept_ref(parent: torch.Tensor, token: torch.Tensor, target_argmax: torch.Tensor,
                      max_depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference for `greedy_accept` (a Python walk per stream)."""
    b, n = parent.shape
    a = (n - 1 if max_depth is None else max_depth) + 1
    par, tok, am = parent.tolist(), token.tolist(), target_argmax.tolist()
    accepted = torch.full((b, a), -1, dtype=torch.int32)
    n_acc = torch.zeros(b, dtype=torch.int32)
    bonus = torch.zeros(b, dtype=torch.int64)
    for s in range(b):
        path, cur = [0], 0
        while len(path) < a:
            kids = [j for j in range(1, n) if par[s][j] == cur and tok[s][j] == am[s][cur]]
            if not kids:
                break
            cur = kids[0]
            path.append(cur)
        accepted[s, :len(path)] = torch.tensor(path, dtype=torch.int32)
        n_acc[s], bonus[s] = len(path), am[s][cur]
    dev = parent.device
    return accepted.to(dev), n_acc.to(dev), bonus.to(dev)


@triton.jit
def _accept_kernel(
    parent_ptr, token_ptr, am_ptr,     # [B, N]: tree parents, node tokens, target argmax per node
    s_pb, s_tb, s_ab,                  # stream strides (last dims contiguous)
    acc_ptr, nacc_ptr, bonus_ptr,      # out: int32 [B, A] path, int32 [B], int64 [B]
    N, A,
    BLOCK: tl.constexpr, BLOCK_A: tl.constexpr,
):
    """One program per stream: from the root, step to the (first) child whose token is the
    target's argmax at the current node, until none matches or A nodes are on the path."""
    b = tl.program_id(0)
    idx = tl.arange(0, BLOCK)
    ok = idx < N
    par = tl.load(parent_ptr + b * s_pb + idx, mask=ok, other=-2)
    tok = tl.load(token_ptr + b * s_tb + idx, mask=ok, other=-1).to(tl.int64)
    am = tl.load(am_ptr + b * s_ab + idx, mask=ok, other=-1).to(tl.int64)
    ai = tl.arange(0, BLOCK_A)
    path = tl.where(ai == 0, 0, -1)
    cur = tl.zeros([], tl.int32)
    n_acc = tl.zeros([], tl.int32) + 1
    tgt = tl.sum(tl.where(idx == 0, am, 0), axis=0)
    go = n_acc < A
    while go:
        match = (par == cur) & (tok == tgt)
        c = tl.min(tl.where(match, idx, BLOCK), axis=0)
        found = c < BLOCK
        path = tl.where((ai == n_acc) & found, c, path)
        cur = tl.where(found, c, cur)
        tgt = tl.sum(tl.where(idx == cur, am, 0), axis=0)
        n_acc = n_acc + found.to(tl.int32)
        go = found & (n_acc < A)
    tl.store(acc_ptr + b * A + ai, path, mask=ai < A)
    tl.store(nacc_ptr + b, n_acc)
    tl.store(bonus_ptr + b, tgt)


def greedy_accept(parent: torch.Tensor, token: torch.Tensor, target_argmax: torch.Tensor,
                  max_depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy tree acceptance (docs/DESIGN.md §5), batched over streams, no host sync.

    parent `[B, N]`, token `[B, N]` (the tree's), target_argmax `[B, N]` (the target's
    argmax token after each node). From the root, follow the child whose token equals the
    target's argmax at the current node (the lowest-index one if several match).
    Returns (accepted int32 `[B, max_depth+1]` node indices root first, -1 padded;
    n_accepted int32 `[B]`, counting the root, so it is also the tokens gained this round
    including the bonus; bonus int64 `[B]` = the target's argmax at the last accepted
    node). max_depth (default N-1) must be >= the tree's depth.
    """
    b, n = parent.shape
    a = (n - 1 if max_depth is None else max_depth) + 1
    parent, token, target_argmax = (x if x.stride(-1) == 1 else x.contiguous()
                                    for x in (parent, token, target_argmax))
    dev = parent.device
    accepted = torch.empty(b, a, dtype=torch.int32, device=dev)
    n_acc = torch.empty(b, dtype=torch.int32, device=dev)
    bonus = torch.empty(b, dtype=torch.int64, device=dev)
    blk = max(triton.next_power_of_2(n), 32)
    _accept_kernel[(b,)](parent, token, target_argmax, parent.stride(0), token.stride(0),
                         target_argmax.stride(0), accepted, n_acc, bonus, n, a,
                         BLOCK=blk, BLOCK_A=max(triton.next_power_of_2(a), 2),
                         num_warps=1 if blk <= 256 else 4)
    return accepted, n_acc, bonus


# --------------------------------------------------------------------------------------
# KV commit
# --------------------------------------------------------------------------------------

def commit_kv_ref(ckv: torch.Tensor, kpe: torch.Tensor, prefix_len: torch.Tensor,
                  accepted: torch.Tensor) -> None:
    """Move accepted tree nodes' KV to contiguous positions after each stream's prefix, in place.

    ckv `[B, S, L]`, kpe `[B, S, R]`; node j of stream b sits at cache position
    prefix_len[b] + j; accepted int `[B, A]` lists node indices root first, -1 padded.
    Entry i goes to prefix_len[b] + i. No host sync.
    """
    b, a = accepted.shape
    plen = prefix_len.long().view(b, 1)
    valid = accepted >= 0                                                   # [B, A]
    src = plen + accepted.long().clamp_min(0)                               # [B, A]
    dst = plen + torch.arange(a, device=accepted.device).view(1, a)         # [B, A]
    for cache in (ckv, kpe):
        d = cache.shape[-1]
        rows = cache.gather(1, src.unsqueeze(-1).expand(b, a, d))            # read all first
        old = cache.gather(1, dst.unsqueeze(-1).expand(b, a, d))
        cache.scatter_(1, dst.unsqueeze(-1).expand(b, a, d), torch.where(valid.unsqueeze(-1), rows, old))


@triton.jit
def _commit_kernel(
    ckv_ptr, kpe_ptr,                 # [B, S, DL], [B, S, DR], last dim contiguous
    s_cb, s_cs, s_kb, s_ks,           # stream and position strides
    plen_ptr, acc_ptr, s_ab,          # prefix_len [B]; accepted [B, A]
    A, DL, DR,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_A: tl.constexpr,
):
    """One program per stream: copy row prefix+accepted[i] -> prefix+i for i = 0, 1, ...
    in order. Paths increase (parent < child), so accepted[i] >= i and a row is never
    read after it was overwritten; each thread copies the same columns every time."""
    b = tl.program_id(0)
    plen = tl.load(plen_ptr + b).to(tl.int64)
    ai = tl.arange(0, BLOCK_A)
    path = tl.load(acc_ptr + b * s_ab + ai, mask=ai < A, other=-1)
    cl = tl.arange(0, BLOCK_L)
    cr = tl.arange(0, BLOCK_R)
    ckv = ckv_ptr + b.to(tl.int64) * s_cb
    kpe = kpe_ptr + b.to(tl.int64) * s_kb
    i = tl.zeros([], tl.int32)
    node = tl.sum(tl.where(ai == 0, path, 0), axis=0)
    while node >= 0:
        if node != i:
            src, dst = plen + node, plen + i
            x = tl.load(ckv + src * s_cs + cl, mask=cl < DL)
            tl.store(ckv + dst * s_cs + cl, x, mask=cl < DL)
            y = tl.load(kpe + src * s_ks + cr, mask=cr < DR)
            tl.store(kpe + dst * s_ks + cr, y, mask=cr < DR)
        i += 1
        node = tl.max(tl.where(ai == i, path, -1), axis=0)


def commit_kv(ckv: torch.Tensor, kpe: torch.Tensor, prefix_len: torch.Tensor,
              accepted: torch.Tensor) -> None:
    """Triton `commit_kv_ref`: in place, no host sync. ckv `[B, S, L]`, kpe `[B, S, R]`,
    prefix_len int `[B]`, accepted int `[B, A]` root first, -1 padded, increasing
    (as `greedy_accept` returns it; parent < child guarantees it)."""
    b, a = accepted.shape
    if ckv.stride(-1) != 1 or kpe.stride(-1) != 1:
        raise ValueError("commit_kv needs the caches' last dim contiguous")
    acc = accepted if accepted.stride(-1) == 1 else accepted.contiguous()
    dl, dr = ckv.shape[-1], kpe.shape[-1]
    _commit_kernel[(b,)](ckv, kpe, ckv.stride(0), ckv.stride(1), kpe.stride(0), kpe.stride(1),
                         prefix_len, acc, acc.stride(0), a, dl, dr,
                         BLOCK_L=triton.next_power_of_2(dl), BLOCK_R=triton.next_power_of_2(dr),
                         BLOCK_A=max(triton.next_power_of_2(a), 2), num_warps=4)
