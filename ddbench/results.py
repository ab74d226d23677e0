"""Tidy CSV results with a JSON metadata sidecar (DESIGN §7).

Rows are flushed as they finish; the CSV is written under a `.partial` name and renamed
when the run ends, on success, error or Ctrl-C alike, so nothing already measured is lost.
The sidecar is written atomically and says whether the run completed.
"""
from __future__ import annotations

import csv
import datetime as dt
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

from ddbench import UserError


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def ensure_out_dir(out: Path) -> Path:
    """Create `out` (and parents) or raise UserError if it cannot be written."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".ddbench-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot write to --out {out}: {e.strerror or e}") from None
    return out


def git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=5, cwd=Path(__file__).resolve().parent)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_metadata(kind: str, **extra) -> dict:
    """Metadata common to every run: command line, commit, time, host, versions."""
    from ddbench import telemetry

    meta = {
        "kind": kind,
        "command": " ".join(["ddbench", *sys.argv[1:]]),
        "git_commit": git_commit(),
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


class ResultWriter:
    """Write rows to `out/name.csv` with sidecar `out/name.json`.

    Use as a context manager. `name` defaults to `{kind}_{timestamp}`; an existing file is
    never overwritten unless `append=True` (then rows are added to it).
    """

    def __init__(self, out: Path, kind: str, meta: dict | None = None, name: str | None = None,
                 append: bool = False):
        self.out = ensure_out_dir(out)
        self.kind = kind
        self.name = name or f"{kind}_{timestamp()}"
        self.path = self.out / f"{self.name}.csv"
        self.sidecar = self.out / f"{self.name}.json"
        self.append = append
        if self.path.exists() and not append:
            raise UserError(f"{self.path} exists; pick another --name")
        self.meta = meta if meta is not None else run_metadata(kind)
        self.rows: list[dict] = []
        self._file = None
        self._writer = None
        self._tmp = self.out / f"{self.name}.csv.partial"
        if self._tmp.exists():
            raise UserError(f"{self._tmp} is left from an interrupted run; rename or remove it")
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

    def close(self, completed: bool = True, **extra_meta) -> None:
        if self._file is not None:
            self._file.close()
            if self._tmp is not None:
                os.replace(self._tmp, self.path)
        self._nvml.__exit__(None, None, None)
        self.meta.update({f"nvml_{k}": v for k, v in self._nvml.readings.items()})
        self.meta.update(extra_meta)
        self.meta["completed"] = completed
        self.meta["rows"] = len(self.rows)
        self.meta["finished_at"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        self.meta["csv"] = self.path.name
        atomic_write_text(self.sidecar, json.dumps(self.meta, indent=2, default=str) + "\n")

    def __exit__(self, exc_type, exc, tb):
        self.close(completed=exc_type is None,
                   **({"error": f"{exc_type.__name__}: {exc}"} if exc_type else {}))
        return False


def read_results(paths) -> list[tuple[Path, dict]]:
    """Find result CSVs (files or folders, recursively) and their sidecars -> [(csv, meta)]."""
    found = []
    for p in paths:
        p = Path(p)
        csvs = sorted(p.rglob("*.csv")) if p.is_dir() else [p]
        for c in csvs:
            side = c.with_suffix(".json")
            try:
                meta = json.loads(side.read_text()) if side.exists() else {}
            except ValueError:
                print(f"warning: skipping {c}: its sidecar {side.name} is not valid JSON")
                continue
            found.append((c, meta))
    return found
