"""Everyday CLI behaviour: --version, tables that fit the terminal, and bad input caught
(one line, exit 2, nothing written) before any expensive step, for every command."""
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ddbench import __version__
from ddbench.cli import app
from ddbench.table import clip, fmt_value, render

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"ddbench {__version__}"


def _random_rows(n, seed):
    rng = random.Random(seed)
    return [{"kernel": rng.choice(["attn", "build", "accept_commit"]), "streams": rng.randint(1, 64),
             "budget": rng.choice([16, 256, 1024]), "prefix": rng.choice([1024, 32768]),
             "time_us": rng.uniform(0.5, 9e4), "time_us_p20": rng.uniform(0.5, 9e4),
             "time_us_p80": rng.uniform(0.5, 9e4), "bw_gbps": rng.uniform(10, 4000),
             "pct_copy_bw": rng.uniform(1, 99), "tflops": rng.uniform(0, 500), "kv_bytes": rng.randint(1, 2**34),
             "device": "NVIDIA H200 (a long device name)"} for _ in range(n)]


@pytest.mark.parametrize("width", [40, 80, 120, 400])
def test_table_fits_width_and_keeps_key_columns(width):
    rows = _random_rows(7, width)
    key = ("kernel", "streams", "time_us")
    lines, shown = render(rows, key=key, width=width, title="t", where="x.csv")
    assert all(len(line) <= width for line in lines), lines
    assert [c for c in shown if c in key] == list(key)
    header = lines[1].split()
    assert header == shown
    # every key number is printed, at four significant digits
    for r, line in zip(rows, lines[3:]):
        assert fmt_value(r["time_us"]) in line.split() and r["kernel"] in line.split()
    left = [c for c in rows[0] if c not in shown]
    if left:
        assert lines[-1].startswith(f"{len(left)} more column") and "x.csv" in lines[-1]
    else:
        assert width == 400 and "more column" not in lines[-1]


def test_table_folds_when_key_columns_do_not_fit():
    rows = _random_rows(2, 1)
    lines, shown = render(rows, key=("kernel", "time_us", "device"), width=20)
    assert shown == list(rows[0])
    assert sum(line.strip().startswith("time_us:") for line in lines) == 2
    assert any(line.endswith(fmt_value(rows[1]["time_us"])) for line in lines)


def test_table_drops_empty_columns_and_formats():
    lines, shown = render([{"k": "a", "x": None, "y": 1.23456}, {"k": "b", "x": "", "y": 12345.6}],
                          key=("k",), width=80)
    assert shown == ["k", "y"] and lines[2].split() == ["a", "1.235"] and lines[3].split() == ["b", "12346"]
    assert [fmt_value(v) for v in (float("nan"), True, 0.000123456, 7)] == ["-", "y", "0.000123", "7"]
    with pytest.raises(ValueError, match="key columns"):
        render([{"a": 1}], key=("b",))


def test_clip():
    assert clip("abcdef", 6) == "abcdef" and clip("abcdefg", 6) == "abc..." and len(clip("x" * 99, 24)) == 24


def test_tree_bench_table_fits_80_columns(tmp_path):
    r = runner.invoke(app, ["tree-bench", "--kernels", "topk,build", "--out", str(tmp_path), "--name", "tb"])
    assert r.exit_code == 0, r.output
    table = [ln for ln in r.output.splitlines() if not ln.startswith("wrote")]
    assert all(len(ln) <= 80 for ln in table), r.output
    header = next(ln for ln in table if ln.startswith("kernel"))
    assert "time_us" in header.split() and "prefix" not in header.split()  # no attention rows: left out
    rows = (tmp_path / "tb.csv").read_text().splitlines()
    assert "time_us_p80" in rows[0] and len(rows) == 1 + 2 + 2 * 2  # topk + build per stream count


