"""Rank profiles: how often the target's token is the drafter's rank-r candidate, per depth.

A profile holds, for each drafted depth d = 1..L, the probability p[d][r] that the
target's greedy token at that depth is the drafter's rank-r candidate (r = 0..K-1, rank 0
= the drafter's top-1); the rest, 1 - sum_r p[d][r], is "not in the drafter's top K".
Depths are independent draws. Under `--acceptance rank:PROFILE` a step builds the tree
from these probabilities (a calibrated drafter: its top-K log-probs are log p[d]), draws
the target's rank at every depth, and accepts the longest root path of the built tree
whose node ranks match the draws. So a wider tree accepts more exactly as far as the
profile's ranks below the top-1 carry mass, and the expected accepted length of a built
tree is 1 + sum over its nodes of the product of p along the node's path
(`tree_expectation`); with the best-first builder that is 1 + the `budget` largest path
products (`expected_curve`).

Shipped profiles (`ddbench/profiles/*.json`) come from `family`: a constant top-1
probability a per depth, fitted so the chain's mean accepted length (bonus included)
equals a published figure, and the misses of the top-1 split into "rank >= 1 with
probability h" (geometric over ranks 1..K-1 with ratio q; q = 0 puts it all on rank 1)
and "not in top K". h is fitted so a tree of `gain_budget` nodes accepts `gain` times the
chain. `--acceptance real` measures a profile (`RankCounter`, `save_profile`).
"""
from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ddbench.engine.config import ConfigError

RECORD_K = 16          # ranks a measured profile distinguishes (the rest: not in top K)


def profile_dir() -> Path:
    import ddbench

    return Path(ddbench.__file__).resolve().parent / "profiles"


@dataclass
class RankProfile:
    """p[d][r]: probability that the target's token at depth d+1 is the drafter's rank r."""
    name: str
    probs: list[list[float]]
    source: str = ""
    params: dict = field(default_factory=dict)
    counts: list[list[int]] | None = None      # measured profiles: [L][K+1] counts (last: not in top K)

    def __post_init__(self):
        if not self.probs or any(not row for row in self.probs):
            raise ConfigError(f"rank profile {self.name}: probs must be a non-empty list of per-depth lists")
        k = len(self.probs[0])
        for d, row in enumerate(self.probs):
            if len(row) != k or any(not 0.0 <= p <= 1.0 for p in row) or sum(row) > 1 + 1e-6:
                raise ConfigError(f"rank profile {self.name}: depth {d + 1} needs {k} probabilities in [0, 1] "
                                  f"summing to <= 1")

    @property
    def depth(self) -> int:
        return len(self.probs)

    @property
    def k(self) -> int:
        return len(self.probs[0])

    def table(self, depth: int, k: int) -> torch.Tensor:
        """`[depth, k]` float64: each depth's probabilities sorted descending (ranks are only
        labels, and a calibrated drafter ranks by them), cut or zero-padded to k ranks and
        `depth` depths (deeper than the profile: never matched)."""
        p = torch.tensor(self.probs, dtype=torch.float64).sort(dim=-1, descending=True).values
        out = torch.zeros(depth, k, dtype=torch.float64)
        d, kk = min(depth, p.shape[0]), min(k, p.shape[1])
        out[:d, :kk] = p[:d, :kk]
        return out

    def chain_tokens(self) -> float:
        """Mean tokens per step of the top-1 chain (bonus included)."""
        return chain_tokens(self.table(self.depth, self.k)[:, 0].tolist())

    def to_json(self) -> str:
        d = {"name": self.name, "source": self.source, "params": self.params, "probs": self.probs}
        if self.counts is not None:
            d["counts"] = self.counts
        return json.dumps(d, indent=1) + "\n"


def chain_tokens(top1) -> float:
    """1 + sum_d prod_{j<=d} a_j."""
    total, run = 1.0, 1.0
    for a in top1:
        run *= a
        total += run
    return total


def load_profile(spec: str) -> RankProfile:
    """A shipped profile by name (`ddbench/profiles/NAME.json`) or a JSON file path."""
    path = Path(spec)
    if not path.is_file():
        path = profile_dir() / f"{spec}.json"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in profile_dir().glob("*.json")))
        raise ConfigError(f"rank profile {spec!r}: no such file or shipped profile (shipped: {names})")
    try:
        d = json.loads(path.read_text())
        return RankProfile(str(d.get("name", path.stem)), [[float(p) for p in row] for row in d["probs"]],
                           str(d.get("source", "")), dict(d.get("params", {})), d.get("counts"))
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"rank profile {path}: cannot read it ({type(e).__name__}: {e})") from None


