"""Where runs live and which run is the latest.

Layout: `results/<gpu>/<command>/<YYYYMMDD-HHMMSS>[_tag].{csv,json}`, the stamp being the
run's start in UTC and `command` the CLI command's name (`moe-sweep`, `decode`, ...).
`list_runs` finds every run under a folder, finished or not: a CSV still named
`*.csv.partial`, a CSV without a sidecar, or a sidecar saying `completed: false` is
`incomplete`. `latest_runs` picks the newest run of each command.
"""
from __future__ import annotations

import datetime as dt
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

# sidecar kind -> CLI command; the first kind listed for a command is its main one
KIND_COMMAND: dict[str, str] = {
    "moe_sweep": "moe-sweep",
    "allreduce": "allreduce",
    "tree_bench": "tree-bench",
    "decode": "decode",
    "e2e": "e2e",
    "baseline": "baseline",
    "baseline_requests": "baseline",
}
COMMANDS = tuple(dict.fromkeys(KIND_COMMAND.values()))
MAIN_KIND = {c: next(k for k, v in KIND_COMMAND.items() if v == c) for c in COMMANDS}
_STAMP = re.compile(r"(\d{8})[-_T](\d{6}|\d{4})")
# options that name or place a run rather than change what it measures
_PLACEMENT_OPTS = {"--name", "--out"}
# options a script varies over separate processes that together make one measurement
SPLIT_OPTS = {"--concurrency", "--tp", "--tokens"}


def gpu_slug(name: str | None) -> str:
    """'NVIDIA H200' -> 'h200'; no GPU -> 'cpu'."""
    if not name:
        return "cpu"
    s = re.sub(r"^nvidia\s+", "", str(name).strip(), flags=re.I).lower()
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "cpu"


def stamp(when: dt.datetime | None = None) -> str:
    when = when or dt.datetime.now(dt.timezone.utc)
    return when.astimezone(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")


def run_path(out, gpu: str | None, command: str, tag: str | None = None,
             when: dt.datetime | None = None) -> Path:
    """out/<gpu slug>/<command>/<UTC stamp>[_tag] (no suffix: the writer adds .csv/.json)."""
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}: one of {', '.join(COMMANDS)}")
    if tag is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", tag):
        raise ValueError(f"tag {tag!r}: use letters, digits, '.', '_' or '-'")
    name = stamp(when) + (f"_{tag}" if tag else "")
    return Path(out) / gpu_slug(gpu) / command / name


@dataclass
class Run:
    csv: Path                      # the CSV (or its .csv.partial while unfinished)
    meta: dict = field(repr=False)
    command: str
    kind: str
    gpu: str
    started: dt.datetime | None
    incomplete: bool

    @property
    def name(self) -> str:
        n = self.csv.name
        return n[: -len(".csv.partial")] if n.endswith(".csv.partial") else self.csv.stem

    @property
    def command_line(self) -> str:
        return self.meta.get("command") or ""

    @property
    def date(self) -> str:
        return self.started.strftime("%Y-%m-%d %H:%M UTC") if self.started else "undated"


def _started(meta: dict, path: Path) -> dt.datetime | None:
    s = meta.get("started_at")
    if s:
        try:
            t = dt.datetime.fromisoformat(str(s))
            return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)
        except ValueError:
            pass
    m = _STAMP.search(path.name)
    if m:
        hms = m.group(2).ljust(6, "0")
        return dt.datetime.strptime(m.group(1) + hms, "%Y%m%d%H%M%S").replace(tzinfo=dt.timezone.utc)
    return None


def _read_run(csv: Path) -> Run | None:
    partial = csv.name.endswith(".csv.partial")
    base = csv.with_name(csv.name[: -len(".partial")]) if partial else csv
    side = base.with_suffix(".json")
    meta: dict = {}
    if side.exists():
        try:
            meta = json.loads(side.read_text())
        except ValueError:
            meta = {}
    parts = csv.absolute().parts
    in_layout = len(parts) >= 3 and parts[-2] in COMMANDS
    kind = meta.get("kind")
    if kind not in KIND_COMMAND:
        if not in_layout:
            return None  # not a ddbench run (an experiment's CSV, say)
        kind = MAIN_KIND[parts[-2]]
    command = KIND_COMMAND[kind]
    gpu = parts[-3] if in_layout else gpu_slug(meta.get("gpu_name"))
    incomplete = partial or not meta or meta.get("completed") is False
    return Run(csv=csv, meta=meta, command=command, kind=kind, gpu=gpu,
               started=_started(meta, base), incomplete=incomplete)


