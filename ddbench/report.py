"""`ddbench report`: find result CSVs, draw the plots each routine knows, write report.md.

Each result kind (the sidecar's `kind`) maps to a routine module with a function
`plot(results, out, fmt) -> list[(title, path)]`, where `results` maps every kind found
to its list of `(DataFrame, metadata)`; a plotter may draw several kinds together (the
engine beside the SGLang baseline, say).
"""
from __future__ import annotations

import importlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from ddbench import UserError  # noqa: E402
from ddbench.results import atomic_write_text, ensure_out_dir, read_results  # noqa: E402

# kind -> module that defines plot(); routines register here
PLOTTERS: dict[str, str] = {
    "moe_sweep": "ddbench.moe_sweep",
    "allreduce": "ddbench.allreduce",
    "tree_bench": "ddbench.tree_bench",
    "baseline": "ddbench.baseline",
    "baseline_requests": "ddbench.baseline",
    "decode": "ddbench.decode",
    "e2e": "ddbench.e2e",
}


def load(paths) -> dict[str, list]:
    import pandas as pd

    results: dict[str, list] = {}
    for csv_path, meta in read_results(paths):
        kind = meta.get("kind")
        if not kind:
            continue
        try:
            df = pd.read_csv(csv_path)
        except (ValueError, OSError):
            continue  # empty or unreadable CSV: nothing to draw
        meta = {**meta, "_path": str(csv_path)}
        results.setdefault(kind, []).append((df, meta))
    return results


def run(paths, out: Path, fmt: str = "png") -> Path:
    if fmt not in ("png", "svg"):
        raise UserError(f"--format {fmt!r}: choose png or svg")
    missing = [str(p) for p in paths if not Path(p).exists()]
    if missing:
        raise UserError(f"no such file or folder: {', '.join(missing)}")
    out = ensure_out_dir(out)
    results = load(paths)
    lines = ["# ddbench report", ""]
    if not results:
        lines.append("No result CSVs with a ddbench sidecar were found.")
    for kind, runs in sorted(results.items()):
        lines.append(f"- {kind}: {len(runs)} run(s): " + ", ".join(Path(m['_path']).name for _, m in runs))
    lines.append("")
    drawn = set()
    for kind in sorted(results):
        module = PLOTTERS.get(kind)
        if module is None or module in drawn:
            continue
        drawn.add(module)
        plot = getattr(importlib.import_module(module), "plot", None)
        try:
            drawn_plots = plot(results, out, fmt) if plot else []
        except (KeyError, ValueError, TypeError) as e:  # a CSV without the columns its kind needs
            print(f"warning: could not draw {kind} plots: {type(e).__name__}: {e}")
            continue
        for title, path in drawn_plots:
            lines += [f"## {title}", "", f"![{title}]({Path(path).name})", ""]
    report = out / "report.md"
    atomic_write_text(report, "\n".join(lines) + "\n")
    print(f"wrote {report}")
    return report


def save(fig, out: Path, name: str, fmt: str) -> Path:
    """Save a matplotlib figure atomically as out/name.fmt and close it."""
    import matplotlib.pyplot as plt

    path = Path(out) / f"{name}.{fmt}"
    tmp = path.with_name(f".{path.name}.partial.{fmt}")
    fig.tight_layout()
    fig.savefig(tmp, dpi=150)
    plt.close(fig)
    tmp.replace(path)
    return path
