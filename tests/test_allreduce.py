"""`ddbench allreduce` on CPU processes with gloo: sums, nccl-tests formulas, the launcher's
failure handling, the latency + bandwidth model and the plots."""
import csv
import json
import math
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ddbench import UserError
from ddbench import allreduce as ar
from ddbench.cli import app

runner = CliRunner()

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ["size_bytes", "count", "dtype", "redop", "in_place", "time_us", "time_us_p20", "time_us_p80",
           "algbw_gbps", "busbw_gbps", "wrong", "n_ranks", "cuda_graph", "mode", "backend", "tokens"]
FAST = ["--backend", "gloo", "--reps", "2", "--warmup", "1", "--preset", "tiny"]


def read_run(out: Path):
    (side,) = out.glob("*/allreduce/*.json")
    meta = json.loads(side.read_text())
    path = side.with_suffix(".csv")
    rows = list(csv.DictReader(open(path))) if path.exists() else []
    return rows, meta, path


def invoke(out: Path, *args):
    r = runner.invoke(app, ["allreduce", *FAST, "--out", str(out), *args])
    assert r.exit_code == 0, r.output
    return read_run(out)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ar2")
    return (*invoke(out, "--gpus", "2", "--max-bytes", "4K", "--tokens", "1,2", "--model"), out)


def test_two_ranks_sum_rows_and_columns(two_ranks):
    rows, meta, path, _ = two_ranks
    assert list(rows[0]) == COLUMNS
    sweep = [r for r in rows if r["tokens"] == "0"]
    assert [int(r["size_bytes"]) for r in sweep] == [8 * 2**k for k in range(10)]  # 8 B .. 4 KiB
    tok = [r for r in rows if r["tokens"] != "0"]
    assert [(int(r["tokens"]), int(r["size_bytes"])) for r in tok] == [(1, 256 * 2), (2, 2 * 256 * 2)]
    for r in rows:
        assert r["wrong"] == "0" and r["n_ranks"] == "2" and r["mode"] == "eager"
        assert r["cuda_graph"] == "False" and r["in_place"] == "True" and r["backend"] == "gloo"
        assert int(r["count"]) * 2 == int(r["size_bytes"]) and r["dtype"] == "bf16" and r["redop"] == "sum"
        t = float(r["time_us"])
        assert float(r["time_us_p20"]) <= t <= float(r["time_us_p80"])
        assert math.isclose(float(r["algbw_gbps"]), int(r["size_bytes"]) / (t * 1e3), rel_tol=1e-9)
    assert meta["completed"] and meta["n_ranks"] == 2 and meta["rows"] == len(rows)
    assert any("graph mode skipped" in n for n in meta["notes"])
    fit = meta["model"]["measured eager"]
    assert fit["n_ranks"] == 2 and fit["lat_us"] >= 0 and set(fit["decode_step_us"]) == {"1", "16", "160"}


def test_table_fits_80_columns(tmp_path, capfd):
    """Rank 0 prints the table (a process of its own: its stdout is not a terminal, 80 columns)."""
    invoke(tmp_path, "--gpus", "1", "--min-bytes", "1M", "--max-bytes", "4M", "--reps", "1", "--warmup", "0",
           "--tokens", "1,16", "--model")
    lines = capfd.readouterr().out.splitlines()
    assert lines and all(len(ln) <= 80 for ln in lines), lines
    header = next(ln.split() for ln in lines if ln.split()[:1] == ["size"])
    assert {"time_us", "p20..p80", "busbw", "wrong"} <= set(header)
    assert any(ln.split()[:2] == ["4", "MiB"] for ln in lines)


def test_four_ranks_fp32_busbw_formula(tmp_path):
    rows, meta, _ = invoke(tmp_path, "--gpus", "4", "--dtype", "fp32", "--min-bytes", "64", "--max-bytes", "1K",
                           "--tokens", "none")
    assert [int(r["size_bytes"]) for r in rows] == [64, 128, 256, 512, 1024]
    for r in rows:
        assert r["wrong"] == "0" and r["n_ranks"] == "4" and int(r["count"]) * 4 == int(r["size_bytes"])
        assert math.isclose(float(r["busbw_gbps"]), float(r["algbw_gbps"]) * 2 * 3 / 4, rel_tol=1e-9)


