"""ddbench report over a small results tree: latest run, incomplete runs, tables, plots, RESULTS.md."""
import json
import random

import pandas as pd
import pytest
from typer.testing import CliRunner

from ddbench import plots
from ddbench.cli import app
from ddbench.report import run


def write(root, rel, rows, meta=None):
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(p, index=False)
    if meta is not None:
        p.with_suffix(".json").write_text(json.dumps({"completed": True, "gpu_name": "NVIDIA H200", **meta}))
    return p


@pytest.fixture
def tree(tmp_path):
    rng = random.Random()
    res = tmp_path / "results"

    def moe_rows(scale):
        return [{"backend": "triton", "stage": "layer", "tp": 8, "tokens": t, "routing": "uniform",
                 "time_us": scale * t ** 0.5 * rng.uniform(20, 30), "floor_bytes_us": 5.0 * t, "floor_compute_us": 0.1 * t,
                 "pct_of_copy_bw": rng.uniform(10, 90), "tflops": rng.uniform(1, 50), "cuda_graph": True,
                 "copy_gbps": 4200.0} for t in (1, 4, 16, 64)]
    write(res, "h200/moe-sweep/20261201-100000_old.csv", moe_rows(9.0),
          {"kind": "moe_sweep", "started_at": "2026-12-01T10:00:00+00:00", "command": "ddbench moe-sweep --tp 8", "tp": 8})
    write(res, "h200/moe-sweep/20261203-100000_new.csv", moe_rows(1.0),
          {"kind": "moe_sweep", "started_at": "2026-12-03T10:00:00+00:00",
           "command": "ddbench moe-sweep --tp 8 --tokens 1,4,16,64", "tp": 8})
    sizes = [2 ** k for k in range(3, 21, 2)]
    write(res, "h200/allreduce/20261202-000000_1gpu.csv",
          [{"size_bytes": s, "time_us": 20 + s / 1e5 * rng.uniform(0.9, 1.1), "time_us_p20": 19.0, "time_us_p80": 30.0,
            "algbw_gbps": s / 2e4, "busbw_gbps": 0.0, "wrong": 0, "n_ranks": 1, "mode": m, "backend": "nccl"}
           for m in ("eager", "graph") for s in sizes],
          {"kind": "allreduce", "started_at": "2026-12-02T00:00:00+00:00", "command": "ddbench allreduce --gpus 1"})
    write(res, "h200/decode/20261203-000000.csv",
          [{"preset": "k2.6", "tp": 8, "mode": "simulated", "concurrency": c, "step_us": rng.uniform(3e3, 9e3),
            "comm_us": 1200.0, "step_total_us": rng.uniform(5e3, 1e4), "output_tok_per_s": rng.uniform(150, 800),
            "floor_us": 1400.0, "floor_ratio": 2.5, "attention_us": rng.uniform(1e3, 3e3),
            "moe_us": rng.uniform(2e3, 8e3), "mlp_us": 700.0, "lm_head_us": 90.0, "other_us": 15.0}
           for c in (1, 10)],
          {"kind": "decode", "started_at": "2026-12-03T00:00:00+00:00", "command": "ddbench decode", "tp": 8})
    # a newer decode run, interrupted: a .partial CSV and no sidecar
    p = write(res, "h200/decode/20261204-000000.csv",
              [{"preset": "k2.6", "tp": 8, "mode": "simulated", "concurrency": 1, "step_us": 4000.0, "comm_us": 1.0,
                "step_total_us": 4001.0, "output_tok_per_s": 250.0}])
    p.rename(p.with_name(p.name + ".partial"))
    e2e_rows = []
    for c in (1, 10):
        e2e_rows.append({"preset": "k2.6", "tp": 8, "label": "engine AR", "decoder": "ar", "acceptance": "none",
                         "concurrency": c, "budget": 0, "output_tok_per_s": 150.0 * c ** 0.6, "mean_accepted": 1.0,
                         "step_total_us": 5000.0, "draft_us": 0.0, "verify_moe_us": 2000.0, "comm_us": 1200.0})
        for prof in ("gsm8k", "mtbench"):
            for b in (8, 16, 32, 64):
                e2e_rows.append({"preset": "k2.6", "tp": 8, "label": f"engine DDTree {prof}", "decoder": "ddtree",
                                 "profile": prof, "acceptance": prof, "routing": "uniform", "concurrency": c,
                                 "budget": b, "output_tok_per_s": rng.uniform(200, 1600),
                                 "predicted_tok_per_s": rng.uniform(200, 1600), "mean_accepted": rng.uniform(2, 8),
                                 "step_total_us": rng.uniform(1e4, 3e4), "draft_us": 2000.0,
                                 "verify_moe_us": rng.uniform(5e3, 2e4), "comm_us": 1500.0})
    write(res, "h200/e2e/20261204-010000.csv", e2e_rows,
          {"kind": "e2e", "started_at": "2026-12-04T01:00:00+00:00", "command": "ddbench e2e --budget 8,16,32,64"})
    write(res, "baseline/sglang_reference.csv",
          [{"label": "SGLang ref", "source": "reference", "concurrency": 1, "output_tok_per_s": 138},
           {"label": "SGLang ref", "source": "reference", "concurrency": 10, "output_tok_per_s": 517}],
          {"kind": "baseline", "source": "reference"})
    # a measured baseline run: its summary and per-request CSVs, newer than nothing else of its command
    bmeta = {"kind": "baseline", "started_at": "2026-12-04T02:00:00+00:00", "git_commit": "abc",
             "command": "ddbench baseline --url http://localhost:30000 --concurrency 1,4"}
    write(res, "h200/baseline/20261204-020000.csv",
          [{"label": "local", "concurrency": c, "output_tok_per_s": rng.uniform(50, 300), "median_ttft_ms": 90.0}
           for c in (1, 4)], bmeta)
    write(res, "h200/baseline/20261204-020000_requests.csv",
          [{"concurrency": c, "ok": int(i != 3), "ttft_ms": rng.uniform(50, 200), "tpot_ms": rng.uniform(5, 20)}
           for c in (1, 4) for i in range(8)], {**bmeta, "kind": "baseline_requests"})
    return res


