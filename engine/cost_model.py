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

Each row is weighted by 1 / its step time, so the fit minimises relative errors (c = 1 steps
count as much as c = 10 ones). Predicted tok/s = c E[tokens per step](acceptance, budget) /
step time, with E from the acceptance's analytic curve (`Acceptance.expected_curve`) and e at an
unmeasured point interpolated in log n between the measured points of the same concurrency and
acceptance (the tree's shape decides how many of its nodes share experts: one stream's 129-node
tree touches fewer experts than 10 streams' 120 nodes), flat beyond them.
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
    experts: dict                 # (concurrency, acceptance) -> sorted [(log n, mean measured experts)]
    context: float                # mean context per stream of the fit rows

    @classmethod
    def fit(cls, rows: list[dict]) -> "CostModel":
        """rows: dicts with concurrency, budget, context, experts, `<phase>_us` for PHASES and
        optionally acceptance (the label whose tree shape the experts count belongs to)."""
        if not rows:
            raise ValueError("no rows to fit")
        weight = np.array([1.0 / max(sum(r[f"{p}_us"] for p in PHASES), 1e-9) for r in rows])
        coef = {}
        for p in PHASES:
            a = np.array([features(p, r["concurrency"], r["budget"], r["context"], r["experts"]) for r in rows], float)
            y = np.array([r[f"{p}_us"] for r in rows], float)
            scale = np.maximum(np.abs(a).max(0), 1e-12)          # column scaling for conditioning
            sol, *_ = np.linalg.lstsq(a / scale * weight[:, None], y * weight, rcond=None)
            coef[p] = (sol / scale).tolist()
        pts: dict = {}
        for r in rows:
            pts.setdefault((r["concurrency"], r.get("acceptance")), {}).setdefault(
                math.log(r["concurrency"] * (r["budget"] + 1)), []).append(r["experts"])
        curves = {k: sorted((x, float(np.mean(v))) for x, v in by_n.items()) for k, by_n in pts.items()}
        return cls(coef, curves, float(np.mean([r["context"] for r in rows])))

    def experts_at(self, c: int, b: int, acceptance: str | None = None) -> float:
        """Measured experts at (c, b), interpolated in log n on the curve of the same concurrency and
        acceptance, else of that concurrency (all acceptances), else of the nearest concurrency."""
        same = [k for k in self.experts if k[0] == c]
        if not same:
            near = min({k[0] for k in self.experts}, key=lambda cc: abs(math.log(cc / c)))
            same = [k for k in self.experts if k[0] == near]
        keys = [k for k in same if k[1] == acceptance] or same
        by_n: dict = {}
        for k in keys:
            for x, e in self.experts[k]:
                by_n.setdefault(x, []).append(e)
        xs = sorted(by_n)
        return float(np.interp(math.log(c * (b + 1)), xs, [np.mean(by_n[x]) for x in xs]))

    def phases_us(self, c: int, b: int, context: float | None = None, experts: float | None = None,
                  acceptance: str | None = None) -> dict:
        x = self.context if context is None else context
        e = self.experts_at(c, b, acceptance) if experts is None else experts
        return {p: max(0.0, float(np.dot(self.coef[p], features(p, c, b, x, e)))) for p in PHASES}

    def step_us(self, c: int, b: int, **kw) -> float:
        return sum(self.phases_us(c, b, **kw).values())

    def tok_per_s(self, c: int, b: int, expected_tokens: float, **kw) -> float:
        return c * expected_tokens / self.step_us(c, b, **kw) * 1e6

    def best_budget(self, c: int, curve: list[float], lo: int, hi: int, **kw) -> tuple[int, float]:
        """(budget, predicted tok/s) maximising the prediction over budgets lo..hi; curve[b] =
        E[tokens per step] at budget b; `kw` as phases_us (e.g. acceptance)."""
        best = max(range(lo, hi + 1), key=lambda b: self.tok_per_s(c, b, curve[b], **kw))
        return best, self.tok_per_s(c, best, curve[best], **kw)
