"""`ddbench e2e` on the tiny preset (CPU): CSV rows and columns, the baseline beside it,
the report plots, and one-line errors for bad input."""
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from ddbench.cli import app
from ddbench.e2e import DEFAULT_ACCEPTANCE, default_acceptance
from ddbench.engine.acceptance import load_profile
from ddbench.engine.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def e2e_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    base = out / "baseline"
    shutil.copytree(ROOT / "results" / "baseline", base)
    r = CliRunner().invoke(app, ["e2e", "--preset", "tiny", "--concurrency", "1,2", "--budget", "4",
                                 "--acceptance", "real,synthetic:3,rank:dflash-k25-gsm8k-paper",
                                 "--prompt-len", "5,9", "--new-tokens", "5", "--save-profile", str(out / "p.json"),
                                 "--baseline", str(base), "--out", str(out)])
    assert r.exit_code == 0, r.output
    csv = next(out.glob("*/e2e/*.csv"))
    return out, csv, r.output


def test_e2e_rows_and_columns(e2e_run):
    out, csv, output = e2e_run
    df = pd.read_csv(csv)
    assert len(df) == 2 * (1 + 3)
    for col in ("decoder", "acceptance", "concurrency", "budget", "output_tok_per_s", "steps_per_s",
                "mean_accepted", "step_total_us", "draft_us", "tree_us", "verify_attention_us", "verify_moe_us",
                "verify_other_us", "comm_us", "accept_us", "host_us", "floor_us", "cuda_graph", "routing",
                "experts_measured", "experts_uniform", "expected_accepted", "predicted_tok_per_s", "budget_auto",
                "step_us_p20", "step_us_p80", "mismatches_tied", "mismatches_real", "steady_tok_per_s",
                "steady_steps", "steady_accepted"):
        assert col in df.columns, col
    ar = df[df.decoder == "ar"]
    assert list(ar.acceptance) == ["none", "none"] and (ar.mean_accepted == 1.0).all()
    spec = df[df.decoder == "ddtree"]
    assert set(spec.acceptance) == {"real", "synthetic:3", "rank:dflash-k25-gsm8k-paper"}
    assert set(spec.budget) == {4} and (df.routing == "uniform").all()
    assert (df.experts_measured > 0).all() and (df.step_us_p20 <= df.step_us_p80).all()
    rank = spec[spec.acceptance == "rank:dflash-k25-gsm8k-paper"]
    assert (rank.expected_accepted > 2).all() and (rank.mean_accepted > 1.5).all()
    real = spec[spec.acceptance == "real"]
    assert (real.mismatches_tied == 0).all() and (real.mismatches_real == 0).all()
    assert (df.tokens == df.concurrency * 4).all()             # new tokens - the prefill's first
    assert (df.output_tok_per_s > 0).all()
    # c=2 with prompt lengths 5 and 9 and equal limits: AR streams finish together, so the
    # steady rate is the batch's; every row has a steady window
    assert (df.steady_steps >= 1).all() and (df.steady_tok_per_s > 0).all()
    ar2 = ar[ar.concurrency == 2].iloc[0]
    assert ar2.steady_steps == ar2.steps and ar2.steady_accepted == 1.0
    assert ar2.steady_tok_per_s == pytest.approx(2e6 / ar2.step_total_us, rel=0.05)
    assert (spec[spec.acceptance == "real"].matches_ar == True).all()  # noqa: E712 - NaN must fail      # lossless vs AR, same run
    syn = spec[spec.acceptance == "synthetic:3"]
    assert (syn.mean_accepted > 1.5).all() and (syn.tau_target == 3.0).all()
    meta = json.loads(csv.with_suffix(".json").read_text())
    assert meta["kind"] == "e2e" and meta["completed"]
    assert meta["acceptance"] == ["real", "synthetic:3", "rank:dflash-k25-gsm8k-paper"]
    assert "CPU TOY RUN" in output and "SGLang" not in output   # no GPU service rows beside CPU toy numbers
    prof = load_profile(str(out / "p.json"))                      # the real runs' ranks, round-trippable
    assert prof.params["observations"] > 0 and prof.depth == 7
    assert load_profile(str(out / "p.json")).probs == prof.probs