@pytest.fixture
def legends(monkeypatch):
    """Every saved figure's legend sizes, by file name."""
    seen = {}
    real = plots.save

    def spy(fig, out, name, fmt):
        found = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
        seen[name] = [len(legend.get_texts()) for legend in found]
        return real(fig, out, name, fmt)

    monkeypatch.setattr(plots, "save", spy)
    return seen


def test_report_latest_runs_tables_and_plots(tree, tmp_path, legends):
    out = tmp_path / "rep"
    md = tmp_path / "docs" / "RESULTS.md"
    text = run([tree], out, "png", results_md=md).read_text()
    assert "20261203-100000_new.csv" in text and "20261201-100000_old" not in text  # the latest MoE run only
    assert "20261204-000000.csv.partial" in text and "INCOMPLETE" in text          # newest decode: interrupted
    assert "| c | SGLang reference |" in text and "| 10 | 517 |" in text            # engine vs SGLang table
    assert "| backend | routing | T |" in text and "n/a (1 GPU)" in text
    assert "predicted tok/s" in text and "mean accepted" in text
    assert not (out / "allreduce_busbw.png").exists() and (out / "allreduce_time.png").exists()
    for name in ("moe_sweep_time", "moe_sweep_pct_copy", "decode_phases", "e2e_budget", "e2e_accepted",
                 "e2e_phases", "baseline_throughput", "baseline_latency_cdf"):
        assert (out / f"{name}.png").stat().st_size > 1000, name
        assert f"({name}.png)" in text
    assert legends and all(0 < n <= plots.MAX_LEGEND for ns in legends.values() for n in ns), legends
    assert legends["baseline_throughput"] == [5]  # local, SGLang reference, engine AR, DDTree best / weakest
    assert legends["baseline_latency_cdf"] == [2]  # c=1 and c=4 of the latest baseline run
    assert len(legends["e2e_budget"]) == 1         # one legend below both concurrency panels
    assert "| local | 1 |" in text and "| 1 | 138 |" in text
    results = md.read_text()
    assert "Generated by `ddbench report" in results and "20261203-100000_new.csv" in results
    assert ".png" not in results and "| 1 | 138 |" in results


