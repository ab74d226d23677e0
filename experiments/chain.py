"""A chain of dependent one-row GEMVs, one launch a phase or one persistent launch: the probe
of a persistent decode layer (docs/notes/decode.md).

At concurrency 1 each dense GEMM of the decode step is a matrix-vector product that waits for
the one before it; the step pays a kernel boundary at every dependency. Phase p of a chain
computes y_p = W_p x_p (x_p the input or the first K_p values of an earlier phase's output);
its tiles (BN rows of W x one K split) are dealt round robin over a fixed grid of programs,
each split adding its partial sums into y_p with fp32 atomics. Modes (`run`, `MODES`):
- "launch": one launch a phase, chained with PDL (kernels.pdl) as the engine's kernels are;
- "preload": the same, each program loading its first [BN, BK] chunk of weights before the
  PDL wait (weights depend on nothing), as kernels.skinny's PRELOAD does;
- "barrier": the whole chain in one launch, a grid barrier between phases (`_arrive`: a
  release increment of an L2 counter, `_wait`: spin until every program has arrived);
- "prefetch": the same, each program loading its first chunk of the next phase between
  arriving and waiting, so that the DRAM round trip overlaps the wait.
The barrier needs every program resident at once (at most what fits on the SMs, nothing
else running) and a GPU: the CPU interpreter runs programs one after another, so it runs
the launch modes only. `experiments/scripts/chain_probe.py` times them.

Each phase zeroes the next phase's output before the barrier (the last phase the first's,
for the next call), so the atomics always start from zero; the counter is zero again at exit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ddbench.kernels import pdl, ticket
from ddbench.kernels.device import sm_count

# phase table columns (int64): W's offset, its shape, x's and y's offsets, row blocks, K splits,
# K per split, the region zeroed (offset, length)
W_OFF, N, K, X_OFF, Y_OFF, N_BLOCKS, SPLITS, K_PER, Z_OFF, Z_N = (tl.constexpr(i) for i in range(10))
COLS = tl.constexpr(10)
ZERO_BLOCK = tl.constexpr(1024)
MODES = ("launch", "preload", "barrier", "prefetch")
MAX_RESIDENT_PER_SM = 2   # barrier modes: programs an SM known to fit (122 registers, 27 KB shared at BK 256)


@triton.jit
def _arrive(bar_ptr):
    """This program is done with the phase: after its stores (block barrier), one release
    increment of the counter at GPU scope."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait(bar_ptr, target):
    """Spin (acquire loads) until the counter reaches `target` arrivals."""
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _phase(w_ptr, row, BK: tl.constexpr):
    """Table row `row` -> the phase's n, k, K splits, K per split, tiles and W pointer."""
    k = tl.multiple_of(tl.load(row + K).to(tl.int32), 8)            # (16-byte weight loads)
    splits = tl.load(row + SPLITS).to(tl.int32)
    kper = tl.multiple_of(tl.load(row + K_PER).to(tl.int32), BK)
    tiles = tl.load(row + N_BLOCKS).to(tl.int32) * splits
    return tl.load(row + N).to(tl.int32), k, splits, kper, tiles, w_ptr + tl.multiple_of(tl.load(row + W_OFF), 8)


