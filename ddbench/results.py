"""Tidy CSV results with a JSON metadata sidecar (docs/DESIGN.md).

Rows are flushed as they finish to `NAME.csv.partial`, renamed to `NAME.csv` when the run
ends, on success, error, Ctrl-C or SIGTERM alike. The sidecar `NAME.json` is written when
the run starts (`completed: false`, the writer's pid) and again at the end, so a run killed
outright (kill -9, a power cut) still leaves a readable partial CSV with its sidecar:
`ddbench.runs.list_runs` lists it as incomplete, and a rerun with the same `--name` moves it aside
instead of refusing to start.
"""
from __future__ import annotations

import contextlib
import csv
import datetime as dt
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

from ddbench import UserError

PARTIAL = ".csv.partial"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=,-]{0,199}")


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file (no temporary left behind on error)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def ensure_out_dir(out: Path, what: str = "--out") -> Path:
    """Create `out` (and parents) or raise UserError (naming the option `what`) if it cannot be written."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".ddbench-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot write to {what} {out}: {e.strerror or e}") from None
    return out


def check_name(name: str | None) -> None:
    """A result name is one file name inside --out: letters, digits and ._+=,- (UserError else)."""
    if name is None:
        return
    if not NAME_RE.fullmatch(name) or ".." in name:
        raise UserError(f"--name {name!r}: use letters, digits and . _ + = , - only (at most 200, "
                        "no folders, no '..'); it names NAME.csv inside --out")


def check_output(out: Path, name: str | None = None) -> Path:
    """Every command's output check before any expensive step: --name is a plain file name,
    --out is writable, and NAME is not taken by a finished run (an interrupted one is moved
    aside). Returns the created --out folder."""
    check_name(name)
    out = ensure_out_dir(out)
    if name is not None:
        _claim(out, name)
    return out


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError, TypeError):
        return False
    return True


def _read_meta(side: Path) -> dict | None:
    try:
        return json.loads(side.read_text())
    except (OSError, ValueError):
        return None


def _running(meta: dict | None) -> bool:
    """The run that wrote this sidecar is still going (its writer process is alive here)."""
    return bool(meta) and meta.get("status") == "running" and meta.get("host") == socket.gethostname() \
        and meta.get("pid") != os.getpid() and _pid_alive(meta.get("pid"))


def _claim(out: Path, name: str) -> None:
    """Make NAME free for a new run: refuse a finished or running one; move an interrupted
    one (NAME.csv from a stopped run, or NAME.csv.partial left by a killed one) aside to
    NAME_incomplete_<time>, its rows kept and its sidecar saying what happened."""
    csv_path, partial, side = out / f"{name}.csv", out / f"{name}{PARTIAL}", out / f"{name}.json"
    meta = _read_meta(side) if side.exists() else None
    if _running(meta):
        raise UserError(f"{name} is being written by a running ddbench (pid {meta['pid']}); pick another --name")
    stale = partial if partial.exists() else None
    if csv_path.exists():
        if meta is None or meta.get("completed", True) or meta.get("csv") != csv_path.name:
            raise UserError(f"{csv_path} exists; pick another --name")
        stale = csv_path
    if stale is None:
        return
    stamp = dt.datetime.fromtimestamp(stale.stat().st_mtime).strftime("%Y%m%d-%H%M%S")
    new = f"{name}_incomplete_{stamp}"
    k = 1
    while (out / f"{new}.csv").exists() or (out / f"{new}.json").exists():
        new, k = f"{name}_incomplete_{stamp}_{k}", k + 1
    os.replace(stale, out / f"{new}.csv")
    meta = dict(meta or {})
    meta.update(completed=False, status="interrupted", csv=f"{new}.csv")
    meta.setdefault("error", "interrupted: the writing process is gone (killed)")
    atomic_write_text(out / f"{new}.json", json.dumps(meta, indent=2, default=str) + "\n")
    with contextlib.suppress(OSError):
        side.unlink()
    print(f"note: moved the interrupted run {stale.name} aside to {new}.csv", file=sys.stderr)


def git_commit(where: Path | None = None) -> str | None:
    """HEAD's short hash, with "+changes" where tracked files differ from it (a tree that ran with
    edits, or a copy whose .git is stale: `source_sha` then names what ran)."""
    cwd = where or Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5, cwd=cwd).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, timeout=10, cwd=cwd).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+changes" if changed else "")) or None


def source_sha() -> str:
    """sha1 (12 hex digits) of the source that ran: every .py / .cu / .cuh file of ddbench/, engine/
    and kernels/, by path and content. Unlike `git_commit` it holds in a copy of the tree whose
    .git is stale or absent (a snapshot sent to a GPU machine)."""
    import hashlib

    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha1()
    for pkg in ("ddbench", "engine", "kernels"):
        base = (root / pkg).resolve()
        files = [Path(d) / n for d, _, names in os.walk(base) for n in names      # symlinked folders not followed
                 if n.endswith((".py", ".cu", ".cuh"))]
        for f in sorted(files):
            h.update(f"{pkg}/{f.relative_to(base).as_posix()}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def run_metadata(kind: str, **extra) -> dict:
    """Metadata common to every run: command line, commit, time, host, versions."""
    from ddbench import telemetry

    meta = {
        "kind": kind,
        "command": " ".join(["ddbench", *sys.argv[1:]]),
        "git_commit": git_commit(),
        "source_sha": source_sha(),
        "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        **telemetry.versions(),
        **telemetry.gpu_info(),
    }
    meta.update(extra)
    return meta


def timestamp() -> str:
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S")


_STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


@contextlib.contextmanager
def _signals_held():
    """Hold Ctrl-C/SIGTERM/SIGHUP while the files are finished (main thread only)."""
    sigs = {getattr(signal, s) for s in _STOP_SIGNALS if hasattr(signal, s)}
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _stop_on_signal(signum, frame):
    # the first stop signal ends the run like Ctrl-C (files finished, sidecar says
    # incomplete); the handled signals are ignored from then on so that repeats, or a
    # launcher's SIGTERM after the terminal's Ctrl-C, cannot cut the clean-up short
    for s in _handled:
        signal.signal(s, signal.SIG_IGN)
    raise KeyboardInterrupt


_handled: list = []


def stop_on_signals(include_sigint: bool = False) -> None:
    """SIGTERM (what `timeout` and schedulers send) and SIGHUP raise KeyboardInterrupt, so
    a command finishes its files as on Ctrl-C; later ones are ignored. `include_sigint`:
    Ctrl-C too is answered once (rank processes, which their launcher kills if they hang).
    Call in a process's main thread."""
    names = ["SIGTERM", "SIGHUP"] + (["SIGINT"] if include_sigint else [])
    _handled[:] = [getattr(signal, n) for n in names if hasattr(signal, n)]
    for s in _handled:
        signal.signal(s, _stop_on_signal)