def test_report_compares_chosen_runs(tree, tmp_path, legends):
    text = run([tree], tmp_path / "rep", "png", runs="20261201,20261203-100000").read_text()
    assert "20261201-100000_old" in text and "20261203-100000_new" in text
    assert legends["moe_sweep_time"] == [6]  # per run: its curve and its 2 floors, labelled by what differs


def test_report_old_e2e_csv_without_new_columns(tree, tmp_path):
    p = tree / "h200/e2e/20261204-010000.csv"
    df = pd.read_csv(p).drop(columns=["profile", "predicted_tok_per_s", "routing"])
    df.to_csv(p, index=False)
    text = run([tree], tmp_path / "rep", "png").read_text()
    assert "predicted tok/s" not in text and "e2e_budget.png" in text and "e2e_accepted.png" in text


def test_report_cli_errors(tree, tmp_path):
    r = CliRunner().invoke(app, ["report", str(tree), "--out", str(tmp_path / "o"), "--runs", "nothing-like-this"])
    assert r.exit_code == 2 and "no run matches" in r.output
    r = CliRunner().invoke(app, ["report", str(tree), "--out", str(tmp_path / "o"), "--format", "gif"])
    assert r.exit_code == 2
    r = CliRunner().invoke(app, ["report", str(tree), "--out", str(tmp_path / "o"),
                                 "--results-md", str(tmp_path / "R.md")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "R.md").exists()


def test_headline_prefers_honest_routing_and_flags_the_random_router():
    """The engine-vs-SGLang headline takes DDTree rows with honest routing and a named rank
    profile where there are any; with only random-weight-router rows it says they flatter."""
    import pandas as pd

    from ddbench.report import honest_routing

    assert not honest_routing(pd.Series({"decoder": "ddtree"}))                       # before the column
    assert not honest_routing(pd.Series({"routing": "model", "checkpoint": float("nan")}))
    assert honest_routing(pd.Series({"routing": "model", "checkpoint": "/ckpt"}))
    assert honest_routing(pd.Series({"routing": "uniform"})) and honest_routing(pd.Series({"routing": "overlap:0.5"}))


def test_headline_ddtree_row_is_the_honest_one():
    import pandas as pd

    from ddbench.report import summary

    def frame(routing, tps, prof):
        row = {"decoder": "ddtree", "concurrency": 1, "budget": 8, "output_tok_per_s": tps, "acceptance": prof,
               "mode": "simulated"}
        return pd.DataFrame([{**row, "routing": routing}] if routing else [row])

    from types import SimpleNamespace

    honest = [(SimpleNamespace(name="r1"), frame("uniform", 300.0, "rank:dflash-k25-gsm8k-paper")),
              (SimpleNamespace(name="r2"), frame("uniform", 400.0, "synthetic:6"))]
    old = [(SimpleNamespace(name="r0"), frame(None, 900.0, "synthetic:9"))]
    honest.append((SimpleNamespace(name="r3"), frame("uniform", float("nan"), "rank:x")))   # an unfinished row
    text = "\n".join(summary({"e2e": honest + old}, {1: [("SGLang", 138.0)]}))
    assert "| 300 |" in text and "900" not in text and "flatters" not in text
    # a second rank profile: the table gives both ends of the acceptance bracket
    weak = [(SimpleNamespace(name="r4"), pd.concat([frame("uniform", 200.0, "rank:weak"),
                                                     frame("uniform", 250.0, "rank:weak").assign(budget=16)]))]
    text = "\n".join(summary({"e2e": honest + weak}, {1: [("SGLang", 138.0)]}))
    assert "| 300 | rank:dflash-k25-gsm8k-paper b=8 | 250 | rank:weak b=16 |" in text and "| 1.81-2.17x |" in text
    text = "\n".join(summary({"e2e": old}, {1: [("SGLang", 138.0)]}))
    assert "900" in text and "flatters" in text


def test_headline_ar_rows_are_the_honest_ones():
    """The random-weight router's AR (decode and e2e) rows are faster than uniform routing's; the
    headline takes the uniform ones where a run has them."""
    from types import SimpleNamespace

    import pandas as pd

    from ddbench.report import _engine_series, summary

    def run(name, gpu="h100", **row):
        return (SimpleNamespace(name=name, gpu=gpu), pd.DataFrame([{"concurrency": 10, "mode": "simulated", **row}]))

    e2e = [run("u", decoder="ar", routing="uniform", output_tok_per_s=727.0, acceptance="none"),
           run("m", decoder="ar", routing="model", output_tok_per_s=746.0, acceptance="none"),
           run("t", "h200", decoder="ddtree", routing="uniform", output_tok_per_s=1400.0, budget=8,
               acceptance="rank:p")]
    dec = [run("du", routing="uniform", output_tok_per_s=748.0), run("dm", routing="model", output_tok_per_s=767.0)]
    text = "\n".join(summary({"e2e": e2e, "decode": dec}, {10: [("SGLang", 517.0)]}))
    assert "| 727 |" in text and "| 748 |" in text and "746" not in text and "767" not in text
    h100, h200 = text.splitlines()[-2:]                      # a row a card, never one mixing them
    assert h100 == "| 10 | 517 | 748 | 727 |  |  |  |  | 1.45x |  | h100 |"
    assert h200.startswith("| 10 | 517 |  |  | 1400 | rank:p b=8 |") and h200.endswith("| 2.71x | h200 |")
    # the report's throughput plot draws the same rows, each line naming its GPU
    assert _engine_series({"e2e": e2e, "decode": dec}) == [
        ("engine AR (h100)", {10: 748.0}, {}), ("engine DDTree (h200)", {10: 1400.0}, {10: "rank:p b=8"})]
    e2e.append(run("w", "h200", decoder="ddtree", routing="uniform", output_tok_per_s=900.0, budget=8,
                   acceptance="rank:w"))
    assert [name for name, *_ in _engine_series({"e2e": e2e})] == [
        "engine AR (h100)", "engine DDTree, best profile (h200)", "engine DDTree, weakest profile (h200)"]
    assert _engine_series({"e2e": e2e})[-1][1:] == ({10: 900.0}, {10: "rank:w b=8"})


def test_e2e_table_keeps_a_series_per_routing_and_ranks_by_the_steady_rate():
    from types import SimpleNamespace

    import pandas as pd

    from ddbench.report import table_e2e

    def run(name, routing, rows):
        return (SimpleNamespace(name=name, command_line=f"ddbench e2e --routing {routing}"),
                pd.DataFrame([{"decoder": "ddtree", "concurrency": 10, "acceptance": "rank:p", "routing": routing,
                               "step_total_us": 40000.0, **r} for r in rows]))

    u = run("u", "uniform", [{"budget": 8, "output_tok_per_s": 950.0, "steady_tok_per_s": 1310.0},
                             {"budget": 16, "output_tok_per_s": 990.0, "steady_tok_per_s": 1160.0}])
    m = run("m", "model", [{"budget": 32, "output_tok_per_s": 1110.0, "steady_tok_per_s": 1365.0}])
    text = "\n".join(table_e2e([u, m], {}))
    rows = [l for l in text.splitlines() if l.startswith("| u ") or l.startswith("| m ")]
    assert len(rows) == 2                                   # one best row a routing
    assert "| 8 | 1310 | 950 |" in rows[1] or "| 8 | 1310 | 950 |" in rows[0]   # budget 8 wins on the steady rate


def test_long_series_names_wrap_for_tick_labels():
    assert plots._wrap("rank:dflash-k25-gsm8k-paper") == "rank:dflash-\nk25-gsm8k-\npaper"
    assert plots._wrap("synthetic:6") == "synthetic:6" and plots._wrap("abcdefghijklmnopq") == "abcdefghijklmnopq"


def test_results_md_reports_committed_runs_only(tree, tmp_path):
    """A run left on disk (a local `make bench`, say) never becomes RESULTS.md's figure; the
    plain report still shows it."""
    import subprocess

    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "results"], check=True)
    subprocess.run(git + ["commit", "-qm", "runs"], check=True)
    rows = pd.read_csv(tree / "h200/moe-sweep/20261203-100000_new.csv").to_dict("records")
    write(tree, "cpu/moe-sweep/20261205-100000_local.csv", rows,
          {"kind": "moe_sweep", "started_at": "2026-12-05T10:00:00+00:00", "command": "ddbench moe-sweep", "tp": 8})
    md = tmp_path / "RESULTS.md"
    run([tree], tmp_path / "a", "png", results_md=md)
    assert "20261203-100000_new.csv" in md.read_text() and "_local" not in md.read_text()
    assert "_local" in run([tree], tmp_path / "b", "png").read_text()