def profile_from_counts(name: str, counts: torch.Tensor, source: str) -> RankProfile:
    """counts `[L, K+1]` (last column: not in top K) -> per-depth frequencies (a depth
    never reached: all zeros, i.e. never matched)."""
    c = counts.detach().double().cpu()
    tot = c.sum(-1, keepdim=True)
    probs = torch.where(tot > 0, c[:, :-1] / tot.clamp(min=1), 0.0)
    return RankProfile(name, probs.tolist(), source, {"observations": int(c.sum())}, c.long().tolist())


def save_profile(path: Path, counts: torch.Tensor, source: str) -> RankProfile:
    prof = profile_from_counts(Path(path).stem, counts, source)
    Path(path).write_text(prof.to_json())
    return prof


# --- the parametric family and its fit ------------------------------------------------

def family(a: float, h: float, q: float, depth: int, k: int) -> list[list[float]]:
    """p[d][0] = a; p[d][r] = (1 - a) h w_r for r = 1..k-1, w geometric with ratio q (sum 1)."""
    w = [q ** (r - 1) for r in range(1, k)]
    s = sum(w) or 1.0
    row = [a] + [(1 - a) * h * x / s for x in w]
    return [list(row) for _ in range(depth)]


def fit_top1(tau: float, depth: int) -> float:
    """The constant per-depth top-1 probability whose chain gives `tau` tokens per step."""
    if not 1.0 <= tau <= depth + 1:
        raise ConfigError(f"chain length {tau} must be in 1..{depth + 1}")
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chain_tokens([mid] * depth) < tau else (lo, mid)
    return (lo + hi) / 2


def fit_family(tau: float, depth: int, k: int, gain: float, gain_budget: int, q: float) -> tuple[float, float]:
    """(a, h): chain = tau and E[accepted](tree of gain_budget nodes) = gain x tau."""
    a = fit_top1(tau, depth)

    def ratio(h):
        p = torch.tensor(family(a, h, q, depth, k), dtype=torch.float64)
        return expected_curve(p.log(), p, gain_budget)[-1] / tau

    if ratio(1.0) < gain:
        raise ConfigError(f"a gain of {gain} at budget {gain_budget} is out of reach (h = 1 gives {ratio(1.0):.3f})")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) < gain else (lo, mid)
    return a, (lo + hi) / 2


# --- expectations -----------------------------------------------------------------------

def expected_curve(build_logp: torch.Tensor, match_p: torch.Tensor, max_budget: int) -> list[float]:
    """E[tokens per step] (bonus included) for budgets 0..max_budget of the best-first tree
    that `build_logp` `[L, K]` (sorted descending, as the tree builder takes) gives, when the
    target's token at depth d is rank r with probability match_p[d, r]. The heap walks
    candidates as `kernels.ddtree.build_tree_ref` does (float32 scores, ties to the smaller
    rank tuple), so entry b is the analytic expectation of the tree that builder makes."""
    import numpy as np

    lp = build_logp.detach().float().cpu().numpy()
    mp = match_p.detach().double().cpu().numpy()
    n_pos, k = lp.shape
    out = [1.0]
    score = {(): np.float32(0.0)}
    prob = {(): 1.0}
    heap = [(-float(lp[0, 0]), (0,))]
    total = 1.0
    while len(out) <= max_budget and heap:
        _, ranks = heapq.heappop(heap)
        d, r = len(ranks), ranks[-1]
        up = ranks[:-1]
        score[ranks] = sc = np.float32(score[up] + lp[d - 1, r])
        prob[ranks] = pr = prob[up] * mp[d - 1, r]
        total += pr
        out.append(total)
        if r + 1 < k:
            heapq.heappush(heap, (-float(np.float32(score[up] + lp[d - 1, r + 1])), up + (r + 1,)))
        if d < n_pos:
            heapq.heappush(heap, (-float(np.float32(sc + lp[d, 0])), ranks + (0,)))
    out += [total] * (max_budget + 1 - len(out))
    return out


def tree_expectation(parent: torch.Tensor, rank: torch.Tensor, depth: torch.Tensor, match_p: torch.Tensor) -> torch.Tensor:
    """`[N]` E[tokens per step] of built trees (parent/rank/depth `[N, T]`, parent < child):
    1 + sum over non-root nodes of the product of match_p[depth-1, rank] along the path."""
    n, t = parent.shape
    par, dep, rk = parent.long(), depth.long(), rank.long()
    p = match_p.to(torch.float64).to(parent.device)
    own = torch.where(dep > 0, p[(dep - 1).clamp(min=0), rk.clamp(min=0)], torch.ones((), dtype=torch.float64,
                                                                                       device=parent.device))
    prod = own.clone()
    for _ in range(int(dep.max()) if t > 1 else 0):       # one more ancestor per pass
        prod = torch.where(dep > 0, own * prod.gather(1, par.clamp(min=0)), prod)
    return 1.0 + torch.where(dep > 0, prod, 0.0).sum(-1)


# --- drawing and walking on the device --------------------------------------------------

