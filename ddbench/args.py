"""Small parsers of command-line values shared by the CLI and the routines (no imports of either)."""
from __future__ import annotations

from ddbench import UserError


def parse_int_list(text: str, what: str) -> list[int]:
    """'1,2,4' or '1-4' -> list of ints (UserError on junk)."""
    out = []
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part[1:]:
                lo, hi = part.split("-", 1)
                out.extend(range(int(lo), int(hi) + 1))
            elif part:
                out.append(int(part))
    except ValueError:
        raise UserError(f"{what}: cannot read {text!r} as a list of integers") from None
    if not out:
        raise UserError(f"{what}: empty list")
    return out


def parse_kernels(text: str | None):
    """`--kernels` text -> `kernels.select.KernelChoice` (UserError on junk)."""
    from ddbench.kernels.select import KernelChoice, KernelChoiceError

    try:
        return KernelChoice.parse(text)
    except KernelChoiceError as e:
        raise UserError(str(e)) from None