def test_legends_cap_their_entries_and_say_how_many_were_left_out():
    import matplotlib.pyplot as plt

    n = plots.MAX_LEGEND + 2
    fig, axes = plt.subplots(1, 2, layout="constrained")
    for ax in axes:
        for i in range(n):
            ax.plot([0, 1], [i, i], label=f"s{i}")
    plots._fig_legend(fig, axes)                     # both panels' series, each name once
    plots._legend(axes[0])
    assert len(fig.legends) == 1 and len(fig.legends[0].get_texts()) == plots.MAX_LEGEND
    assert len(axes[0].get_legend().get_texts()) == plots.MAX_LEGEND
    for owner in (fig, axes[0]):
        assert [t.get_text() for t in owner.texts] == ["2 more series not in the legend: choose fewer with --runs"]
    plt.close(fig)


def test_a_newer_run_on_one_card_keeps_the_other_cards_latest(tree, tmp_path):
    """The latest run of each command on each GPU: a newer H100 sweep does not hide the H200's
    (where the targets are measured), and the table's rows name their card."""
    write(tree, "h100/moe-sweep/20261205-100000_tp8.csv",
          [{"backend": "triton", "stage": "layer", "tp": 8, "tokens": t, "routing": "uniform", "time_us": 11.0 * t,
            "floor_bytes_us": 8.0 * t, "pct_of_copy_bw": 72.7, "tflops": 3.0, "cuda_graph": True} for t in (1, 8)],
          {"kind": "moe_sweep", "started_at": "2026-12-05T10:00:00+00:00", "command": "ddbench moe-sweep --tp 8",
           "gpu_name": "NVIDIA H100 80GB HBM3", "tp": 8})
    text = run([tree], tmp_path / "rep", "png").read_text()
    assert "h100/moe-sweep/20261205-100000_tp8.csv" in text and "h200/moe-sweep/20261203-100000_new.csv" in text
    assert "20261201-100000_old" not in text                   # still only the latest of each card
    assert "| h100/20261205-100000_tp8 | triton | uniform | 8 | 88.0 |" in text
    assert "| h200/20261203-100000_new | triton | uniform | 64 |" in text


