"""Which kernels run: one explicit, frozen choice, handed to the model (never module state).

`KernelChoice` names every kernel decision of the decode step that used to hide in
environment variables and module switches. The engine commands build it from their
`--kernels` option (`KernelChoice.parse("moe=auto,attn=cluster,pdl=on")`); `ddbench env`
prints what it resolves to on this machine, and every engine sidecar records it, resolved,
with the tile tables in force (`record`). Fields (default first):

- `moe`: the routed experts' kernel, one of `kernels.moe.KERNELS` (passed to
  `fused_moe(kernel=...)`; `auto` resolves per call from the token count,
  `kernels.moe.resolve_moe_kernel`).
- `attn`: MLA decode attention. `auto`: the one-launch cluster kernel (`kernels.mla_decode`)
  for calls of at most `mla_decode.MAX_STREAMS` streams, the split kernels
  (`kernels.mla_attn`: split, merge) otherwise; `cluster`: the cluster kernel for every call
  it takes (any stream count); `split`: never the cluster kernel.
- `pdl`: programmatic dependent launch (`kernels.pdl`): `on` (wait, then let the next
  kernel launch), `wait` (wait only), `off`.
- `route`: `fused` (the router's top-k in the gate GEMM's last program) or `separate`
  (its own launch).
- `gemv`: the one-row GEMM calls that run the CUDA kernel `kernels.gemv` (weights loaded
  before the PDL wait), `+`-joined names of `GEMV_CALLS` or `none`; default `rope`.
- `skinny`: the most rows a dense GEMM takes the Triton few-row path (`kernels.skinny`,
  norms and epilogues fused) with; 0 turns it off (cuBLAS and separate kernels).
- `stream`: `on`: the shared expert's gate/up GEMM runs on a second CUDA stream beside the
  routed experts (skinny path); `off`.

Every default is what the decode step measured fastest on the H200 (docs/notes/decode.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

# the one-row GEMM calls that may run kernels.gemv: "linear" (a plain GEMM: wo, the dense
# w2), "head" (the lm_head), "add" (with an add of fp32 rows: the shared expert's w2),
# "rope" (with the rope epilogue: wq_b), "norm" (with the RMSNorm prologue: wqkv_a). In the
# c=1 decode step on the H200 "rope" took 57-63 us off in four runs; each of the others was
# slower or even (docs/notes/decode.md, sessions 11-12)
GEMV_CALLS = ("linear", "head", "add", "rope", "norm")
ATTN = ("auto", "cluster", "split")
PDL = ("on", "wait", "off")
ROUTE = ("fused", "separate")
ONOFF = ("on", "off")
MAX_SKINNY_ROWS = 16


class KernelChoiceError(ValueError):
    """A `--kernels` text or field value that names no choice."""


@dataclass(frozen=True)
class KernelChoice:
    moe: str = "auto"
    attn: str = "auto"
    pdl: str = "on"
    route: str = "fused"
    gemv: frozenset = frozenset({"rope"})
    skinny: int = 4
    stream: str = "on"

    def __post_init__(self):
        gemv = frozenset(self.gemv)
        object.__setattr__(self, "gemv", gemv)
        from ddbench.kernels.moe import KERNELS as MOE

        for name, allowed in (("moe", MOE), ("attn", ATTN), ("pdl", PDL), ("route", ROUTE), ("stream", ONOFF)):
            if getattr(self, name) not in allowed:
                raise KernelChoiceError(f"kernel choice {name}={getattr(self, name)!r}: choose {'|'.join(allowed)}")
        bad = sorted(gemv - set(GEMV_CALLS))
        if bad:
            raise KernelChoiceError(f"kernel choice gemv: unknown call(s) {', '.join(bad)}; "
                                    f"use none or +-joined {'|'.join(GEMV_CALLS)}")
        if not (isinstance(self.skinny, int) and 0 <= self.skinny <= MAX_SKINNY_ROWS):
            raise KernelChoiceError(f"kernel choice skinny={self.skinny!r}: rows 0..{MAX_SKINNY_ROWS} (0: off)")

    @classmethod
    def parse(cls, text: str | None) -> "KernelChoice":
        """'moe=auto,attn=cluster,pdl=on,gemv=rope+add,skinny=4' (any subset; '' or 'default':
        every default) -> KernelChoice; KernelChoiceError on anything else."""
        text = (text or "").strip()
        if text in ("", "default"):
            return cls()
        fields: dict = {}
        names = {f.name for f in dataclasses.fields(cls)}
        for item in text.split(","):
            key, eq, value = (s.strip() for s in item.partition("="))
            if not eq or key not in names:
                raise KernelChoiceError(f"--kernels {text!r}: {item.strip()!r} is not FIELD=VALUE with FIELD "
                                        f"one of {', '.join(sorted(names))}")
            if key in fields:
                raise KernelChoiceError(f"--kernels {text!r}: {key} given twice")
            if key == "gemv":
                fields[key] = frozenset() if value == "none" else frozenset(v for v in value.split("+") if v)
            elif key == "skinny":
                try:
                    fields[key] = int(value)
                except ValueError:
                    raise KernelChoiceError(f"--kernels {text!r}: skinny={value!r} is not a row count") from None
            else:
                fields[key] = value
        return cls(**fields)

    def __str__(self) -> str:
        """The `--kernels` text of this choice (every field)."""
        gemv = "+".join(c for c in GEMV_CALLS if c in self.gemv) or "none"
        return (f"moe={self.moe},attn={self.attn},pdl={self.pdl},route={self.route},gemv={gemv},"
                f"skinny={self.skinny},stream={self.stream}")

    @property
    def pdl_mode(self) -> int:
        """The `kernels.pdl` mode asked for (a launch on a GPU without PDL runs mode 0)."""
        return {"off": 0, "wait": 1, "on": 2}[self.pdl]

    @property
    def fuse_route(self) -> bool:
        return self.route == "fused"

    @property
    def side_stream(self) -> bool:
        return self.stream == "on"

    def attn_streams(self) -> int | None:
        """The most streams a call may have to run the one-launch cluster attention (0: never,
        None: any number)."""
        from ddbench.kernels import mla_decode

        return {"auto": mla_decode.MAX_STREAMS, "cluster": None, "split": 0}[self.attn]


def _hopper(device: torch.device) -> bool:
    from ddbench.kernels import pdl

    return device.type == "cuda" and pdl.hopper(torch.empty(0, device=device))


def resolve(choice: KernelChoice, device) -> dict:
    """What `choice` runs on `device`: each field as asked and as it takes effect there
    (kernels that need a GPU, or Hopper, fall back to what runs instead)."""
    device = torch.device(device)
    cuda, hopper = device.type == "cuda", _hopper(torch.device(device))
    pdl = choice.pdl if hopper else "off"
    skinny = choice.skinny if cuda else 0
    gemv = sorted(c for c in choice.gemv if hopper and pdl != "off")
    attn_streams = choice.attn_streams() if hopper else 0
    attn = ("cluster" if attn_streams is None else "split" if not attn_streams
            else f"cluster up to {attn_streams} stream(s), split beyond")
    return {
        "requested": str(choice),
        "device": str(device),
        "moe": choice.moe,
        "attn": attn,
        "pdl": pdl,
        "route": choice.route if skinny else "separate",
        "gemv": "+".join(gemv) or "none",
        "skinny_rows": skinny,
        "stream": choice.stream if cuda and skinny else "off",
        "tiles": tile_tables(device),
    }


def tile_tables(device) -> dict:
    """The launch-shape tables in force: the few-row GEMM's (`kernels.skinny`), the CUDA
    GEMV's (`kernels.gemv`), the split and cluster attention's (the MoE kernel's tiles
    depend on the call's shape: the engine records them per concurrency)."""
    from ddbench.kernels import device as dev
    from ddbench.kernels import gemv, mla_attn, mla_decode, skinny

    return {
        "skinny": {"programs_per_sm": skinny.PROGRAMS_PER_SM, "tile_values": skinny.TILE_VALUES,
                   "num_warps": skinny.NUM_WARPS, "num_stages": skinny.NUM_STAGES, "preload": skinny.PRELOAD,
                   "max_n_over_k": skinny.MAX_N_OVER_K},
        "gemv": {"shared_budget": gemv.SHARED_BUDGET, "max_stages": gemv.MAX_STAGES,
                 "programs_per_sm": gemv.PROGRAMS_PER_SM, "warps": gemv.WARPS},
        "mla_attn": {"max_chunks": mla_attn.MAX_CHUNKS, "min_chunk": mla_attn.MIN_CHUNK,
                     "decode_waves": mla_attn.DECODE_WAVES,
                     "decode_tile": [mla_attn.DECODE_BLOCK_N, mla_attn.DECODE_WARPS, mla_attn.DECODE_STAGES],
                     "fuse_proj": mla_attn.FUSE_PROJ, "proj_block_v": mla_attn.PROJ_BLOCK_V},
        "mla_decode": {"cluster": mla_decode.CLUSTER, "threads": mla_decode.THREADS,
                       "max_positions": mla_decode.MAX_POSITIONS},
        "sm_count": dev.sm_count(torch.device(device)),
    }
