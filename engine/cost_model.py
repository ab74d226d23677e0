"""A step-cost model of the DDTree loop, fitted to measured e2e rows, and the budget it picks.

Each phase's time per step is a linear function of what drives it, fitted by least squares
over the measured (concurrency c, budget b) grid (tokens per verify n = c (b + 1), mean
context per stream x, measured distinct experts per MoE layer e):

  draft (+ context update)  a + b c                 constant per stream
  tree                      a + b c + d c b         top-K per stream, build per node
  verify attention          a + b n + d n x         tokens x context
  verify MoE                a + b e + d n           distinct experts, tokens
  verify other              a + b n
  accept                    a + b c
  comm (modelled)           a + b n
  host                      a

Predicted tok/s = c E[tokens per step](acceptance, budget) / step time, with E from the
acceptance's analytic curve (`Acceptance.expected_curve`) and e at an unmeasured point
interpolated in log n between measured points (flat beyond them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PHASES = ("draft", "tree", "verify_attention", "verify_moe", "verify_other", "accept", "comm", "host")


def features(phase: str, c: float, b: float, x: float, e: float) -> list[float]:
    n = c * (b + 1)
    return {"draft": [1, c], "tree": [1, c, c * b], "verify_attention": [1, n, n * x],
            "verify_moe": [1, e, n], "verify_other": [1, n], "accept": [1, c], "comm": [1, n],
            "host": [1]}[phase]


@dataclass
class CostModel:
    coef: dict                    # phase -> coefficients
    experts: list                 # sorted (log n, measured experts)
    context: float                # mean context per stream of the fit rows

    @classmethod
    def fit(cls, rows: list[dict]) -> "CostModel":
        """rows: dicts with concurrency, budget, context, experts and `<phase>_us` for PHASES."""
        if not rows:
            raise ValueError("no rows to fit")
        coef = {}
        for p in PHASES:
            a = np.array([features(p, r["concurrency"], r["budget"], r["context"], r["experts"]) for r in rows], float)
            y = np.array([r[f"{p}_us"] for r in rows], float)
            scale = np.maximum(np.abs(a).max(0), 1e-12)          # column scaling for conditioning
            sol, *_ = np.linalg.lstsq(a / scale, y, rcond=None)
            coef[p] = (sol / scale).tolist()
        pts = sorted({(math.log(r["concurrency"] * (r["budget"] + 1)), r["experts"]) for r in rows})
        return cls(coef, pts, float(np.mean([r["context"] for r in rows])))

    def experts_at(self, c: int, b: int) -> float:
        xs, ys = zip(*self.experts)
        return float(np.interp(math.log(c * (b + 1)), xs, ys))

    def phases_us(self, c: int, b: int, context: float | None = None, experts: float | None = None) -> dict:
        x = self.context if context is None else context
        e = self.experts_at(c, b) if experts is None else experts
        return {p: max(0.0, float(np.dot(self.coef[p], features(p, c, b, x, e)))) for p in PHASES}

    def step_us(self, c: int, b: int, **kw) -> float:
        return sum(self.phases_us(c, b, **kw).values())

    def tok_per_s(self, c: int, b: int, expected_tokens: float, **kw) -> float:
        return c * expected_tokens / self.step_us(c, b, **kw) * 1e6

    def best_budget(self, c: int, curve: list[float], lo: int, hi: int) -> tuple[int, float]:
        """(budget, predicted tok/s) maximising the prediction over budgets lo..hi; curve[b] =
        E[tokens per step] at budget b."""
        best = max(range(lo, hi + 1), key=lambda b: self.tok_per_s(c, b, curve[b]))
        return best, self.tok_per_s(c, best, curve[best])