def test_graph_only_on_gloo_is_skipped_with_a_note(tmp_path):
    rows, meta, path = invoke(tmp_path, "--gpus", "1", "--mode", "graph", "--tokens", "none")
    assert rows == [] and not path.exists()
    assert meta["completed"] and meta["rows"] == 0 and meta["modes"] == []
    assert any("graph mode skipped" in n for n in meta["notes"])
    assert any("1 MiB" in n for n in meta["notes"])  # the gloo default max is said out loud


@pytest.mark.parametrize("n,op", [(2, "sum"), (4, "sum"), (3, "max"), (4, "min")])
def test_checker_counts_wrong_elements(n, op):
    """The `wrong` check accepts the exact reduction and catches a bad element or a missing rank."""
    count = 1000
    vals = torch.stack([ar.known_values(count, r, torch.bfloat16, "cpu").float() for r in range(n)])
    assert len(set(vals[:, 0].tolist())) > 1  # ranks contribute different values
    red = {"sum": vals.sum(0), "max": vals.amax(0), "min": vals.amin(0)}[op].to(torch.bfloat16)
    assert ar.count_wrong(red.clone(), n, op) == 0
    bad = red.clone()
    bad[123] += 1
    assert ar.count_wrong(bad, n, op) == 1
    if op == "sum":  # one rank's contribution missing
        assert ar.count_wrong(vals[1:].sum(0).to(torch.bfloat16), n, op) > count // 2


@pytest.mark.parametrize("args,message", [
    (["--backend", "nccl", "--gpus", "64"], "GPU"),
    (["--min-bytes", "9"], "multiple of the bf16 size"),
    (["--dtype", "fp32", "--max-bytes", "6"], "multiple of the fp32 size"),
    (["--min-bytes", "1K", "--max-bytes", "8"], "larger than --max-bytes"),
    (["--max-bytes", "lots"], "byte count"),
    (["--gpus", "0"], "at least 1"),
    (["--dtype", "int8"], "choose"),
    (["--mode", "fast"], "choose"),
    (["--tokens", "0"], "positive"),
    (["--predict", "lat_us=5"], "needs lat_us and busbw_gbps"),
])
def test_bad_input_one_line_exit_2(tmp_path, args, message):
    out = tmp_path / "out"
    t0 = time.monotonic()
    r = runner.invoke(app, ["allreduce", *FAST, "--out", str(out), *args])
    assert r.exit_code == 2, r.output
    assert message in r.output and len(r.output.strip().splitlines()) == 1
    assert not out.exists() and time.monotonic() - t0 < 10


