"""What one dependency between two SMs costs through global memory, alone (`experiments/hop_probe.cu`):
two programs pass a token back and forth, with a bare flag, a release/acquire flag or the
dataflow kernel's counter (and then, as its x loader, a bulk copy of x into shared memory), idle
or under a DRAM stream from every other SM; or one program's token answered by the adds of
`fan` others to one counter, the all-to-all shape in which a dataflow phase completes; or the
dataflow kernel's hop with its hand-offs inside the program: x handed to a consumer warp that
multiplies one row of 256 and posts ("x to a warp"), or hands the post to a publisher lane
("x to a warp + publisher"); or every program at once waiting for all the others' posts, as
one dependency of a dataflow chain, with the counter alone ("all to all") or with those
hand-offs too, or with a flag a program that a whole warp polls instead of one counter
("all to all, flags"). The floor under any software dependency of a persistent decode
kernel (`experiments/dataflow.py`), to set against a PDL launch's ~1.1 us. `experiments/scripts/hop_probe.py`
prints the table.
"""
from __future__ import annotations

import functools
import struct

import torch

from experiments.cuda import kernel

MODES = {"relaxed": 0, "release-acquire": 1, "counter": 2, "counter + x": 3, "all to one": 4,   # hop_probe.cu MODE
         "x to a warp": 5, "x to a warp + publisher": 6,
         "all to all": 7, "all to all + x to a warp": 8, "all to all + x to a warp + publisher": 9,
         "all to all, flags": 10, "all to all, flags + x to a warp + publisher": 11}
FANS = [m for m in MODES if m.startswith("all to")]        # modes on fan + 1 programs, no stream
CONSUMER = [m for m in MODES if "x to a warp" in m]        # modes whose consumer warp multiplies x
ROW = 256                                                   # the consumer's row (bf16 weights) in CONSUMER modes
WARM = 16                                                   # rounds not timed (hop_probe.cu)
SHARED = 160 * 1024                                         # dynamic shared memory a program: one an SM


@functools.lru_cache(maxsize=None)
def _kernel(mode: int, device: torch.device):
    return kernel("hop_probe.cu", "hop", {"MODE": mode}, device)


def hop_ns(mode: str, rounds: int = 10000, stream: torch.Tensor | None = None, x_bytes: int = 1024,
           fan: int = 131) -> tuple[float, int, bool, float | None]:
    """One hop's time in ns (mean over `rounds` round trips, two hops each, after WARM; in the
    "all to all" modes a round is one hop, every program waiting for all), the token at the end
    (2 x rounds when every hop happened), whether a wait gave up, and in the modes with a
    consumer warp program 0's last sum minus its fp32 reference (w . x[:ROW]; None in the
    others). stream: a uint8 CUDA buffer that every other SM reads over and over meanwhile
    (None: idle); x_bytes: what the modes with x copy a hop (a multiple of 16, at most SHARED;
    at least ROW floats in the modes with a consumer); fan: the programs that answer in "all to
    one" (its token at the end: fan x rounds), or in the "all to all" modes the programs but
    one (token: (fan + 1) x rounds)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    if rounds <= WARM:
        raise ValueError(f"{rounds} rounds: more than the {WARM} untimed ones")
    if x_bytes % 16 or not 16 <= x_bytes <= SHARED:
        raise ValueError(f"x_bytes {x_bytes}: a multiple of 16 from 16 to {SHARED}")
    if mode in CONSUMER and x_bytes < 4 * ROW:
        raise ValueError(f"x_bytes {x_bytes}: {mode!r} multiplies {ROW} values of x")
    if mode in FANS and stream is not None:
        raise ValueError(f"{mode} runs on every program it has: no stream beside it")
    device = torch.device("cuda", torch.cuda.current_device()) if stream is None else stream.device
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if mode in FANS and not 1 <= fan < sms:
        raise ValueError(f"fan {fan}: 1 to {sms - 1} (one program an SM, all resident)")
    grid = fan + 1 if mode in FANS else 2 if stream is None else sms   # every program resident: one an SM
    span = 0 if stream is None else stream.numel() // 16 // (grid - 2)
    flag = torch.zeros(4 + sms, dtype=torch.int32, device=device)   # + the flags a program
    out = torch.zeros(4, dtype=torch.int64, device=device)
    buf = stream if stream is not None else flag
    x = torch.randn(x_bytes // 4, device=device)
    w = torch.randn(ROW, device=device).to(torch.bfloat16)
    _kernel(MODES[mode], device)(grid, 256, SHARED, [flag, rounds, buf, span, x, x_bytes, w, out])
    ns, token, bits = out[:3].tolist()
    gave_up = flag[3].item()
    error = None
    if mode in CONSUMER:
        got = struct.unpack("<f", struct.pack("<I", bits))[0]   # the fp32 bits the kernel stored
        error = got - (w.float() @ x[:ROW]).item()
    return ns / ((1 if mode.startswith("all to all") else 2) * (rounds - WARM)), token, bool(gave_up), error
