"""SASS instruction counts of a CUDA kernel's inner loops, with no GPU: compile `kernels/<file>.cu`
for sm_90 with nvcc (the toolkit's, any machine), disassemble it with cuobjdump (the one Triton
ships works) and count, per loop that issues tensor-core MMAs (HMMA), its instructions by opcode ("stage": a loop holding no other
such loop, e.g. one instantiation of moe_marlin's stage loop; "item": one that does).

Answers "how many instructions does a stage of the MoE GEMM issue, and of what kind" (the
issue-rate bound in docs/notes/moe.md: instructions x stages run / (SMs x 4 schedulers) at the
clock).

usage: python3 -m experiments.scripts.sass_loops [CSV] [NAME=VALUE ...]
  defaults: kernels/moe_marlin.cu at the K2.6 TP-8 shard, NG=2 (T > 96), W2B=2, 4 stages, 4 warps
       python3 -m experiments.scripts.sass_loops --bound [SWEEP_CSV]
  the issue bound of moe_w13 / moe_w2 at each T of the sweep (uniform routing planned on the CPU,
  the tiles `kernels.moe_marlin.tiles_for` picks, each block's stage loop by its valid 8-token
  groups): instructions / (SMs x 4 schedulers x 1 a cycle x clock), beside the sweep's times
       python3 -m experiments.scripts.sass_loops --wide [SWEEP_CSV]
  the same for moe_wide at T = 1024-4096 as lower bounds (only the straight-line products of a full
  stage, the branch with the most HMMA, counted), and its HMMA at the bf16 GEMM rate
"""
from __future__ import annotations

import collections
import csv
import functools
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


def branch_target(op: str, args: str) -> int | None:
    """The address a BRA jumps to; None for any other instruction."""
    m = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
    return int(m[1], 16) if m else None