def test_torchrun_environment_runs_as_one_rank(tmp_path):
    """Under torchrun (RANK/WORLD_SIZE/MASTER_* set) the command is a rank itself."""
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(ar.free_port()), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "ddbench", "allreduce", *FAST, "--out", str(tmp_path), "--max-bytes", "32",
           "--tokens", "none"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows, meta, _ = read_run(tmp_path)
    assert [r["n_ranks"] for r in rows] == ["1"] * 3 and all(r["wrong"] == "0" for r in rows)
    assert float(rows[0]["busbw_gbps"]) == 0.0  # 2(n-1)/n = 0 for one rank
    bad = subprocess.run(cmd + ["--gpus", "2"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "WORLD_SIZE=1" in bad.stderr


def _alive(token: str) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and token in (p / "cmdline").read_text():
                pids.append(int(p.name))
        except OSError:
            pass
    return pids


@pytest.mark.parametrize("fault,message", [("crash", "rank [01] of 2 failed"), ("nojoin", "rank 0 of 2 failed.*Timed out")])
def test_launcher_stops_every_rank_when_one_fails(fault, message):
    """A rank that dies while rank 0 waits in a collective, or one that never joins the
    process group: the launcher returns promptly with a one-line error, nothing left running."""
    token = uuid.uuid4().hex
    t0 = time.monotonic()
    with pytest.raises(UserError, match=message) as e:
        ar.launch([sys.executable, "-c", FAULT_RANK, fault, token], 2, setup_timeout=3)
    assert time.monotonic() - t0 < 25
    assert "\n" not in str(e.value)
    assert _alive(token) == []


def test_model_formula_and_decode_step():
    m = ar.AllReduceModel(lat_us=10.0, busbw_gbps=300.0, n_ranks=8)
    nbytes = 160 * 7168 * 2
    assert math.isclose(m.predict_us(nbytes), 10.0 + nbytes * 1.75 / 300e3)
    assert math.isclose(m.decode_step_us(160), 2 * 61 * m.predict_us(nbytes))
    assert m.with_ranks(2).predict_us(nbytes) < m.predict_us(nbytes)  # 2(n-1)/n = 1 < 1.75
    assert ar.AllReduceModel(5.0, math.inf, 1).predict_us(2**30) == 5.0


def test_fit_recovers_parameters():
    truth = ar.AllReduceModel(lat_us=12.0, busbw_gbps=370.0, n_ranks=8)
    sizes = [8 * 4**k for k in range(14)]
    fit = ar.fit_model([(s, truth.predict_us(s)) for s in sizes], 8)
    assert math.isclose(fit.lat_us, 12.0, rel_tol=1e-6) and math.isclose(fit.busbw_gbps, 370.0, rel_tol=1e-6)
    flat = ar.fit_model([(s, 7.0) for s in sizes], 1)  # one rank: latency only
    assert math.isclose(flat.lat_us, 7.0) and math.isinf(flat.busbw_gbps)
    with pytest.raises(UserError, match="two or more sizes"):
        ar.fit_model([(8, 1.0)], 8)


def test_load_model_specs(two_ranks):
    _, _, path, _ = two_ranks
    assert ar.load_model("nvlink-h200").busbw_gbps == 370.0 and ar.load_model("pcie").n_ranks == 8
    m = ar.load_model("lat_us=3.5,busbw_gbps=40,n_ranks=4")
    assert (m.lat_us, m.busbw_gbps, m.n_ranks) == (3.5, 40.0, 4)
    fit = ar.load_model(str(path))
    assert fit.n_ranks == 2 and fit.lat_us >= 0 and callable(fit.predict_us) and fit.predict_us(1024) > 0
    for spec, message in [("nvlink", "not a preset"), ("lat_us=1,busbw=2", "unknown key"),
                          ("lat_us=x,busbw_gbps=1", "not a number"), ("lat_us=1,busbw_gbps=0", "busbw_gbps > 0")]:
        with pytest.raises(UserError, match=message):
            ar.load_model(spec)


def test_predict_prints_decode_costs():
    r = runner.invoke(app, ["allreduce", "--predict", "pcie", "--tokens", "1,16"])
    assert r.exit_code == 0, r.output
    assert "T=16" in r.output and "2 x 61 layers" in r.output


def test_report_draws_both_plots(two_ranks, tmp_path):
    from ddbench.report import run

    *_, out = two_ranks
    report = run([out], tmp_path, "png")
    assert (tmp_path / "allreduce_busbw.png").stat().st_size > 0
    assert (tmp_path / "allreduce_time.png").stat().st_size > 0
    assert "All-reduce time" in report.read_text()


@pytest.mark.gpu
def test_one_gpu_nccl_eager_and_graph(tmp_path):
    rows, meta, _ = invoke(tmp_path, "--backend", "nccl", "--gpus", "1", "--max-bytes", "1M", "--tokens", "1,16",
                           "--reps", "10")
    modes = {r["mode"] for r in rows}
    assert modes == {"eager", "graph"} and all(r["wrong"] == "0" for r in rows)
    assert all(r["cuda_graph"] == str(r["mode"] == "graph") for r in rows)
    assert meta["nccl_nvls_enable"] == "0"


# A rank for the launcher tests, run with `python -c` so it imports only torch: 'crash'
# dies after setup while rank 0 waits in an all-reduce; 'nojoin' never joins, so rank 0's
# setup times out.
FAULT_RANK = """
import datetime, os, sys, time
from pathlib import Path
import torch
import torch.distributed as dist

fault, rank = sys.argv[1], int(os.environ["RANK"])
if fault == "nojoin" and rank == 1:
    time.sleep(300)
dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                        timeout=datetime.timedelta(seconds=1))
Path(os.environ["DDBENCH_READY_DIR"], str(rank)).touch()
if rank == 1:
    raise RuntimeError("injected failure")
dist.all_reduce(torch.ones(4))
time.sleep(300)
"""