@triton.jit
def _tile(t, n, k, splits, kper, rows):
    """Tile t: its W rows (and which exist) and its K range [k_beg, k_end)."""
    n_idx = (t // splits) * rows.shape[0] + rows
    k_beg = (t % splits) * kper
    return n_idx, n_idx < n, k_beg, tl.minimum(k, k_beg + kper)


@triton.jit
def _first_chunk(w_ptr, row, pid, rows, kk):
    """Program pid's first [BN, BK] chunk of weights in the phase of table row `row` (its
    first tile is tile pid; zeros outside W) and whether it has one (int32)."""
    n, k, splits, kper, tiles, w_p = _phase(w_ptr, row, kk.shape[0])
    has = (pid < tiles).to(tl.int32)
    n_idx, n_ok, k_beg, k_end = _tile(pid, n, k, splits, kper, rows)
    k_end = tl.where(has != 0, k_end, 0)
    ok = n_ok[:, None] & (k_beg + kk < k_end)[None, :]
    return tl.load(w_p + n_idx.to(tl.int64)[:, None] * k + (k_beg + kk)[None, :], mask=ok, other=0.0), has


@triton.jit
def _chain_kernel(w_ptr, act_ptr, table_ptr, bar_ptr, p_first, p_last,
                  BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr,
                  BARRIER: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr):
    """Phases p_first..p_last - 1 of the table (BARRIER: grid barriers between them; else one
    phase a launch). w: all phases' W `[N_p, K_p]` row-major, bf16, at W_OFF; act: fp32, every
    phase's x and y at X_OFF / Y_OFF. PREFETCH: each program's first chunk of a phase is loaded
    before it waits for the phase before (the PDL wait, or the grid barrier). PDL: kernels.pdl."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    rows = tl.arange(0, BN)
    kk = tl.arange(0, BK)
    w_pre = tl.zeros([BN, BK], w_ptr.dtype.element_ty)
    have_pre = 0
    if PREFETCH:  # the table and the weights are static: load before waiting for the previous launch
        w_pre, have_pre = _first_chunk(w_ptr, table_ptr + p_first * COLS, pid, rows, kk)
    pdl.enter(PDL)
    for p in range(p_first, p_last):
        row = table_ptr + p * COLS
        n, k, splits, kper, tiles, w_p = _phase(w_ptr, row, BK)
        x_p = act_ptr + tl.multiple_of(tl.load(row + X_OFF), 8)
        y_p = act_ptr + tl.load(row + Y_OFF)
        z_p = act_ptr + tl.load(row + Z_OFF)
        z_n = tl.load(row + Z_N).to(tl.int32)
        for z in range(pid * ZERO_BLOCK, z_n, progs * ZERO_BLOCK):
            zi = z + tl.arange(0, ZERO_BLOCK)
            tl.store(z_p + zi, tl.zeros([ZERO_BLOCK], tl.float32), mask=zi < z_n)
        for t in range(pid, tiles, progs):
            n_idx, n_ok, k_beg, k_end = _tile(t, n, k, splits, kper, rows)
            w_rows = w_p + n_idx.to(tl.int64)[:, None] * k
            use_pre = (t == pid) & (have_pre != 0)
            load_end = tl.where(use_pre, k_beg, k_end)                # the prefetched chunk is not loaded again
            w = tl.load(w_rows + (k_beg + kk)[None, :], mask=n_ok[:, None] & (k_beg + kk < load_end)[None, :],
                        other=0.0)
            if PREFETCH:
                w = tl.where(use_pre, w_pre, w)
            x = tl.load(x_p + k_beg + kk, mask=k_beg + kk < k_end, other=0.0, cache_modifier=".cg")
            acc = w.to(tl.float32) * x[None, :]
            for k0 in tl.range(k_beg + BK, k_end, BK, num_stages=NUM_STAGES):
                w = tl.load(w_rows + (k0 + kk)[None, :], mask=n_ok[:, None] & (k0 + kk < k_end)[None, :], other=0.0)
                x = tl.load(x_p + k0 + kk, mask=k0 + kk < k_end, other=0.0, cache_modifier=".cg")
                acc += w.to(tl.float32) * x[None, :]
            tl.atomic_add(y_p + n_idx, tl.sum(acc, 1), mask=n_ok, sem="relaxed", scope="gpu")
        if BARRIER:
            if p + 1 < p_last:   # a grid barrier; the prefetch is issued after arriving (a release
                _arrive(bar_ptr)  # waits for this thread's outstanding loads) and lands while waiting
                if PREFETCH:
                    w_pre, have_pre = _first_chunk(w_ptr, row + COLS, pid, rows, kk)
                _wait(bar_ptr, (p - p_first + 1) * progs)
    if BARRIER:  # every program is past every barrier once the last one gets here
        if ticket.last_to_arrive(bar_ptr + 1, progs):
            tl.store(bar_ptr, 0)


@dataclass
class Chain:
    """A chain of GEMVs ready to run: weights, activations (input at 0), the phase table."""
    w: torch.Tensor          # bf16, every phase's W flattened
    act: torch.Tensor        # fp32: input, then each phase's output
    table: torch.Tensor      # int64 [P, COLS]
    rows: list               # the table on the host
    shapes: list             # (n, k, src) per phase
    bn: int
    bk: int
    programs: int

    def input(self) -> torch.Tensor:
        """The chain's input (phases with src -1 read its first k values)."""
        return self.act[:max(k for n, k, src in self.shapes if src < 0)]

    def weight(self, p: int) -> torch.Tensor:
        """W of phase p, `[n, k]` (a view)."""
        row = self.rows[p]
        return self.w[row[W_OFF]:row[W_OFF] + row[N] * row[K]].view(row[N], row[K])

    def output(self, p: int = -1) -> torch.Tensor:
        row = self.rows[p]
        return self.act[row[Y_OFF]:row[Y_OFF] + row[N]]


def splits_for(n: int, k: int, bn: int, bk: int, programs: int) -> tuple[int, int]:
    """(splits, K per split): the fewest K splits that give the busiest program the fewest
    weight bytes (tiles dealt round robin over `programs`)."""
    best = None
    for s in range(1, triton.cdiv(k, bk) + 1):
        kper = triton.cdiv(triton.cdiv(k, s), bk) * bk
        s_real = triton.cdiv(k, kper)
        load = triton.cdiv(triton.cdiv(n, bn) * s_real, programs) * kper
        if best is None or load < best[0]:
            best = (load, s_real, kper)
    return best[1], best[2]


# the dense one-row GEMVs of a decode layer and the GEMV whose output each reads (-1: the layer's
# input, the previous layer's last output); their (N, K) are ModelConfig.dense_shapes()'s
LAYER_SRC = {"wqkv_a": -1, "wq_b": 0, "wo": 1, "router": 2, "shared_w13": 2, "shared_w2": 4}


def layers(dense_shapes: dict[str, tuple[int, int]], n_layers: int, free: bool = False) -> list[tuple[int, int, int]]:
    """`build`'s shapes for `n_layers` decode layers of LAYER_SRC's GEMVs chained (each layer
    reads the last output of the one before); free: every phase reads the input instead."""
    shapes = []
    for layer in range(n_layers):
        base = len(shapes)
        for name, src in LAYER_SRC.items():
            n, k = dense_shapes[name]
            shapes.append((n, k, -1 if free else (base - 1 if layer else -1) if src < 0 else base + src))
    return shapes


def build(shapes: list[tuple[int, int, int]], device, programs: int, bn: int = 16, bk: int = 256,
          seed: int = 0) -> Chain:
    """Random chain: phase p is `(n, k, src)`, W_p `[n, k]`, x_p = the first k values of phase
    src's output (src -1: the random input, of the largest k). Weights ~ N(0, 1/k), bf16."""
    gen = torch.Generator().manual_seed(seed)
    k_in = max(k for n, k, src in shapes if src < 0)
    y_off, off = [], triton.cdiv(k_in, 8) * 8
    for i, (n, k, src) in enumerate(shapes):
        if not -1 <= src < i or (src >= 0 and shapes[src][0] < k) or (src < 0 and k > k_in):
            raise ValueError(f"phase {i}: input from phase {src} does not have {k} values")
        if k % 8:
            raise ValueError(f"phase {i}: K = {k} is not a multiple of 8 (16-byte weight loads)")
        y_off.append(off)
        off += triton.cdiv(n, 8) * 8
    p_n = len(shapes)
    if p_n > 1 and shapes[-1][2] == 0:
        raise ValueError("the last phase zeroes the first phase's output: it cannot read it")
    ws, rows, w_off = [], [], 0
    for i, (n, k, src) in enumerate(shapes):
        ws.append((torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16).flatten())
        s, kper = splits_for(n, k, bn, bk, programs)
        z = (i + 1) % p_n
        rows.append([w_off, n, k, 0 if src < 0 else y_off[src], y_off[i], triton.cdiv(n, bn), s, kper,
                     y_off[z], shapes[z][0]])
        w_off += n * k
    act = torch.zeros(off, dtype=torch.float32)
    act[:k_in] = torch.randn(k_in, generator=gen)
    return Chain(torch.cat(ws).to(device), act.to(device), torch.tensor(rows, dtype=torch.int64, device=device), rows,
                 list(shapes), bn, bk, programs)


def run(chain: Chain, mode: str = "prefetch", num_stages: int = 4, num_warps: int = 4) -> torch.Tensor:
    """Run the chain (`MODES`); returns the last phase's output (a view of chain.act)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    bar = ticket.counters(chain.act.device, "chain", 2)
    meta = dict(BN=chain.bn, BK=chain.bk, NUM_STAGES=num_stages, num_warps=num_warps)
    p_n = len(chain.shapes)
    if mode in ("launch", "preload"):
        mode_pdl = pdl.on(chain.act)
        for p in range(p_n):
            _chain_kernel[(chain.programs,)](chain.w, chain.act, chain.table, bar, p, p + 1, BARRIER=False,
                                             PREFETCH=mode == "preload", **meta, **pdl.args(mode_pdl))
    else:
        if not chain.act.is_cuda:
            raise ValueError("grid barriers need every program resident at once: a GPU")
        if chain.programs > MAX_RESIDENT_PER_SM * sm_count(chain.act.device):
            raise ValueError(f"{chain.programs} programs with grid barriers: at most {MAX_RESIDENT_PER_SM} an SM "
                             "(more might not all be resident, and the barrier would never open)")
        _chain_kernel[(chain.programs,)](chain.w, chain.act, chain.table, bar, 0, p_n, BARRIER=True,
                                         PREFETCH=mode == "prefetch", PDL=0, **meta)
    return chain.output()


def reference(chain: Chain) -> torch.Tensor:
    """The last phase's output in fp32 torch (same input, same bf16 weights)."""
    outs = []
    for p, (n, k, src) in enumerate(chain.shapes):
        outs.append(chain.weight(p).float() @ (chain.input() if src < 0 else outs[src])[:k].float())
    return outs[-1]
