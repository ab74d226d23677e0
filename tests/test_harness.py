"""Results writing and host timing."""
import json

import pytest

from ddbench import UserError
from ddbench.results import ResultWriter, read_results
from ddbench.timing import bench, summarize


def test_result_writer_flushes_rows_and_sidecar(tmp_path):
    with ResultWriter(tmp_path, "demo", name="r1") as w:
        w.write({"tokens": 1, "time_us": 2.5})
        assert (tmp_path / "r1.csv.partial").read_text().count("\n") == 2  # header + row on disk already
        w.write({"tokens": 2, "time_us": 3.5})
    assert (tmp_path / "r1.csv").read_text().splitlines() == ["tokens,time_us", "1,2.5", "2,3.5"]
    meta = json.loads((tmp_path / "r1.json").read_text())
    assert meta["kind"] == "demo" and meta["completed"] is True and meta["rows"] == 2
    assert "command" in meta and "started_at" in meta
    [(path, m)] = read_results([tmp_path])
    assert path.name == "r1.csv" and m["kind"] == "demo"
    with pytest.raises(UserError, match="exists"):
        ResultWriter(tmp_path, "demo", name="r1")


def test_result_writer_keeps_rows_on_interrupt(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with ResultWriter(tmp_path, "demo", name="r2") as w:
            w.write({"a": 1})
            raise KeyboardInterrupt
    assert (tmp_path / "r2.csv").read_text().splitlines() == ["a", "1"]
    meta = json.loads((tmp_path / "r2.json").read_text())
    assert meta["completed"] is False and "KeyboardInterrupt" in meta["error"]


def test_append_adds_to_existing(tmp_path):
    with ResultWriter(tmp_path, "demo", name="r3") as w:
        w.write({"a": 1, "b": 2})
    with ResultWriter(tmp_path, "demo", name="r3", append=True) as w:
        w.write({"b": 4, "a": 3})
    assert (tmp_path / "r3.csv").read_text().splitlines() == ["a,b", "1,2", "3,4"]


def test_summarize_quantiles():
    s = summarize([float(x) for x in range(1, 101)])
    assert s.median_us == 50.5
    assert s.p20_us == pytest.approx(20.8) and s.p80_us == pytest.approx(80.2)


def test_cpu_bench_counts_calls():
    calls = []
    st = bench(lambda: calls.append(1), warmup=2, reps=5)
    assert len(calls) == 7 and st.n == 5 and st.median_us >= 0


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "", "x" * 201, "a\nb", "a..b"])
def test_bad_names_refused_before_any_file(tmp_path, name):
    from ddbench.results import check_output

    with pytest.raises(UserError, match="--name"):
        check_output(tmp_path / "out", name)
    with pytest.raises(UserError, match="--name"):
        ResultWriter(tmp_path / "out", "demo", name=name)
    assert not (tmp_path / "out").exists()


def test_sidecar_exists_from_the_start(tmp_path):
    w = ResultWriter(tmp_path, "demo", name="s1")
    meta = json.loads((tmp_path / "s1.json").read_text())
    assert meta["completed"] is False and meta["status"] == "running" and meta["csv"] == "s1.csv.partial"
    w.write({"a": 1})
    w.close()
    meta = json.loads((tmp_path / "s1.json").read_text())
    assert meta["completed"] is True and meta["status"] == "completed" and meta["csv"] == "s1.csv"


def test_user_error_with_no_rows_leaves_no_files(tmp_path):
    with pytest.raises(UserError):
        with ResultWriter(tmp_path, "demo", name="e1"):
            raise UserError("found late")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError):  # a crash is recorded; its sidecar names no CSV
        with ResultWriter(tmp_path, "demo", name="e2"):
            raise RuntimeError("boom")
    meta = json.loads((tmp_path / "e2.json").read_text())
    assert meta["csv"] is None and "boom" in meta["error"] and [p.name for p in tmp_path.iterdir()] == ["e2.json"]


def test_stopped_run_moved_aside_finished_run_refused(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with ResultWriter(tmp_path, "demo", name="k") as w:
            w.write({"a": 7})
            raise KeyboardInterrupt
    with ResultWriter(tmp_path, "demo", name="k") as w:  # the stopped run is not in the way
        w.write({"a": 8})
    (aside,) = tmp_path.glob("k_incomplete_*.csv")
    assert aside.read_text().splitlines() == ["a", "7"]
    with pytest.raises(UserError, match="exists"):
        ResultWriter(tmp_path, "demo", name="k")


def test_atomic_write_leaves_no_temporary_on_error(tmp_path):
    from ddbench.results import atomic_write_text

    (tmp_path / "d").mkdir()
    with pytest.raises(OSError):
        atomic_write_text(tmp_path / "d", "x")  # a folder cannot be replaced by a file
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_source_sha_names_the_source_that_ran(tmp_path):
    """The sidecar's source_sha follows the content of ddbench/, engine/, kernels/ (a copy of the
    tree with the same files gives the same digest; one changed byte changes it)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from ddbench.results import run_metadata, source_sha

    root = Path(__file__).resolve().parents[1]
    assert run_metadata("demo")["source_sha"] == source_sha() and len(source_sha()) == 12
    copy = tmp_path / "tree"
    for pkg in ("ddbench", "engine", "kernels"):
        shutil.copytree(root / pkg, copy / pkg, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "profiles"))
    code = "from ddbench.results import source_sha; print(source_sha())"

    def sha():
        return subprocess.run([sys.executable, "-c", code], cwd=copy, capture_output=True, text=True,
                              env={"PYTHONPATH": str(copy)}).stdout.strip()
    assert sha() == source_sha()
    f = copy / "kernels" / "moe_marlin.cu"
    f.write_text(f.read_text() + "\n")
    assert sha() != source_sha()


def test_git_commit_says_when_tracked_files_differ_from_head(tmp_path):
    """git_commit is HEAD's hash, with "+changes" once a tracked file is edited (a stale .git
    beside a newer tree must not pass for the commit that ran)."""
    import subprocess

    from ddbench.results import git_commit

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-qm", "one")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / "untracked.txt").write_text("not part of the tree\n")
    assert git_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == head + "+changes"
