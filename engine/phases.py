"""Per-phase timing of one forward: `with phase("attention"): ...` marks a region.

Outside `PhaseTimer.active()` a phase is a no-op (so CUDA-graph capture and plain runs
pay nothing). Inside, every phase entry and exit records a timestamp (a CUDA event on
GPU, a host clock on CPU, where ops run synchronously); the time between two consecutive marks
goes to the innermost phase open at that time, so nested phases (the all-reduce inside
the attention block) are not counted twice. Time outside any phase goes to "other".

With `external=True` and the marked code captured in a CUDA graph, the marks are
event-record nodes of the graph and `totals_us()` after a replay gives the phases of
that replay, free of launch gaps.
"""
from __future__ import annotations

import contextlib
import time

import torch

_active: "PhaseTimer | None" = None


@contextlib.contextmanager
def phase(name: str):
    timer = _active
    if timer is None:
        yield
        return
    timer._enter(name)
    try:
        yield
    finally:
        timer._exit()


class PhaseTimer:
    """Collects marks while active; `totals_us()` sums the intervals per phase."""

    def __init__(self, device, external: bool = False, merge: bool = False):
        self.device = torch.device(device)
        # merge=True: an exit followed by an enter shares one timestamp (half the events;
        # work between the two, if any, counts to the entered phase instead of its parent)
        self.merge = merge
        self._after_exit = False
        self.cuda = self.device.type == "cuda"
        # external=True: the events become event-record nodes when captured in a CUDA
        # graph, so one replay of that graph times its phases (torch >= 2.8)
        self.external = external
        self.marks: list[tuple[object, str]] = []   # (timestamp, phase running after it)
        self.stack: list[str] = []

    def _stamp(self):
        if self.cuda:
            ev = (torch.cuda.Event(enable_timing=True, external=True) if self.external
                  else torch.cuda.Event(enable_timing=True))
            ev.record()
            return ev
        return time.perf_counter()

    def _enter(self, name: str):
        self.stack.append(name)
        if self.merge and self._after_exit:  # reuse the exit's timestamp, relabelled
            self.marks[-1] = (self.marks[-1][0], name)
        else:
            self.marks.append((self._stamp(), name))
        self._after_exit = False

    def _exit(self):
        self.stack.pop()
        self.marks.append((self._stamp(), self.stack[-1] if self.stack else "other"))
        self._after_exit = True

    @contextlib.contextmanager
    def active(self):
        """Time phases inside this block; starts and ends with an 'other' mark."""
        global _active
        self.marks.append((self._stamp(), "other"))
        self._after_exit = True
        _active = self
        try:
            yield self
        finally:
            _active = None
            self.marks.append((self._stamp(), "end"))

    def totals_us(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        out: dict[str, float] = {}
        for (t0, name), (t1, _) in zip(self.marks, self.marks[1:]):
            dt = t0.elapsed_time(t1) * 1e3 if self.cuda else (t1 - t0) * 1e6
            out[name] = out.get(name, 0.0) + dt
        return out