def run_location(out, kind: str, tag: str | None = None, gpu: str | None = None,
                 when: dt.datetime | None = None) -> tuple[Path, str]:
    """Where a new run of `kind` goes when the user names none: (out/<gpu>/<command>, <UTC
    stamp>[_tag]) (`ddbench.runs.run_path`); a secondary kind of a command (the baseline's
    requests) is tagged with its own last word. `gpu` defaults to this machine's first GPU."""
    from ddbench.runs import KIND_COMMAND, MAIN_KIND, run_path

    command = KIND_COMMAND[kind]
    if MAIN_KIND[command] != kind:
        tag = "_".join(t for t in (tag, kind.split("_")[-1]) if t)
    if gpu is None:
        from ddbench.telemetry import gpu_info

        gpu = gpu_info().get("gpu_name")
    loc = run_path(out, gpu, command, tag, when)
    return loc.parent, loc.name


class ResultWriter:
    """Write rows to `out/name.csv` with sidecar `out/name.json`.

    Use as a context manager. `name` defaults to `{kind}_{timestamp}`; an existing finished
    run is never overwritten unless `append=True` (then rows are added to it); an
    interrupted one is moved aside (`check_output`).
    """

    def __init__(self, out: Path, kind: str, meta: dict | None = None, name: str | None = None,
                 append: bool = False):
        self.kind = kind
        self.meta = meta if meta is not None else run_metadata(kind)
        if name is None:
            out, name = run_location(out, kind, gpu=self.meta.get("gpu_name"))
        self.name = name
        check_name(self.name)
        self.out = ensure_out_dir(out)
        self.path = self.out / f"{self.name}.csv"
        self.sidecar = self.out / f"{self.name}.json"
        self.append = append
        if not (append and self.path.exists()):
            _claim(self.out, self.name)
        self.rows: list[dict] = []
        self._file = None
        self._writer = None
        self._tmp = self.out / f"{self.name}{PARTIAL}"
        self.meta.update(completed=False, status="running", pid=os.getpid(),
                         host=self.meta.get("host") or socket.gethostname(), csv=self._tmp.name)
        atomic_write_text(self.sidecar, json.dumps(self.meta, indent=2, default=str) + "\n")
        from ddbench.telemetry import NvmlSampler

        self._nvml = NvmlSampler().__enter__()  # energy, power, temperature over the run

    def __enter__(self):
        return self

    def write(self, row: dict) -> None:
        """Append one row and flush it to disk."""
        if self._writer is None:
            if self.append and self.path.exists():
                with open(self.path, newline="") as f:
                    fields = next(csv.reader(f))
                self._file = open(self.path, "a", newline="")
                self._tmp = None
            else:
                self._file = open(self._tmp, "w", newline="")
                fields = list(row)
            self._writer = csv.DictWriter(self._file, fieldnames=fields, extrasaction="ignore")
            if self._tmp is not None:
                self._writer.writeheader()
        self._writer.writerow(row)
        self._file.flush()
        self.rows.append(row)

    def close(self, completed: bool = True, drop_empty: bool = False, **extra_meta) -> None:
        """Finish the files. `drop_empty`: a run that wrote no row leaves no sidecar either
        (bad input found late: nothing was measured)."""
        with _signals_held():
            if self._file is not None:
                self._file.close()
                if self._tmp is not None:
                    os.replace(self._tmp, self.path)
            self._nvml.__exit__(None, None, None)
            if drop_empty and not self.rows and not self.path.exists():
                with contextlib.suppress(OSError):
                    self.sidecar.unlink()
                return
            self.meta.update({f"nvml_{k}": v for k, v in self._nvml.readings.items()})
            self.meta.update(extra_meta)
            self.meta["completed"] = completed
            self.meta["status"] = "completed" if completed else "interrupted"
            self.meta["rows"] = len(self.rows)
            self.meta["finished_at"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
            self.meta["csv"] = self.path.name if self.path.exists() else None
            atomic_write_text(self.sidecar, json.dumps(self.meta, indent=2, default=str) + "\n")

    def __exit__(self, exc_type, exc, tb):
        self.close(completed=exc_type is None, drop_empty=exc_type is not None and issubclass(exc_type, UserError),
                   **({"error": f"{exc_type.__name__}: {exc}"} if exc_type else {}))
        return False


def read_results(paths) -> list[tuple[Path, dict]]:
    """Find result CSVs (files or folders, recursively) and their sidecars -> [(csv, meta)].
    Interrupted runs' `.csv.partial` files are not listed here: `ddbench.runs.list_runs`
    finds every run, those included, marked incomplete."""
    found = []
    for p in paths:
        p = Path(p)
        csvs = sorted(p.rglob("*.csv")) if p.is_dir() else [p]
        for c in csvs:
            side = c.with_suffix(".json")
            meta = _read_meta(side) if side.exists() else {}
            if meta is None:
                print(f"warning: skipping {c}: its sidecar {side.name} is not valid JSON", file=sys.stderr)
                continue
            found.append((c, meta))
    return found