def test_pack_defaults_to_tiny_on_cpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CPU default")
    r = runner.invoke(app, ["pack", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert len([ln for ln in r.output.splitlines() if ln.startswith("note:")]) == 1 and "tiny" in r.output
    (d,) = tmp_path.iterdir()
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["preset"] == "tiny" and manifest["completed"] is True and list(manifest["layers"]) == ["1"]


def _blocked(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    return blocker / "sub"


@pytest.mark.parametrize("args,message", [
    (["moe-sweep", "--hot", "0"], "--hot 0"),
    (["moe-sweep", "--hot", "99999"], "--hot 99999"),
    (["moe-sweep", "--out", "BLOCKED"], "cannot write"),
    (["moe-sweep", "--name", "../../x"], "--name"),
    (["tree-bench", "--max-attn-gflop", "-1"], "--max-attn-gflop"),
    (["tree-bench", "--name", "a/b"], "--name"),
    (["allreduce", "--backend", "gloo", "--name", "../../x"], "--name"),
    (["allreduce", "--backend", "gloo", "--out", "BLOCKED"], "cannot write"),
    (["decode", "--name", "../x"], "--name"),
    (["decode", "--preset", "k2.6"], "needs"),  # does not fit: found before any file is written
    (["e2e", "--baseline", "/nonexistent/baseline"], "--baseline"),
    (["e2e", "--name", ".hidden"], "--name"),
    (["pack", "--out", "BLOCKED"], "cannot write"),
    (["baseline", "--out", "BLOCKED", "--url", "http://127.0.0.1:9"], "cannot write"),
])
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, args, message):
    out = tmp_path / "out"
    args = [str(_blocked(tmp_path)) if a == "BLOCKED" else a for a in args]
    if "--out" not in args:
        args += ["--out", str(out)]
    t0 = time.monotonic()
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert message in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert time.monotonic() - t0 < 20
    assert not out.exists() or not any(out.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["a_file"], ["out"], ["a_file", "out"])


def test_env_json_folder_is_one_line_error(tmp_path):
    r = runner.invoke(app, ["env", "--json", str(tmp_path)])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "folder" in r.output
    assert list(tmp_path.iterdir()) == []  # no stray temporary file
    blocker = tmp_path / "f"
    blocker.write_text("")
    r = runner.invoke(app, ["env", "--json", str(blocker / "env.json")])
    assert r.exit_code == 2 and r.output.startswith("error: cannot write to --json folder")
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def test_decode_name(tmp_path):
    r = runner.invoke(app, ["decode", "--preset", "tiny", "--concurrency", "1", "--prompt-len", "4",
                            "--new-tokens", "2", "--no-graph", "--name", "mine", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "mine.csv").exists() and json.loads((tmp_path / "mine.json").read_text())["completed"]


def test_user_runs_under_results_are_ignored_by_git():
    paths = ["results/h200/decode/20990101-000000.csv", "results/allreduce_20990101-000000.csv.partial",
             "results/pack_tiny_tp1_r0_x/"]
    r = subprocess.run(["git", "check-ignore", *paths], cwd=ROOT, capture_output=True, text=True)
    if r.returncode == 128:
        pytest.skip("not a git checkout")
    assert r.stdout.split() == paths
    tracked = subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True).stdout
    assert re.search(r"^results/.+\.csv$", tracked, re.M)  # committed reference runs stay tracked


def test_main_entry_point_version():
    r = subprocess.run([sys.executable, "-m", "ddbench", "--version"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert r.returncode == 0 and __version__ in r.stdout


def test_help_paragraphs_reflow_to_the_terminal():
    """The commands' docstrings are hard-wrapped; their help must not break lines where the
    source did (rich keeps single line breaks)."""
    from ddbench.cli import reflow

    assert reflow("""One line
    and its rest.

    Second paragraph,
    wrapped.""") == "One line and its rest.\n\nSecond paragraph, wrapped."
    out = runner.invoke(app, ["moe-sweep", "--help"], env={"COLUMNS": "120"}).output
    assert "the copy bandwidth and bf16 GEMM rate measured in the same run." in " ".join(out.split())
    assert "with --tp 8), a routing per token count" in out