def test_e2e_budget_auto(tmp_path):
    """--budget auto on the tiny preset: grid rows carry the cost model's prediction, one
    more row per drawn acceptance at the chosen budget (budget_auto)."""
    r = CliRunner().invoke(app, ["e2e", "--preset", "tiny", "--concurrency", "1", "--budget", "2,4,auto",
                                 "--acceptance", "rank:dflash-k25-mtbench-paper", "--prompt-len", "4",
                                 "--new-tokens", "4", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(next(tmp_path.glob("*/e2e/*.csv")))
    assert len(df) == 1 + 2 + 1 and "budget auto: c=1" in r.output
    auto = df[df.budget_auto == True]  # noqa: E712
    assert len(auto) == 1 and int(auto.budget.iloc[0]) in range(2, 5) and auto.predicted_tok_per_s.iloc[0] > 0
    assert (df[df.decoder == "ddtree"].predicted_tok_per_s > 0).all()
    text = " ".join(r.output.split())       # rich wraps at the terminal's width
    assert "cost model, c=1: tok/s vs steady worst" in text and "best measured budget" in text


def test_e2e_layout_default_and_fit_check(tmp_path, monkeypatch):
    """Where the model cannot fit at tp=1 the default is one rank of TP-8, said in one line;
    an explicit layout that cannot fit fails before anything is allocated."""
    from ddbench.e2e import resolve_layout
    from ddbench.engine import build

    said = []

    def no_fit(cfg, *a):
        raise ConfigError("does not fit")
    monkeypatch.setattr(build, "check_fits", no_fit)
    assert resolve_layout(lambda t, r: None, None, None, None, torch.device("cuda"), 10, 300, said.append) == (8, 0)
    assert len(said) == 1 and "--tp 8 --simulate-rank 0" in said[0]
    assert resolve_layout(lambda t, r: None, 2, None, None, torch.device("cuda"), 10, 300, said.append) == (2, None)
    monkeypatch.undo()
    monkeypatch.setattr(build, "free_bytes", lambda device: 1000)
    r = CliRunner().invoke(app, ["e2e", "--preset", "tiny", "--tp", "1", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "try --tp 8 --simulate-rank 0" in r.output
    assert not list(tmp_path.rglob("*.csv"))


def test_mismatches_split_ties():
    from ddbench.e2e import mismatches

    ar = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    ar_tied = [[False, False, False], [False, True, False], [False] * 3]
    out = [[1, 2, 3], [4, 9, 9], [7, 0, 0]]
    tied = [[False] * 3, [False] * 3, [False, False, True]]
    assert mismatches(out, tied, ar, ar_tied) == (1, 1)


@pytest.mark.slow
def test_e2e_cpu_defaults_are_short(tmp_path):
    """`ddbench e2e` with no options on a CPU: the tiny preset, a short run, labelled a toy,
    random weights measured under the two named acceptance profiles (not `real`)."""
    import time

    t0 = time.perf_counter()
    r = CliRunner().invoke(app, ["e2e", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert time.perf_counter() - t0 < 120 and "CPU TOY RUN" in r.output and "SGLang" not in r.output
    df = pd.read_csv(next(tmp_path.glob("*/e2e/*.csv")))
    assert set(df.preset) == {"tiny"} and set(df.concurrency) == {1, 2}
    assert set(df[df.decoder == "ddtree"].acceptance) == set(DEFAULT_ACCEPTANCE)
    assert default_acceptance(None, "/ckpt") == ["real"] and default_acceptance(["x"], None) == ["x"]


def test_e2e_report_plots(e2e_run):
    from ddbench.report import run

    out, _, _ = e2e_run
    report = run([out], out / "report", "png")
    text = report.read_text()
    for name in ("e2e_phases.png", "e2e_budget.png"):
        assert name in text and (out / "report" / name).stat().st_size > 1000


def test_e2e_tensor_parallel_gloo(tmp_path):
    """--tp 2 without --simulate-rank: two gloo processes run the real TP engine; the
    real-acceptance output still equals greedy decoding (AR of the same run)."""
    r = CliRunner().invoke(app, ["e2e", "--preset", "tiny", "--tp", "2", "--concurrency", "2", "--budget", "4",
                                 "--acceptance", "real", "--prompt-len", "5", "--new-tokens", "6",
                                 "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(next(tmp_path.glob("*/e2e/*.csv")))
    assert list(df["mode"]) == ["distributed"] * 2 and list(df.comm_source) == ["measured in verify"] * 2
    assert bool(df[df.decoder == "ddtree"].matches_ar.iloc[0])
    # AR streams of equal prompts finish together: the steady rate is the batch's (the measured
    # collectives sit inside the step once, not again on top of it)
    ar = df[df.decoder == "ar"].iloc[0]
    assert ar.comm_us > 0 and ar.steady_tok_per_s == pytest.approx(ar.output_tok_per_s, rel=2e-3)


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
    df = pd.read_csv(next(tmp_path.glob("*/e2e/*.csv")))
    assert list(df.budget) == [0, 3]
    meta = json.loads(next(tmp_path.glob("*/e2e/*.json")).read_text())
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


def test_e2e_budget_auto_interrupted_keeps_grid_rows(tmp_path, monkeypatch):
    """--budget auto holds the grid rows for their prediction; a stop before the fit (Ctrl-C,
    SIGTERM, a cap) still writes the rows measured so far."""
    import ddbench.e2e as e2e

    real = e2e.run_concurrency

    def stop_after_first(model, drafter, c, *a, **kw):
        if c == 2:
            raise KeyboardInterrupt
        return real(model, drafter, c, *a, **kw)

    monkeypatch.setattr(e2e, "run_concurrency", stop_after_first)
    CliRunner().invoke(app, ["e2e", "--preset", "tiny", "--concurrency", "1,2", "--budget", "2,auto",
                             "--acceptance", "synthetic:2", "--new-tokens", "4", "--prompt-len", "8",
                             "--out", str(tmp_path), "--name", "stopped"])
    rows = pd.read_csv(tmp_path / "stopped.csv")
    assert set(rows.concurrency) == {1} and {"ar", "ddtree"} <= set(rows.decoder)


def test_e2e_table_fits_80_columns(tmp_path):
    """At 80 columns the key numbers (c, decoder, budget, acceptance, tok/s, x AR) show and no
    table line is wider than the terminal; the CSV keeps every column."""
    r = CliRunner().invoke(app, ["e2e", "--preset", "tiny", "--concurrency", "1", "--budget", "4",
                                 "--acceptance", "synthetic:2", "--prompt-len", "4", "--new-tokens", "4",
                                 "--out", str(tmp_path), "--name", "w"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    head = next(ln for ln in lines if ln.split()[:2] == ["c", "decoder"])
    assert all(k in head for k in ("budget", "acceptance", "tok/s", "x AR"))
    start = lines.index(head)
    assert all(len(ln) <= 80 for ln in lines[start:start + 4])
    assert "more columns" in r.output and {"verify_moe_us", "draft_us"} <= set(pd.read_csv(tmp_path / "w.csv"))


def test_e2e_table_with_the_sglang_reference_fits_80_columns():
    """The SGLang reference's long label beside a GPU run does not push the table into one
    `column: value` line a cell (hundreds of lines for a grid): the cell is cut, the title
    names it in full."""
    import io

    from rich.console import Console

    from ddbench.e2e import PHASE_COLS, print_table

    def row(decoder, budget, acceptance, tps):
        return {"concurrency": 10, "decoder": decoder, "budget": budget, "budget_auto": False,
                "acceptance": acceptance, "output_tok_per_s": tps, "steady_tok_per_s": tps, "mean_accepted": 5.2,
                "predicted_tok_per_s": tps, "experts_measured": 326.0, "matches_ar": None, "step_total_us": 38000.0,
                "floor_ratio": 1.5, "cuda_graph": True, "device": "cuda", **{f"{p}_us": 100.0 for p in PHASE_COLS}}

    label = "SGLang 8x RTX PRO 6000 TP-8 (reported)"
    out = io.StringIO()
    print_table(Console(file=out, width=80), [row("ar", 0, "none", 773.0),
                                              row("ddtree", 8, "rank:dflash-k25-mtbench-small", 952.0)],
                [{"label": label, "concurrency": 10, "output_tok_per_s": 517.0}])
    lines = out.getvalue().splitlines()
    head = next(ln for ln in lines if ln.split()[:2] == ["c", "decoder"])
    table = lines[lines.index(head):]
    assert all(len(ln) <= 80 for ln in table) and not any(ln.startswith("decoder:") for ln in lines)
    assert any("rank:dflash-k25-mtbench-small" in ln and "952" in ln for ln in table)
    assert any(ln.split()[:2] == ["10", "baseline"] and "517" in ln for ln in table)
    assert label in " ".join(lines[:lines.index(head)])          # the title gives it whole
