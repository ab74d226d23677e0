"""Stopping runs from outside: SIGTERM (what `timeout` and schedulers send) and kill -9.

Every row written stays readable (`ddbench.runs.list_runs` sees the run, marked
incomplete), a rerun with the same --name is never blocked, and no rank process outlives
its launcher. Real processes, real signals; each test takes a few seconds."""
import csv
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ddbench import UserError
from ddbench.results import ResultWriter
from ddbench.runs import list_runs

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
AR = ["allreduce", "--backend", "gloo", "--preset", "tiny", "--warmup", "1", "--tokens", "none"]


def start(args, tmp_path, tag="run"):
    log = open(tmp_path / f"{tag}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "ddbench", *args], env=ENV, cwd=tmp_path, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(pred, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def children(pid) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def alive(pid) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def n_rows(path: Path) -> int:
    try:
        return max(0, len(path.read_text().splitlines()) - 1)
    except OSError:
        return 0


def check_rerun_moves_aside(out: Path, name: str, stopped_rows: int):
    """A rerun with the same --name runs; the stopped run's rows are kept beside it."""
    r = subprocess.run([sys.executable, "-m", "ddbench", *AR, "--gpus", "1", "--reps", "2", "--max-bytes", "16",
                        "--name", name, "--out", str(out)], env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "moved the interrupted run" in r.stderr
    assert json.loads((out / f"{name}.json").read_text())["completed"] is True
    assert n_rows(out / f"{name}.csv") == 2
    (aside,) = out.glob(f"{name}_incomplete_*.csv")
    assert n_rows(aside) == stopped_rows
    meta = json.loads(aside.with_suffix(".json").read_text())
    assert meta["completed"] is False and meta["csv"] == aside.name
    runs = {r.csv.name: r for r in list_runs(out)}
    assert runs[aside.name].incomplete and not runs[f"{name}.csv"].incomplete


@pytest.mark.parametrize("sig,n", [(signal.SIGTERM, 4), (signal.SIGKILL, 2)])
def test_allreduce_ranks_stopped(tmp_path, sig, n):
    """SIGTERM: the launcher stops its ranks and rank 0 finishes its CSV (exit 130). kill -9:
    the ranks get SIGTERM from the kernel and rank 0 finishes its CSV all the same.
    (A full sweep takes ~50 s here; the signal comes after two rows.)"""
    out = tmp_path / "res"
    p = start([*AR, "--gpus", str(n), "--reps", "200", "--max-bytes", "1M", "--name", "ar", "--out", str(out)],
              tmp_path)
    try:
        wait_for(lambda: n_rows(out / "ar.csv.partial") >= 2, 120, "two rows")
        ranks = children(p.pid)
        assert len(ranks) == n
        p.send_signal(sig)
        code = p.wait(timeout=30)
        assert code == (130 if sig == signal.SIGTERM else -9), (tmp_path / "run.log").read_text()
        wait_for(lambda: not any(alive(r) for r in ranks), 20, "the ranks to exit")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert not (out / "ar.csv.partial").exists()
    rows = list(csv.DictReader(open(out / "ar.csv")))
    meta = json.loads((out / "ar.json").read_text())
    assert meta["completed"] is False and meta["rows"] == len(rows) >= 2 and meta["csv"] == "ar.csv"
    assert len(rows) < 18 and all(r["wrong"] == "0" and r["n_ranks"] == str(n) for r in rows)
    (run,) = list_runs(out)
    assert run.incomplete and run.command == "allreduce"
    check_rerun_moves_aside(out, "ar", len(rows))


WRITER = textwrap.dedent("""
    import sys, time
    from ddbench.results import ResultWriter
    w = ResultWriter(sys.argv[1], "tree_bench", name="tb")
    for i in range(3):
        w.write({"kernel": "build", "budget": 16 * (i + 1), "time_us": 1.5 * i})
    print("written", flush=True)
    time.sleep(120)
""")


def test_killed_writer_leaves_a_readable_partial_and_never_blocks_a_rerun(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "written"
        with pytest.raises(UserError, match=f"running ddbench \\(pid {p.pid}\\)"):
            ResultWriter(tmp_path, "tree_bench", name="tb")  # a live run is not touched
        p.kill()
        p.wait(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
    assert n_rows(tmp_path / "tb.csv.partial") == 3
    (run,) = list_runs(tmp_path)
    assert run.incomplete and run.command == "tree-bench" and run.meta["status"] == "running"
    with ResultWriter(tmp_path, "tree_bench", name="tb") as w:
        w.write({"kernel": "attn", "time_us": 2.0})
    (aside,) = tmp_path.glob("tb_incomplete_*.csv")
    assert [r["budget"] for r in csv.DictReader(open(aside))] == ["16", "32", "48"]
    assert json.loads(aside.with_suffix(".json").read_text())["status"] == "interrupted"
    assert n_rows(tmp_path / "tb.csv") == 1 and not list(tmp_path.glob("*.partial"))


def test_pack_sigterm_keeps_finished_layers(tmp_path):
    p = start(["pack", "--preset", "tiny", "-o", "hidden=1024", "-o", "moe_inter=512", "-o", "n_experts=32",
               "-o", "n_layers=30", "--layers", "all", "--device", "cpu", "--out", str(tmp_path / "res")], tmp_path)

    def manifest():
        found = list((tmp_path / "res").glob("pack_*/manifest.json"))
        m = json.loads(found[0].read_text()) if found else {}
        return found[0] if m.get("layers") else None
    try:
        path = wait_for(manifest, 120, "one finished layer")
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 130, (tmp_path / "run.log").read_text()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    m = json.loads(path.read_text())
    assert m["completed"] is False and "KeyboardInterrupt" in m["error"]
    done = sorted(int(k) for k in m["layers"])
    assert 1 <= len(done) < 29 and done == list(range(1, 1 + len(done)))
    files = sorted(f.name for f in path.parent.iterdir())
    assert files == sorted(["manifest.json", *(f"layer{i:02d}.marlin.safetensors" for i in done)])
    assert "stopped:" in (tmp_path / "run.log").read_text()


SLEEPER = textwrap.dedent("""
    import os, time
    from pathlib import Path

    def work(rank, tp, port, report, kw):
        Path(kw["dir"], f"rank{rank}.pid").write_text(str(os.getpid()))
        time.sleep(120)
""")


def test_spawned_ranks_die_with_their_parent(tmp_path):
    """ddbench.ranks (decode/e2e --tp N): kill -9 of the parent ends every rank."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    driver = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import sleeper; "
              f"from ddbench.ranks import run_ranks; run_ranks(sleeper.work, 2, {{'dir': {str(tmp_path)!r}}}, "
              "print, 'test')")
    p = subprocess.Popen([sys.executable, "-c", driver], env=ENV)
    pids = []
    try:
        wait_for(lambda: len(list(tmp_path.glob("rank*.pid"))) == 2, 120, "two ranks")
        pids = [int(f.read_text()) for f in tmp_path.glob("rank*.pid")]
        assert all(alive(x) for x in pids)
        p.kill()
        p.wait(timeout=10)
        wait_for(lambda: not any(alive(x) for x in pids), 20, "the ranks to exit")
    finally:
        for x in pids:
            if alive(x):
                os.kill(x, signal.SIGKILL)
