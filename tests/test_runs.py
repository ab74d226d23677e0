"""ddbench.runs: the results/<gpu>/<command>/<stamp>[_tag] layout, run listing, latest run."""
import datetime as dt
import json

import pytest

from ddbench.runs import differing_args, gpu_slug, latest_runs, list_runs, run_path, session


def put(root, rel, meta=None, rows="a,b\n1,2\n"):
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(rows)
    if meta is not None:
        base = p.with_name(p.name.removesuffix(".partial"))
        base.with_suffix(".json").write_text(json.dumps(meta))
    return p


def meta(kind, started, command="ddbench x", **kw):
    return {"kind": kind, "started_at": started, "command": command, "completed": True, **kw}


def test_run_path_layout():
    when = dt.datetime(2026, 12, 4, 19, 8, 49, tzinfo=dt.timezone.utc)
    assert str(run_path("results", "NVIDIA H200", "moe-sweep", None, when)) == "results/h200/moe-sweep/20261204-190849"
    assert run_path("r", None, "decode", "c10", when).name == "20261204-190849_c10"
    assert gpu_slug("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"
    with pytest.raises(ValueError):
        run_path("r", "h200", "nope")
    with pytest.raises(ValueError):
        run_path("r", "h200", "decode", "../x")


def test_latest_and_incomplete(tmp_path):
    put(tmp_path, "h200/decode/20261201-100000.csv", meta("decode", "2026-12-01T10:00:00+00:00"))
    put(tmp_path, "h200/decode/20261203-100000.csv", meta("decode", "2026-12-03T10:00:00+00:00"))
    put(tmp_path, "h200/decode/20261202-100000.csv", meta("decode", "2026-12-02T10:00:00+00:00"))
    # an interrupted run: the CSV still .partial and no sidecar, newest of its command
    put(tmp_path, "h200/moe-sweep/20261101-000000.csv", meta("moe_sweep", "2026-11-01T00:00:00+00:00"))
    put(tmp_path, "h200/moe-sweep/20261204-120000_tp8.csv.partial")
    put(tmp_path, "h200/e2e/20261204-120000.csv", meta("e2e", "2026-12-04T12:00:00+00:00", completed=False))
    put(tmp_path, "elsewhere/probe.csv")  # not a ddbench run: no sidecar, not in the layout
    runs = list_runs(tmp_path)
    assert len(runs) == 6 and all("probe" not in r.name for r in runs)
    latest = latest_runs(tmp_path)
    assert latest["decode"].name == "20261203-100000" and not latest["decode"].incomplete
    assert latest["moe-sweep"].name == "20261204-120000_tp8" and latest["moe-sweep"].incomplete
    assert latest["e2e"].incomplete  # sidecar says completed: false
    assert latest["moe-sweep"].started == dt.datetime(2026, 12, 4, 12, tzinfo=dt.timezone.utc)


def test_session_and_labels(tmp_path):
    base = "ddbench e2e --preset k2.6 --budget 8,16 --out r"
    put(tmp_path, "h200/e2e/a_c1.csv", meta("e2e", "2026-12-03T06:30:01+00:00", base + " --concurrency 1 --name a",
                                            git_commit="abc"))
    put(tmp_path, "h200/e2e/a_c10.csv", meta("e2e", "2026-12-03T06:30:18+00:00", base + " --concurrency 10 --name b",
                                             git_commit="abc"))
    put(tmp_path, "h200/e2e/old_c1.csv", meta("e2e", "2026-12-03T06:10:00+00:00", base + " --concurrency 1",
                                              git_commit="abc"))
    put(tmp_path, "h200/e2e/other.csv", meta("e2e", "2026-12-03T06:20:00+00:00", base + " --budget 64",
                                             git_commit="abc"))
    runs = list_runs(tmp_path)
    latest = latest_runs(tmp_path)["e2e"]
    assert [r.name for r in session(runs, latest)] == ["a_c1", "a_c10"]  # the nearer c=1 run, not old_c1
    labels = differing_args([r for r in runs if r.name in ("a_c1", "a_c10")])
    assert labels == {"a_c1": "--concurrency 1", "a_c10": "--concurrency 10"}
    put(tmp_path, "h100/e2e/h_c1.csv", meta("e2e", "2026-12-03T07:00:00+00:00", base + " --concurrency 1",
                                            git_commit="abc"))
    runs = list_runs(tmp_path)
    labels = differing_args([r for r in runs if r.name in ("a_c1", "h_c1")])   # same options, two cards
    assert labels == {"a_c1": "h200: a_c1", "h_c1": "h100: h_c1"}


def test_session_takes_one_scripts_runs_by_their_stamp(tmp_path):
    """A script's runs share the stamp in their names even where their options differ (c=1 with
    more tokens than c=10, the router's routing beside): the latest run brings the others."""
    base = "ddbench e2e --preset k2.6 --out r"
    for tag, t, opts in [("honest_c1", "17:20:48", "--concurrency 1 --new-tokens 384"),
                         ("honest_c10", "17:22:53", "--concurrency 10 --new-tokens 128 --budget 8,16"),
                         ("honest_model", "17:24:57", "--concurrency 10 --routing model")]:
        put(tmp_path, f"h100/e2e/20261205-172043_{tag}.csv", meta("e2e", f"2026-12-05T{t}+00:00", f"{base} {opts}",
                                                                  git_commit="abc"))
    put(tmp_path, "h100/e2e/20261205-163609_honest.csv", meta("e2e", "2026-12-05T16:36:15+00:00",
                                                             base + " --budget 64", git_commit="abc"))
    runs = list_runs(tmp_path)
    latest = latest_runs(tmp_path)["e2e"]
    assert latest.name == "20261205-172043_honest_model"
    assert [r.name for r in session(runs, latest)] == ["20261205-172043_honest_c1", "20261205-172043_honest_c10",
                                                       "20261205-172043_honest_model"]


def test_partial_run_found_from_its_command_folder(tmp_path):
    put(tmp_path, "h200/decode/20261204-200000.csv.partial", rows="concurrency,step_us\n1,5.5\n")
    (run,) = list_runs(tmp_path / "h200" / "decode")
    assert (run.command, run.gpu, run.incomplete) == ("decode", "h200", True)
    (run,) = list_runs(tmp_path / "h200" / "decode" / "20261204-200000.csv.partial")
    assert run.name == "20261204-200000"
