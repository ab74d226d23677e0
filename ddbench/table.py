"""One table printer for every command's final table: it fits the terminal.

Columns are picked by width: the key columns always show (the measured number among
them), the others are added in their order while they fit, and a last line says how many
were left out and where they are (the CSV always holds every column). When even the key
columns are wider than the terminal, each row is printed as `column: value` lines
instead, so nothing is cut off. Text is plain (no colour, no box), so logs read the same.
"""
from __future__ import annotations

import math
import textwrap
from typing import Callable, Sequence

GAP = "  "


def fmt_value(v) -> str:
    """Compact text for a cell: floats to about 3-4 significant digits, None/NaN as '-'."""
    if v is None or v == "":
        return "-"
    if isinstance(v, bool):
        return "y" if v else "n"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        a = abs(v)
        if a >= 1000 or a == 0:
            return f"{v:.0f}"
        return f"{v:.4g}" if a >= 1 else f"{v:.3g}"
    return str(v)


def clip(text: str, width: int) -> str:
    """`text` cut to at most `width` characters, ending in '...' where it was cut."""
    return text if len(text) <= width else text[:max(0, width - 3)] + "..."


def _right(cells: list[str]) -> bool:
    """Numbers ('12.5', '1 GiB', '3.0..4.1', '-') align right; words align left."""
    return all(c[:1].isdigit() or c[:1] in "-+." for c in cells)


def render(rows: Sequence[dict], columns: Sequence[str] | None = None, *, key: Sequence[str] = (),
           width: int = 80, title: str | None = None, where: str = "the CSV",
           formats: dict[str, Callable] | None = None) -> tuple[list[str], list[str]]:
    """Lay out `rows` (dicts) in at most `width` characters -> (lines, shown columns).

    `columns`: display order (default: the first row's keys). `key`: columns that always
    show; columns empty in every row are left out. `formats`: column ->
    function(value) -> str (default `fmt_value`). `where` names the file that holds the
    left-out columns."""
    columns = list(columns if columns is not None else (rows[0] if rows else []))
    missing = [k for k in key if k not in columns]
    if missing:
        raise ValueError(f"key columns {missing} are not among the columns {columns}")
    formats = formats or {}
    cells = {c: [formats.get(c, fmt_value)(r.get(c)) for r in rows] for c in columns}
    if rows:  # a column empty in every row says nothing
        columns = [c for c in columns if any(x != "-" for x in cells[c])]
    widths = {c: max([len(c), *(len(x) for x in cells[c])]) for c in columns}
    lines = textwrap.wrap(title, width) if title else []
    chosen = [c for c in columns if c in key]
    used = sum(widths[c] for c in chosen) + len(GAP) * max(0, len(chosen) - 1)
    if chosen and used > width:  # fold: one `column: value` line per cell
        name_w = max(len(c) for c in columns)
        for i, _ in enumerate(rows):
            lines.append("-" * min(width, 40))
            lines.extend(f"{c:>{name_w}}: {cells[c][i]}" for c in columns)
        return lines, list(columns)
    for c in columns:
        if c in chosen:
            continue
        extra = widths[c] + (len(GAP) if chosen else 0)
        if used + extra <= width:
            chosen.append(c)
            used += extra
    shown = [c for c in columns if c in chosen]
    right = {c: _right(cells[c]) for c in shown}

    def line(values: dict) -> str:
        return GAP.join(values[c].rjust(widths[c]) if right[c] else values[c].ljust(widths[c])
                        for c in shown).rstrip()
    lines.append(line({c: c for c in shown}))
    lines.append(GAP.join("-" * widths[c] for c in shown))
    lines.extend(line({c: cells[c][i] for c in shown}) for i in range(len(rows)))
    left_out = [c for c in columns if c not in chosen]
    if left_out:
        note = f"{len(left_out)} more column{'s' if len(left_out) > 1 else ''} in {where}: " + ", ".join(left_out)
        lines.append(note if len(note) <= width else note[:max(0, width - 3)].rstrip(", ") + "...")
    return lines, shown


def print_table(rows: Sequence[dict], columns: Sequence[str] | None = None, *, key: Sequence[str] = (),
                title: str | None = None, console=None, where: str = "the CSV",
                formats: dict[str, Callable] | None = None) -> list[str]:
    """Print `rows` fitted to the terminal (rich console width; COLUMNS is honoured) and
    return the columns shown. See `render`."""
    from rich.console import Console

    console = console or Console()
    lines, shown = render(rows, columns, key=key, width=console.width, title=title, where=where,
                          formats=formats)
    for ln in lines:
        console.print(ln, markup=False, highlight=False, soft_wrap=True)
    return shown
