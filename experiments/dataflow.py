"""A chain of dependent one-row GEMVs (`experiments.chain.Chain`) in one persistent CUDA launch whose
weight stream does not stop at the dependencies (`experiments/dataflow.cu`): the probe of a
dataflow decode step, the design docs/notes/decode.md says 1.5x needs.

The launch chain pays every dependency twice: the DRAM stream stops at each kernel boundary
(sessions 9-14 measured 1.1-1.8 us a dependency, grid barriers included), and a kernel's
weights can only start to load once its programs are resident. Here each program (one an SM)
has a producer lane that copies its tiles of W (whole rows, in phase order) into a ring of
shared-memory slots with bulk copies as soon as a slot is free, whatever the dependencies; an
x-loader lane that waits for a phase's input (a completion counter a phase) and bulk-copies it
into one of two x buffers; and consumer teams (TEAMS of `split` warps, a tile each, a slot's
tiles always one team's) that multiply. The stream runs ahead by the ring's size (SLOTS x
SLOT bytes an SM), so a dependency costs only what the ring cannot cover. Same maths as
`chain.reference` (fp32 activations, bf16 weights, fp32 sums; no atomics on the outputs: a
tile owns whole rows). `experiments/scripts/chain_probe.py` times it against the launch chain
(`dataflow` modes), `experiments/scripts/dataflow_profile.py` shows where its time goes (marks, ncu).

Measured (H200, docs/notes/decode.md, sessions 16-19): correct; its stream alone (the same
phases without dependencies) reaches 20.5 us a layer with the publisher lane, 1.32x the copy
floor of 15.5, but with the dependencies it takes 34.3, slower than the engine's launches
(29.6): a dependency costs ~2.2 us in a chain of tiny phases against 1.09 for a launch with
PDL, and carrying it in the data instead (NCCL's LL protocol, session 18, removed) made it
2.1 us; `experiments/hop_probe.py`, rebuilding one dependency with this kernel's protocol and
hand-offs on every SM and nothing else running, measures 1.54 us (the counter alone 0.92), so
~0.65 us is this kernel's own machinery and the rest the protocol's floor.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ddbench.kernels.device import sm_count
from experiments.chain import K, N, W_OFF, X_OFF, Y_OFF, Chain
from experiments.cuda import kernel

SLOTS, SLOT = 8, 20 * 1024       # the ring of an SM: 160 KB (+ two x buffers of the largest K)
MAX_PHASES = 64                  # (MAXPH)
TEAMS = 8                        # consumer teams, a tile each (experiments/dataflow.cu)
SPLIT = 1                        # warps a team
RB, VECS = 4, 4                  # rows a team multiplies at once; 16-byte vectors of each a lane loads first
COLS = 9                         # table columns: W_OFF N K X_OFF Y_OFF SRC BN TILES FIRST
MARKS = ("wait input", "wait x buffer", "wait x", "wait tiles", "multiply", "publish", "tiles")   # dataflow.cu M_*
SHARED_MAX = 227 * 1024          # dynamic shared memory of a program, at most (H100/H200)


@dataclass
class Plan:
    """A chain ready for `run`: its phase table on the device (built once: a CUDA graph can
    capture `run`) and on the host, the tiles of all phases, the largest K."""
    chain: Chain
    table: torch.Tensor
    rows: list
    total: int
    kmax: int
    slot: int


def plan(chain: Chain, slot: int = SLOT, spread: bool = True) -> Plan:
    """The kernel's phase table (rows of COLS ints): a tile is the most whole rows of W that
    fit a `slot`-byte slot, and (spread) no more than share a phase's rows over every consumer
    team of the chain's programs (a small phase then runs on all of them, not on a few slow
    teams); tiles are numbered in phase order (FIRST: a phase's first tile)."""
    if len(chain.shapes) > MAX_PHASES:
        raise ValueError(f"{len(chain.shapes)} phases: at most {MAX_PHASES}")
    rows, first = [], 0
    for p, (n, k, src) in enumerate(chain.shapes):
        bn = slot // (2 * k)
        if bn < 1:
            raise ValueError(f"phase {p}: a row of K = {k} does not fit a {slot}-byte slot")
        if spread:
            bn = min(bn, -(-n // (chain.programs * TEAMS)))
        tiles = -(-n // bn)
        r = chain.rows[p]
        rows.append([r[W_OFF], r[N], r[K], r[X_OFF], r[Y_OFF], src, bn, tiles, first])
        first += tiles
    return Plan(chain, torch.tensor(rows, dtype=torch.int64, device=chain.act.device), rows, first,
                max(k for _, k, _ in chain.shapes), slot)


@functools.lru_cache(maxsize=None)
def _kernel(slots: int, slot: int, kmax: int, split: int, rb: int, vecs: int, publisher: bool, marks: bool,
            device: torch.device):
    return kernel("dataflow.cu", "dataflow", {"SLOTS": slots, "SLOT": slot, "KMAX": kmax, "SPLIT": split, "RB": rb,
                                              "VECS": vecs, "PUBLISHER": int(publisher), "MARKS": int(marks)}, device)


@functools.lru_cache(maxsize=None)
def _state(device: torch.device, phases: int) -> torch.Tensor:
    """Counters: tiles done a phase, programs done (zero between launches), the error flag."""
    return torch.zeros(phases + 2, dtype=torch.int32, device=device)


def run(pl: Plan, programs: int | None = None, slots: int = SLOTS, split: int = SPLIT, rb: int = RB,
        vecs: int = VECS, publisher: bool = False, marks: torch.Tensor | None = None) -> torch.Tensor:
    """Run the chain in one launch of `programs` programs (default: one an SM; all must be
    resident at once, so nothing else may run beside it) with a ring of `slots` slots,
    consumer teams of `split` warps (1 or 2) that multiply `rb` rows at once, loading `vecs`
    16-byte vectors of each row a lane (a multiple of `split`) before the sums, and
    (publisher) a lane that publishes the program's finished phases for them;
    returns the last phase's output (a view of the chain's activations). `gave_up` tells
    whether a wait timed out. marks: int64 `[programs, phases, len(MARKS)]` (a build that
    writes them): a program's cycles a phase in its x loader waiting for the input and for a
    free x buffer, in its consumer teams (summed over the teams) waiting for x and for their
    tiles, multiplying them (and storing the rows), publishing them (with `publisher`: the
    publisher lane's wait for its release); the tiles it multiplied."""
    device = pl.table.device
    programs = programs or sm_count(device)
    if programs > sm_count(device):
        raise ValueError(f"{programs} programs: at most one an SM ({sm_count(device)}) can be resident")
    if slots % TEAMS or split not in (1, 2) or not 1 <= rb <= 8 or vecs < 1 or vecs % split:
        raise ValueError(f"{slots} slots, {split} warps a team, {rb} rows, {vecs} vectors: slots a multiple of "
                         f"{TEAMS} (a slot belongs to one consumer team), 1 or 2 warps a team, 1 to 8 rows, "
                         "vectors a multiple of the warps")
    shared = slots * pl.slot + 2 * pl.kmax * 4
    if shared > SHARED_MAX - 8 * 1024:                               # the kernel's static arrays
        raise ValueError(f"{slots} slots of {pl.slot} bytes and two x buffers of K = {pl.kmax} "
                         f"need {shared} bytes of shared memory: too many")
    phases = len(pl.rows)
    state = _state(device, phases)
    want = (programs, phases, len(MARKS))
    if marks is not None and (marks.shape != want or marks.dtype != torch.int64):
        raise ValueError(f"marks must be int64 {list(want)}, got {marks.dtype} {tuple(marks.shape)}")
    _kernel(slots, pl.slot, pl.kmax, split, rb, vecs, publisher, marks is not None, device)(
        programs, 32 * (TEAMS * split + 2 + publisher), shared,
        [pl.chain.w, pl.chain.act, pl.table, phases, pl.total, state, state[phases + 1:], marks])
    return pl.chain.output()


def gave_up(pl: Plan) -> bool:
    """Whether a launch of this plan's size gave up waiting (a program not resident; synchronises)."""
    return bool(_state(pl.table.device, len(pl.rows))[-1].item())
