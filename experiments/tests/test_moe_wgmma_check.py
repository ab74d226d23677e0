"""experiments.scripts.moe_wgmma_check runs through on the CPU with its GPU calls replaced by the
torch reference (small experts, fixed timings): the script's own logic (variants, parts, the CSV
written after every row, the summary) before it spends device time."""
import csv

import torch

from ddbench import timing
from ddbench.kernels import moe_marlin as mm
from ddbench.kernels.moe import fused_moe_ref
from experiments.scripts import moe_marlin_variants as mv
from experiments.scripts import moe_wgmma_check as chk


class _Stats:
    median_us = 100.0


def test_check_runs_and_writes_every_row(monkeypatch, tmp_path):
    small = dict(E=8, H=256, I=128, G=32, K=2)
    for mod in (chk, mv):
        for k, v in small.items():
            monkeypatch.setattr(mod, k, v)
    monkeypatch.setattr(chk, "ROT", 2)
    monkeypatch.setattr(timing, "bench", lambda fn, **kw: (fn(), _Stats())[1])
    monkeypatch.setattr(timing, "gemm_tflops", lambda dev: 800.0)
    monkeypatch.setattr(timing, "copy_bandwidth_gbps", lambda dev: 4000.0)
    monkeypatch.setattr(chk, "resources", lambda k: {"registers": 1, "local_bytes": 0})
    monkeypatch.setattr(chk.mg, "_kernel", lambda *a: None)
    ref = lambda x, ids, tw, w, *a, **kw: fused_moe_ref(x.float(), ids, tw, w).to(x.dtype)   # noqa: E731
    monkeypatch.setattr(chk, "fused_moe", ref)
    monkeypatch.setattr(chk.mg, "fused_moe_wgmma", ref)
    monkeypatch.setattr(chk.mm, "plan", lambda ids, e, ch, *a: mm.plan_ref(ids, e, ch))
    part = lambda *a, **kw: torch.zeros(1)                                                 # noqa: E731
    for name in ("wg_w13", "wg_w2"):
        monkeypatch.setattr(chk.mg, name, part)
    for name in ("wide_w13", "wide_w2"):
        monkeypatch.setattr(chk.mw, name, part)
    monkeypatch.setattr(chk, "resolve_moe_kernel", lambda t, k, w, dev: ("wide", {"mt": 2, "stages": 4, "warps": 4,
                                                                                  "w2_warps": 4, "minb": 1})
                        if t >= 64 else ("marlin", {"ng": 1}))
    out = tmp_path / "c.csv"
    chk.main(str(out), "64,16", "4,8:16-32-48", device="cpu")
    rows = list(csv.DictReader(open(out)))
    # T = 64: product + both builds (N3 48 < 64 runs at T <= 512 too), 2 rounds; T = 16 the same
    assert len(rows) == 2 * 3 * 2
    assert {r["variant"] for r in rows} == {"product", "wgmma_4", "wgmma_8:16-32-48"}
    assert all(float(r["rel_err"]) < 1e-2 and r["bitwise_repeat"] == "True" for r in rows)
    wide = [r for r in rows if r["tokens"] == "64" and r["variant"] == "product"]
    assert wide[0]["kernel"].startswith("wide mt2") and wide[0]["w13_us"] == "100.0"
    assert [r for r in rows if r["tokens"] == "16" and r["variant"] == "product"][0]["w13_us"] == ""