def mma_loops(ins: list[tuple[int, str, str]]) -> list[dict]:
    """Each backward branch whose body holds an HMMA: {start, end, instructions, hmma, ops
    (Counter of base opcodes), inner (True when it holds no other such loop)}, in address order."""
    loops = []
    for addr, op, args in ins:
        target = branch_target(op, args)
        if target is not None and target < addr:
            body = [i for i in ins if target <= i[0] <= addr]
            ops = collections.Counter(i[1].split(".")[0] for i in body)
            if ops["HMMA"]:
                loops.append({"start": target, "end": addr, "instructions": len(body),
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


SMS, SCHEDULERS, CLOCK_MHZ = 132, 4, 1980          # H200 (SXM): SMs, warp schedulers an SM, boost clock
E, H, I, TOPK = 384, DEFINES["H"], DEFINES["I"], DEFINES["TOPK"]


def stage_counts(ng: int, w2b: int, stages: int = DEFINES["STAGES"]) -> dict:
    """{kernel: ([stage-loop instructions by valid groups 1..NG], item-loop overhead)} of moe_marlin
    at these tiles. The stage loop of v valid groups is the shortest inner loop with 8 x blocks x v
    HMMA (blocks: w13 2, w2 w2b); a backward branch out of the epilogue can also look like an inner
    loop holding one stage loop's HMMA (e.g. 16 HMMA in 1619 instructions at NG 2), never shorter."""
    funcs = parse(sass(defines={**DEFINES, "NG": ng, "W2B": w2b, "STAGES": stages}))
    out = {}
    for name in KERNELS:
        loops = mma_loops(funcs[name])
        per_group = 8 * (2 if name == "moe_w13" else w2b)
        by_groups = [min(lp["instructions"] for lp in loops if lp["inner"] and lp["hmma"] == per_group * v)
                     for v in range(1, ng + 1)]
        item = max(lp["instructions"] for lp in loops)
        out[name] = (by_groups, item - sum(by_groups))
    return out


def bound(tokens: list[int], seed: int = 0) -> list[dict]:
    """The issue bound of each GEMM at each token count (see the module docstring)."""
    import torch

    from ddbench.kernels import moe_marlin as mm

    gen, rows, cache = torch.Generator().manual_seed(seed), [], {}
    per_us = SMS * SCHEDULERS * CLOCK_MHZ
    for t in tokens:
        tiles = mm.tiles_for(t, TOPK, E)
        ng, w2b, st = tiles["ng"], tiles["w2b"], tiles["stages"]
        if (ng, w2b, st) not in cache:
            cache[ng, w2b, st] = stage_counts(ng, w2b, st)
        counts = cache[ng, w2b, st]
        ids = torch.stack([torch.randperm(E, generator=gen)[:TOPK] for _ in range(t)])
        _, _, block_rows, n_blocks = mm.plan_ref(ids, E, 8 * ng)
        groups = (block_rows[: int(n_blocks)] + 7) // 8
        warps = 3 * SMS * 4                          # 3 programs of 4 warps an SM (shared memory)
        splits = tiles.get("splits") or mm.work_split(t, TOPK, E, I, H, warps)
        for name, items_per_block, stages in (("moe_w13", (I // 64) * splits, -(-(H // 32) // splits)),
                                              ("moe_w2", H // (64 * w2b), I // 32)):
            loop, overhead = counts[name]
            instr = sum(items_per_block * (stages * loop[int(g) - 1] + overhead) for g in groups)
            rows.append({"tokens": t, "kernel": name, "ng": ng, "w2b": w2b, "splits": splits if name == "moe_w13" else 1,
                         "blocks": int(n_blocks), "items": items_per_block * int(n_blocks),
                         "minstr": round(instr / 1e6, 2), "issue_bound_us": round(instr / per_us, 1)})
    return rows


def mma_blocks(ins: list[tuple[int, str, str]], lp: dict) -> list[tuple[int, int]]:
    """(instructions, HMMA) of each straight-line block of loop `lp` (split at branches and their
    targets) that holds an HMMA: e.g. one instantiation of a kernel's stage products each."""
    body = [i for i in ins if lp["start"] <= i[0] <= lp["end"]]
    targets = {branch_target(op, args) for _, op, args in body} - {None}
    blocks, cur = [], []
    for addr, op, _ in body:
        if addr in targets and cur:
            blocks.append(cur)
            cur = []
        cur.append(op)
        if op.startswith(("BRA", "EXIT")):
            blocks.append(cur)
            cur = []
    blocks.append(cur)
    return [(len(b), sum(op.startswith("HMMA") for op in b)) for b in blocks if any(op.startswith("HMMA") for op in b)]


@functools.lru_cache(maxsize=None)
def wide_sass(mt: int, stages: int, warps: int, minb: int = 1) -> dict[str, list[tuple[int, str, str]]]:
    """moe_wide.cu's functions, parsed, at these tiles and DEFINES' shape (one nvcc run a tile)."""
    shape = {k: DEFINES[k] for k in ("G", "H", "I", "TOPK")}
    return parse(sass("moe_wide.cu", {"MT": mt, "STAGES": stages, "WARPS": warps, "MINB": minb, **shape}))


def wide_bound(tokens: list[int], gemm_tflops: float = 805.0, seed: int = 0) -> list[dict]:
    """moe_wide's w13 / w2 at each T: warp-stages run (uniform routing planned on the CPU, the
    tiles `kernels.moe_wide.tiles_for` picks), the instructions and HMMA of a full stage's products,
    and the times they bound: issue (products only, so a lower bound) and HMMA (m16n8k16, 4096
    FLOP each, at `gemm_tflops`)."""
    import torch

    from ddbench.kernels import moe_marlin as mm
    from ddbench.kernels import moe_wide as mw

    gen, rows = torch.Generator().manual_seed(seed), []
    per_us = SMS * SCHEDULERS * CLOCK_MHZ
    for t in tokens:
        tiles = mw.tiles_for(t, TOPK, E, I)
        mt = tiles["mt"]
        ids = torch.stack([torch.randperm(E, generator=gen)[:TOPK] for _ in range(t)])
        n_blocks = int(mm.plan_ref(ids, E, 16 * mt)[3])
        # each launch at its own warps W: w13 items of 32 W of I columns, w2 of 64 W of H
        for name, warps, n, cols, stages in (("wide_w13", tiles["warps"], I, 32, H // 32),
                                             ("wide_w2", tiles["w2_warps"], H, 64, I // 32)):
            chunks = n // (cols * warps)
            funcs = wide_sass(mt, tiles["stages"], warps, tiles["minb"])
            lp = next(lp for lp in mma_loops(funcs[name]) if lp["inner"])
            instr, hmma = max(mma_blocks(funcs[name], lp), key=lambda b: b[1])
            warp_stages = n_blocks * chunks * stages * warps
            rows.append({"tokens": t, "kernel": name, "mt": mt, "items": n_blocks * chunks, "warp_stages": warp_stages,
                         "stage_products_instr": instr, "stage_hmma": hmma,
                         "issue_bound_us": round(warp_stages * instr / per_us, 1),
                         "hmma_bound_us": round(warp_stages * hmma * 4096 / (gemm_tflops * 1e6), 1)})
    return rows


def main(argv: list[str]) -> None:
    if argv and argv[0] in ("--bound", "--wide"):
        import pandas as pd

        sweep = pd.read_csv(argv[1]) if len(argv) > 1 else None
        tokens = sorted(sweep.tokens.unique()) if sweep is not None else [8, 16, 32, 64, 128, 256, 512, 1024, 4096]
        if argv[0] == "--wide":
            rows = wide_bound([int(t) for t in tokens if t >= 1024])
        else:
            from ddbench.kernels.moe import WIDE_MIN_PER_EXPERT                    # marlin's range: 2 .. wide's start
            rows = bound([int(t) for t in tokens if 1 < t and t * TOPK / E < WIDE_MIN_PER_EXPERT])
        if sweep is not None:
            got = sweep[sweep.cuda_graph.astype(str) == "True"].set_index(["tokens", "stage"]).time_us
            for r in rows:
                r["measured_us"] = got.get((r["tokens"], r["kernel"].split("_")[1]))
                for b in [k for k in r if k.endswith("_bound_us")]:              # issue_share, hmma_share
                    r[b[:-len("_bound_us")] + "_share"] = round(r[b] / r["measured_us"], 2) if r["measured_us"] else None
        print(pd.DataFrame(rows).to_string(index=False))
        return
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
