"""SASS instruction counts of a CUDA kernel's inner loops, with no GPU: compile `kernels/<file>.cu`
for sm_90 with nvcc (the toolkit's, any machine), disassemble it with cuobjdump (the one Triton
ships works) and count, per loop that issues tensor-core MMAs (HMMA), its instructions by opcode ("stage": a loop holding no other
such loop, e.g. one instantiation of moe_marlin's stage loop; "item": one that does).

Answers "how many instructions does a stage of the MoE GEMM issue, and of what kind" (the
issue-rate bound in docs/notes/moe.md: instructions x stages run / (SMs x 4 schedulers) at the
clock).

usage: python3 -m experiments.scripts.sass_loops [CSV] [NAME=VALUE ...]
  defaults: kernels/moe_marlin.cu at the K2.6 TP-8 shard, NG=2 (T > 96), W2B=2, 4 stages, 4 warps
"""
from __future__ import annotations

import collections
import csv
import glob
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFINES = {"NG": 2, "STAGES": 4, "WARPS": 4, "G": 32, "H": 7168, "I": 256, "TOPK": 8, "W2B": 2}
KERNELS = ("moe_w13", "moe_w2")
_INS = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def parse(sass: str) -> dict[str, list[tuple[int, str, str]]]:
    """cuobjdump -sass text -> {function: [(address, opcode, operands)]}."""
    out = {}
    for part in re.split(r"\n\s+Function : ", sass)[1:]:
        name, body = part.split("\n", 1)
        out[name.strip()] = [(int(m[1], 16), m[2], m[3]) for m in map(_INS.match, body.split("\n")) if m]
    return out


def mma_loops(ins: list[tuple[int, str, str]]) -> list[dict]:
    """Each backward branch whose body holds an HMMA: {start, end, instructions, hmma, ops
    (Counter of base opcodes), inner (True when it holds no other such loop)}, in address order."""
    loops = []
    for addr, op, args in ins:
        target = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        if target and int(target[1], 16) < addr:
            body = [i for i in ins if int(target[1], 16) <= i[0] <= addr]
            ops = collections.Counter(i[1].split(".")[0] for i in body)
            if ops["HMMA"]:
                loops.append({"start": int(target[1], 16), "end": addr, "instructions": len(body),
                              "hmma": ops["HMMA"], "ops": ops})
    for lp in loops:
        lp["inner"] = not any(o is not lp and lp["start"] <= o["start"] and o["end"] <= lp["end"] for o in loops)
    return sorted(loops, key=lambda lp: lp["start"])


def _tool(name: str) -> str:
    found = shutil.which(name) or next(iter(glob.glob(f"{sys.prefix}/lib/python3*/site-packages/triton/"
                                                     f"backends/nvidia/bin/{name}")), None)
    if not found:
        raise SystemExit(f"no {name} on this machine")
    return found


def sass(source: str = "moe_marlin.cu", defines: dict | None = None) -> str:
    """The disassembly of kernels/<source> for sm_90 with these -D defines."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cmd = [_tool("nvcc"), "-cubin", "-arch=sm_90", "-std=c++17", f"-I{ROOT / 'kernels'}",
               *[f"-D{k}={v}" for k, v in (defines or DEFINES).items()], str(ROOT / "kernels" / source), "-o", str(cubin)]
        subprocess.run(cmd, check=True)
        return subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], check=True, capture_output=True,
                              text=True).stdout


def main(argv: list[str]) -> None:
    path = Path(argv[0]) if argv and "=" not in argv[0] else None
    defines = {**DEFINES, **dict(a.split("=", 1) for a in argv if "=" in a)}
    funcs = parse(sass(defines=defines))
    rows = []
    for name in KERNELS:
        for lp in mma_loops(funcs[name]):
            rows.append({"kernel": name, "loop": "stage" if lp["inner"] else "item", "instructions": lp["instructions"],
                         "hmma": lp["hmma"], **{f"n_{op}": n for op, n in lp["ops"].most_common(16)},
                         "defines": " ".join(f"{k}={v}" for k, v in defines.items())})
    for r in rows:
        ops = ", ".join(f"{k[2:]} {v}" for k, v in r.items() if k.startswith("n_"))
        print(f"{r['kernel']:8s} {r['loop']:5s} {r['instructions']:5d} instructions, {r['hmma']} HMMA: {ops}")
    if path:
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