def draw_ranks(u: torch.Tensor, cdf: torch.Tensor) -> torch.Tensor:
    """Uniforms u `[N, L]`, per-depth cumulative probabilities cdf `[L, K]` -> ranks `[N, L]`
    in 0..K (K: not in the drafter's top K)."""
    return (u.unsqueeze(-1) >= cdf.unsqueeze(0)).sum(-1)


def matched_path(parent: torch.Tensor, rank: torch.Tensor, depth: torch.Tensor, target: torch.Tensor,
                 max_depth: int) -> torch.Tensor:
    """Accepted nodes `[N, max_depth+1]` (root first, -1 padded): the longest root path whose
    node at depth d has rank target[:, d-1] (siblings have distinct ranks, so it is unique).
    parent/rank/depth `[N, T]` as `kernels.ddtree.Tree`; target `[N, L]` long (a value no
    node has, e.g. -1 or K, ends the path)."""
    n, t = parent.shape
    l1 = max_depth + 1
    dep = depth.long()
    want = target.long().gather(1, (dep - 1).clamp(min=0, max=target.shape[1] - 1))     # [N, T]
    off = (rank.long() != want) | (dep > target.shape[1])
    off[:, 0] = False
    par = parent.long().clamp(min=0)
    for _ in range(max(1, math.ceil(math.log2(l1))) + 1):        # pointer jumping over ancestors
        off = off | off.gather(1, par)
        par = par.gather(1, par)
    col = torch.where(~off, dep, l1)                                                     # slot = depth
    acc = torch.full((n, l1 + 1), -1, dtype=torch.long, device=parent.device)
    acc.scatter_(1, col, torch.arange(t, device=parent.device).expand(n, t))
    return acc[:, :l1]


class RankCounter:
    """Counts, on the device, the rank of the target's token in the drafter's list at every
    accepted depth and at the first rejected one (`[L, RECORD_K + 1]`, last: rank >= K)."""

    def __init__(self, depth: int, device, k: int = RECORD_K):
        self.k = k
        self.counts = torch.zeros(depth, k + 1, dtype=torch.long, device=device)

    def add(self, d_logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> None:
        """d_logits `[N, L, V]` (drafter), target tokens `[N, L]`, valid bool `[N, L]`."""
        n, l, _ = d_logits.shape
        own = d_logits.gather(2, target.clamp(min=0).unsqueeze(-1))                      # [N, L, 1]
        r = (d_logits > own).sum(-1).clamp(max=self.k)                                   # [N, L] rank
        idx = torch.arange(l, device=r.device).view(1, l) * (self.k + 1) + r
        self.counts.view(-1).scatter_add_(0, idx.reshape(-1), valid.reshape(-1).long())


# --- the shipped profiles ---------------------------------------------------------------

DFLASH_K25 = {"gsm8k": 5.3, "math500": 5.5, "humaneval": 5.3, "mbpp": 4.5, "mtbench": 3.7}
DFLASH_SOURCE = ("Hugging Face model card z-lab/Kimi-K2.5-DFlash: DFlash drafter for Kimi K2.5, block size 8, "
                 "mean acceptance length {tau} on {dataset} (bonus included)")
SIBLING_GAIN = {
    "paper": dict(gain=10.73 / 7.79, q=0.5, gain_budget=256,
                  source="DDTree paper (Ringel & Romano, arXiv 2604.12989), Qwen3-8B MATH-500: acceptance length "
                         "7.79 with the DFlash chain, 10.73 with DDTree at its best budget; that ratio is matched "
                         "here at budget 256 (an assumption: the budget of the paper's figure is not reproduced), "
                         "sibling mass geometric over ranks 2..16 with ratio 0.5"),
    "small": dict(gain=1.04, q=0.0, gain_budget=256,
                  source="vllm-ddtree findings: a tree accepts about 4% more than the chain, saturating at 2 "
                         "siblings; matched at budget 256 with all sibling mass on rank 2"),
}


def shipped_profile(dataset: str, setting: str, depth: int = 7, k: int = RECORD_K) -> RankProfile:
    """The `dflash-k25-DATASET-SETTING` profile: `family` fitted to the model card's chain
    length and one of the two sibling-gain settings."""
    tau, s = DFLASH_K25[dataset], SIBLING_GAIN[setting]
    a, h = fit_family(tau, depth, k, s["gain"], s["gain_budget"], s["q"])
    params = {"family": "top-1 a per depth (constant); misses: rank >= 2 with prob h, geometric ratio q; "
                        "rest not in top K", "a": a, "h": h, "q": s["q"], "depth": depth, "k": k,
              "chain_tokens": tau, "gain": s["gain"], "gain_budget": s["gain_budget"]}
    source = DFLASH_SOURCE.format(tau=tau, dataset=dataset) + "; sibling gain: " + s["source"]
    return RankProfile(f"dflash-k25-{dataset}-{setting}", family(a, h, s["q"], depth, k), source, params)