def test_e2e_plot_draws_an_ar_line_and_series_per_card(tmp_path, monkeypatch):
    """Runs of two cards: each card's AR rate is its own line and each profile's series names its
    card (never one line or point mixing cards)."""
    from types import SimpleNamespace

    from ddbench.runs import differing_args

    figs = {}
    real = plots.save
    monkeypatch.setattr(plots, "save", lambda fig, out, name, fmt: figs.setdefault(name, fig) and real(fig, out, name, fmt))

    def run(gpu, ar, tree):
        rows = [{"decoder": "ar", "concurrency": 1, "acceptance": "none", "output_tok_per_s": ar, "budget": 0}]
        rows += [{"decoder": "ddtree", "concurrency": 1, "acceptance": "rank:p", "routing": "uniform", "budget": b,
                  "output_tok_per_s": tree / b ** 0.3, "step_total_us": 1e4} for b in (8, 16)]
        return (SimpleNamespace(name=f"20261207-0000{len(gpu)}0_{gpu}", gpu=gpu, command_line="ddbench e2e",
                                incomplete=False, started=None, date="", meta={}),
                pd.DataFrame(rows))

    runs = [run("h100", 168.0, 350.0), run("h200", 180.0, 390.0)]
    plots.e2e(runs, differing_args([r for r, _ in runs]), tmp_path, "png")
    labels = {line.get_label(): line for ax in figs["e2e_budget"].axes for line in ax.get_lines()}
    assert labels["engine AR (h100)"].get_ydata()[0] == 168.0 and labels["engine AR (h200)"].get_ydata()[0] == 180.0
    assert sorted(labels) == ["engine AR (h100)", "engine AR (h200)", "rank:p [h100] measured", "rank:p [h200] measured"]