def list_runs(root) -> list[Run]:
    """Every run under `root` (a folder or one CSV), oldest first; undated runs first."""
    root = Path(root)
    if root.is_file():
        files = [root]
    else:
        files = sorted([*root.rglob("*.csv"), *root.rglob("*.csv.partial")])
    runs = []
    for f in files:
        if f.name.startswith("."):
            continue  # a writer's temporary file
        if f.name.endswith(".csv") and f.with_name(f.name + ".partial").exists():
            continue  # appended to; the partial file is the run
        r = _read_run(f)
        if r is not None:
            runs.append(r)
    epoch = dt.datetime.min.replace(tzinfo=dt.timezone.utc)
    return sorted(runs, key=lambda r: (r.started or epoch, str(r.csv)))


def latest_runs(root) -> dict[str, Run]:
    """{command: its newest run of the command's main kind}."""
    latest: dict[str, Run] = {}
    for r in list_runs(root):  # oldest first, so the newest wins
        if r.kind == MAIN_KIND[r.command]:
            latest[r.command] = r
    return latest


def _measure_args(command_line: str) -> list[str]:
    """The command line without the options that only name or place the run."""
    try:
        words = shlex.split(command_line)
    except ValueError:
        words = command_line.split()
    kept, skip = [], False
    for w in words:
        if skip:
            skip = False
            continue
        opt = w.split("=", 1)[0]
        if opt in _PLACEMENT_OPTS:
            skip = "=" not in w
            continue
        kept.append(w)
    return kept


def several_cards(runs) -> bool:
    """Whether `runs` (Run objects) come from more than one GPU."""
    return len({getattr(r, "gpu", "") for r in runs}) > 1


def differing_args(runs: list[Run]) -> dict[str, str]:
    """{run name: the options where its command line differs from the others'}: a label
    that says what changed between runs (falls back to the run's name), after the run's GPU
    where the runs come from several cards."""
    if not runs:
        return {}

    def opts(r):
        words, d, i = _measure_args(r.command_line), {}, 0
        while i < len(words):
            w = words[i]
            if w.startswith("--"):
                if "=" in w:
                    k, v = w.split("=", 1)
                elif i + 1 < len(words) and not words[i + 1].startswith("--"):
                    k, v = w, words[i + 1]
                    i += 1
                else:
                    k, v = w, ""
                d[k] = v
            i += 1
        return d

    all_opts = {r.name: opts(r) for r in runs}
    keys = sorted({k for o in all_opts.values() for k in o})
    varying = [k for k in keys if len({o.get(k) for o in all_opts.values()}) > 1]
    labels = {}
    for r in runs:
        o = all_opts[r.name]
        bits = [f"{k} {o[k]}".strip() for k in varying if k in o] or [f"no {k}" for k in varying]
        labels[r.name] = " ".join(bits) if bits and len(runs) > 1 else r.name
    if len(set(labels.values())) < len(labels):  # same command lines: name the runs
        labels = {r.name: f"{r.name} ({labels[r.name]})" if labels[r.name] != r.name else r.name
                  for r in runs}
    if several_cards(runs):                               # runs of several cards: each label names its card
        labels = {r.name: f"{r.gpu}: {labels[r.name]}" for r in runs}
    return labels


def _stamp_of(name: str) -> str | None:
    """The UTC stamp a run file's name begins with (None without one)."""
    m = _STAMP.match(name)
    return m.group(0) if m else None


def session(runs: list[Run], run: Run, within_s: float = 3600) -> list[Run]:
    """`run` and the runs made with it: the same command and commit, started within
    `within_s`, whose command lines differ only in the options of SPLIT_OPTS (a script
    that runs each concurrency, or each TP degree, in its own process) or in being the same run's other kind (the
    baseline's per-request CSV), or whose file names share its UTC stamp (one script's runs,
    `<stamp>_tag`, whatever their options)."""
    def key(r):
        return [w for w in _measure_args(r.command_line)]

    def strip_split(words):
        out, skip = [], False
        for w in words:
            if skip:
                skip = False
                continue
            if w.split("=", 1)[0] in SPLIT_OPTS:
                skip = "=" not in w
                continue
            out.append(w)
        return out

    if not run.started:
        return [run]
    nearest: dict[tuple, Run] = {(run.kind, tuple(key(run))): run}  # one run per command line
    for r in runs:
        if r.csv == run.csv or r.command != run.command or not r.started:
            continue
        if abs((r.started - run.started).total_seconds()) > within_s:
            continue
        if r.meta.get("git_commit") != run.meta.get("git_commit"):
            continue
        same_run_other_kind = r.kind != run.kind and key(r) == key(run)
        split_mate = r.kind == run.kind and strip_split(key(r)) == strip_split(key(run))
        stamp_mate = r.kind == run.kind and _stamp_of(r.csv.name) is not None and _stamp_of(r.csv.name) == _stamp_of(run.csv.name)
        if not (same_run_other_kind or split_mate or stamp_mate):
            continue
        k = (r.kind, tuple(key(r)))
        if k not in nearest or abs(r.started - run.started) < abs(nearest[k].started - run.started):
            nearest[k] = r
    return sorted(nearest.values(), key=lambda r: r.started)
