"""`ddbench e2e` on the tiny preset (CPU): CSV rows and columns, the baseline beside it,
the report plots, and one-line errors for bad input."""
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from ddbench.cli import app

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def e2e_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    base = out / "baseline"
    shutil.copytree(ROOT / "results" / "baseline", base)
    r = CliRunner().invoke(app, ["e2e", "--preset", "tiny", "--concurrency", "1,2", "--budget", "3,6",
                                 "--acceptance", "real,synthetic:3", "--prompt-len", "5,9", "--new-tokens", "5",
                                 "--baseline", str(base), "--out", str(out)])
    assert r.exit_code == 0, r.output
    csv = next(out.glob("e2e_*.csv"))
    return out, csv, r.output


def test_e2e_rows_and_columns(e2e_run):
    out, csv, output = e2e_run
    df = pd.read_csv(csv)
    assert len(df) == 2 * (1 + 2 * 2)
    for col in ("decoder", "acceptance", "concurrency", "budget", "output_tok_per_s", "steps_per_s",
                "mean_accepted", "step_total_us", "draft_us", "tree_us", "verify_attention_us", "verify_moe_us",
                "verify_other_us", "comm_us", "accept_us", "host_us", "floor_us", "cuda_graph"):
        assert col in df.columns, col
    ar = df[df.decoder == "ar"]
    assert list(ar.acceptance) == ["none", "none"] and (ar.mean_accepted == 1.0).all()
    spec = df[df.decoder == "ddtree"]
    assert set(spec.acceptance) == {"real", "synthetic:3"} and set(spec.budget) == {3, 6}
    assert (df.tokens == df.concurrency * 4).all()             # new tokens - the prefill's first
    assert (df.output_tok_per_s > 0).all()
    assert (spec[spec.acceptance == "real"].matches_ar == True).all()  # noqa: E712 - NaN must fail      # lossless vs AR, same run
    syn = spec[spec.acceptance == "synthetic:3"]
    assert (syn.mean_accepted > 1.5).all() and (syn.tau_target == 3.0).all()
    meta = json.loads(csv.with_suffix(".json").read_text())
    assert meta["kind"] == "e2e" and meta["completed"] and meta["acceptance"] == ["real", "synthetic:3"]
    assert "SGLang" in output and "138.0" in output              # the baseline row beside the engine


def test_e2e_report_plots(e2e_run):
    from ddbench.report import run

    out, _, _ = e2e_run
    report = run([out], out / "report", "png")
    text = report.read_text()
    for name in ("e2e_throughput.png", "e2e_phases.png", "e2e_budget.png"):
        assert name in text and (out / "report" / name).stat().st_size > 1000


def test_e2e_tensor_parallel_gloo(tmp_path):
    """--tp 2 without --simulate-rank: two gloo processes run the real TP engine; the
    real-acceptance output still equals greedy decoding (AR of the same run)."""
    r = CliRunner().invoke(app, ["e2e", "--preset", "tiny", "--tp", "2", "--concurrency", "2", "--budget", "4",
                                 "--acceptance", "real", "--prompt-len", "5", "--new-tokens", "6",
                                 "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(next(tmp_path.glob("e2e_*.csv")))
    assert list(df["mode"]) == ["distributed"] * 2 and list(df.comm_source) == ["measured in verify"] * 2
    assert bool(df[df.decoder == "ddtree"].matches_ar.iloc[0])


def test_e2e_keeps_going_after_a_failing_budget(tmp_path, monkeypatch):
    """A budget whose run raises is reported and skipped; the others are measured; exit 1."""
    from ddbench.engine import spec

    real_draft = spec.SpecStep._draft

    def draft(self):
        if self.budget == 5:
            raise RuntimeError("injected failure")
        return real_draft(self)
    monkeypatch.setattr(spec.SpecStep, "_draft", draft)
    r = CliRunner().invoke(app, ["e2e", "--preset", "tiny", "--concurrency", "1", "--budget", "5,3",
                                 "--acceptance", "synthetic:2", "--prompt-len", "4", "--new-tokens", "4",
                                 "--out", str(tmp_path)])
    assert r.exit_code == 1
    assert "FAILED c=1 budget=5 synthetic:2: RuntimeError: injected failure" in r.output
    df = pd.read_csv(next(tmp_path.glob("e2e_*.csv")))
    assert list(df.budget) == [0, 3]
    meta = json.loads(next(tmp_path.glob("e2e_*.json")).read_text())
    assert len(meta["errors"]) == 1


@pytest.mark.parametrize("args,msg", [
    (["--acceptance", "synthetic:99"], "TAU"),
    (["--acceptance", "magic"], "--acceptance"),
    (["--budget", "0"], "--budget"),
    (["--tp", "2", "--gpus", "3"], "--gpus"),
    (["--tp", "2", "--simulate-rank", "3"], "not a rank"),
    (["--prompt-len", "x"], "--prompt-len"),
    (["--acceptance", "profile:/no/such/file"], "does not exist"),
])
def test_e2e_bad_input(tmp_path, args, msg):
    r = CliRunner().invoke(app, ["e2e", "--preset", "tiny", "--out", str(tmp_path), *args])
    assert r.exit_code == 2, r.output
    assert msg in r.output and r.output.count("\n") <= 2
