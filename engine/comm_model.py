"""The all-reduce cost model: time(size) = latency + bus bytes / bus bandwidth.

`SimComm` (engine.parallel) charges each modelled collective with a model's `predict_us`;
`ddbench allreduce --model` fits one to measured rows. A model comes from a preset, from
explicit parameters or from an allreduce CSV (`load_model`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from ddbench import UserError

DEFAULT = "nvlink-h200"


def bus_factor(n: int) -> float:
    """nccl-tests' all-reduce bus-bandwidth factor 2(n-1)/n."""
    return 2 * (n - 1) / n


@dataclass(frozen=True)
class AllReduceModel:
    """time(size) = lat_us + size * 2(n-1)/n / busbw: a latency plus a bus-bandwidth term.

    busbw is roughly independent of the rank count (nccl-tests' point), so
    `with_ranks(n)` moves a model to another TP degree. busbw_gbps = inf means no
    bandwidth term (a fit to one rank, which moves no bus traffic).
    """
    lat_us: float
    busbw_gbps: float
    n_ranks: int = 8
    source: str = "params"

    def predict_us(self, nbytes: float) -> float:
        """Predicted time of one all-reduce of `nbytes` bytes, microseconds."""
        if math.isinf(self.busbw_gbps):
            return self.lat_us
        return self.lat_us + nbytes * bus_factor(self.n_ranks) / (self.busbw_gbps * 1e3)

    def decode_step_us(self, tokens: int, hidden: int = 7168, n_layers: int = 61,
                       dtype_bytes: int = 2, per_layer: int = 2) -> float:
        """All-reduce time of one TP-n decode step: `per_layer` x `n_layers` ops of T x hidden."""
        return per_layer * n_layers * self.predict_us(tokens * hidden * dtype_bytes)

    def with_ranks(self, n: int) -> "AllReduceModel":
        return dataclasses.replace(self, n_ranks=n)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["busbw_gbps"] = None if math.isinf(self.busbw_gbps) else self.busbw_gbps
        return d

    def describe(self) -> str:
        return f"{self.source} (lat {self.lat_us:.1f} us, busbw {self.busbw_gbps} GB/s, n={self.n_ranks})"


# 8-GPU NVSwitch H100/H200 ring busbw about 370 GB/s (NVLink multicast off); 8-GPU PCIe
# boxes 28-45 GB/s. The latencies are assumed small-message eager figures (NVSwitch ~10 us,
# PCIe ~20 us); fit measured rows instead.
PRESETS = {
    "nvlink-h200": AllReduceModel(lat_us=10.0, busbw_gbps=370.0, n_ranks=8, source="preset nvlink-h200"),
    "pcie": AllReduceModel(lat_us=20.0, busbw_gbps=35.0, n_ranks=8, source="preset pcie"),
}


def fit_model(points, n_ranks: int, source: str = "fit") -> AllReduceModel:
    """Least-squares fit of lat_us and busbw to [(size_bytes, time_us)].

    Minimises the relative error sum(((lat + b * bus_bytes - t) / t)^2), so the small
    sizes (latency) weigh as much as the large ones (bandwidth); lat and b >= 0.
    """
    import numpy as np

    pts = [(s, t) for s, t in ((float(s), float(t)) for s, t in points) if t > 0]
    if len({s for s, _ in pts}) < 2:
        raise UserError("need measured rows at two or more sizes to fit the model")
    size, t = np.array(pts).T
    x = size * bus_factor(n_ranks)  # bytes each rank moves over the bus
    w = 1.0 / t
    lat, b = 0.0, 0.0
    if n_ranks > 1:
        (lat, b), *_ = np.linalg.lstsq(np.stack([w, x * w], 1), np.ones_like(t), rcond=None)
        if lat < 0:  # bandwidth alone
            lat, b = 0.0, float(np.sum(x * w) / np.sum((x * w) ** 2))
    if b <= 0:  # latency alone: the weighted least-squares constant
        lat, b = float(np.sum(w) / np.sum(w * w)), 0.0
    busbw = math.inf if b <= 0 else 1.0 / (b * 1e3)  # us per byte -> GB/s
    return AllReduceModel(lat_us=float(lat), busbw_gbps=busbw, n_ranks=n_ranks, source=source)


def load_model(spec: str, mode: str | None = None) -> AllReduceModel:
    """A model from 'nvlink-h200', 'pcie', 'lat_us=..,busbw_gbps=..[,n_ranks=..]' or a CSV.

    A CSV written by `ddbench allreduce` is fitted (rows with wrong > 0 left out), on its
    graph rows if it has any, else its eager rows; `mode` picks one explicitly.
    """
    spec = spec.strip()
    if spec in PRESETS:
        return PRESETS[spec]
    if "=" in spec and not spec.endswith(".csv"):
        fields = {}
        for item in spec.split(","):
            key, _, value = item.partition("=")
            key = key.strip()
            if key not in ("lat_us", "busbw_gbps", "n_ranks"):
                raise UserError(f"model spec {spec!r}: unknown key {key!r} (lat_us, busbw_gbps, n_ranks)")
            try:
                fields[key] = int(value) if key == "n_ranks" else float(value)
            except ValueError:
                raise UserError(f"model spec {spec!r}: {value!r} is not a number") from None
        if "lat_us" not in fields or "busbw_gbps" not in fields:
            raise UserError(f"model spec {spec!r}: needs lat_us and busbw_gbps")
        if fields["lat_us"] < 0 or fields["busbw_gbps"] <= 0 or fields.get("n_ranks", 8) < 1:
            raise UserError(f"model spec {spec!r}: needs lat_us >= 0, busbw_gbps > 0, n_ranks >= 1")
        return AllReduceModel(**fields, source=f"params {spec}")
    path = Path(spec)
    if not path.is_file():
        raise UserError(f"model spec {spec!r}: not a preset ({', '.join(PRESETS)}), "
                        "not lat_us=..,busbw_gbps=.. and not a CSV file")
    import csv

    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "busbw_gbps" not in rows[0]:
        raise UserError(f"{path}: not an allreduce CSV (no busbw_gbps column)")
    modes = {r["mode"] for r in rows}
    mode = mode or ("graph" if "graph" in modes else "eager")
    try:
        rows = [r for r in rows if r["mode"] == mode and int(r["wrong"]) == 0]
    except (KeyError, ValueError):
        raise UserError(f"{path}: not an allreduce CSV (bad mode/wrong columns)") from None
    ranks = {int(r["n_ranks"]) for r in rows}
    if len(ranks) != 1:
        raise UserError(f"{path}: need {mode} rows of one rank count, found {sorted(ranks) or 'none'}")
    return fit_model([(r["size_bytes"], r["time_us"]) for r in rows], ranks.pop(),
                     source=f"fit: {path.name} {mode}")


def predictor(spec: str | None, tp: int):
    """-> (`predict_us(nbytes)` of one TP-`tp` all-reduce, a description) from a model spec
    (default `DEFAULT`)."""
    model = load_model(spec or DEFAULT).with_ranks(tp)
    return model.predict_us, model.describe()
