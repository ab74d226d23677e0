"""y = W x for one row x, the weights loaded before the PDL wait (CUDA, `kernels/gemv.cu`).

A Triton program cannot fill shared memory before `griddepcontrol.wait` and keep it across
the wait (kernels.skinny can preload one tile, into registers). This kernel issues its first
STAGES weight tiles (up to ~100 KB a program) with cp.async, lets the next kernel launch,
then waits: with one program an SM and at most half an SM's shared memory each, the next
kernel's programs sit beside it and load their weights while it runs, so DRAM keeps
streaming across the dependency. Each program owns whole row blocks of W, so y is finished
in one launch (fp32 or bf16). Fused, as kernels.skinny does for the decode step: an RMSNorm
(+ residual) prologue, an interleaved-rope epilogue, an add of several fp32 rows.
"""
from __future__ import annotations

import functools

import torch

from ddbench.kernels.cuda import Kernel
from ddbench.kernels.device import sm_count

SHARED_BUDGET = 110 * 1024   # bytes a program: two programs (two kernels) fit on an H200 SM (228 KB)
MAX_STAGES = 8
PROGRAMS_PER_SM = 1          # grid = at most this many programs an SM
WARPS = 8                    # warps a program
DTYPES = (torch.float32, torch.bfloat16)


def config(n: int, k: int) -> dict[str, int]:
    """Compile-time shape for W [n, k]: KC columns a tile (the largest of 1024, 512, 256
    dividing k, so a warp's share of a row, KC / 8 / WARPS vectors, divides 32 lanes), ROWS so
    a tile holds 8K values, and as many ring slots as the shared budget leaves beside x."""
    if k % 256:
        raise ValueError(f"gemv needs k a multiple of 256, got {k}")
    kc = next(c for c in (1024, 512, 256) if k % c == 0)
    rows = 8192 // kc
    stages = min(MAX_STAGES, (SHARED_BUDGET - 4 * k) // (rows * kc * 2))
    if stages < 2:
        raise ValueError(f"gemv: a shared budget of {SHARED_BUDGET} bytes holds x [{k}] and {stages} tiles, not 2")
    return {"WARPS": WARPS, "ROWS": rows, "KC": kc, "STAGES": stages}


def fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """One bf16 row x (16-byte aligned), contiguous bf16 w with k a multiple of 256: what
    `gemv` takes."""
    k = w.shape[-1]
    return (x.dtype == w.dtype == torch.bfloat16 and x.numel() == x.shape[-1] == k and w.dim() == 2
            and w.is_contiguous() and k % 256 == 0 and x.data_ptr() % 16 == 0)


@functools.lru_cache(maxsize=None)
def _kernel(defines: tuple, device: torch.device) -> Kernel:
    return Kernel("gemv.cu", "gemv", dict(defines), device)


def _row(t: torch.Tensor, n: int, what: str, dtype=None) -> torch.Tensor:
    if (t.numel() != n or not t.is_contiguous() or t.data_ptr() % 16 or
            (dtype is not None and t.dtype != dtype)):
        raise ValueError(f"gemv: {what} must be {n} contiguous 16-byte-aligned values"
                         f"{f' of {dtype}' if dtype else ''}, got {tuple(t.shape)} {t.dtype}")
    return t


def gemv(w: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype | None = None, pdl: bool = False,
         norm: tuple | None = None, add: torch.Tensor | None = None, rope: tuple | None = None) -> torch.Tensor:
    """y = W x `[1, n]` for one row x `[.., k]` (fp32 or bf16), in out_dtype (default x's).

    norm = (nw, eps, res, h_out): x := h / rms(h) * nw first, h = x (+ res, if not None)
    rounded to x's dtype; h is written to h_out (if not None). add: fp32 [rows, n], its rows
    summed into y. rope = (cos, sin, head, offset): interleaved rope on columns offset.. of
    each head-wide head, cos / sin fp32 [(head - offset) / 2]. pdl: launched as a dependent
    of the kernel before (kernels.pdl's rules)."""
    n, k = w.shape
    if not (w.is_cuda and w.dtype == torch.bfloat16 and w.is_contiguous()):
        raise ValueError("gemv needs a contiguous bf16 CUDA weight")
    if x.dtype not in DTYPES:
        raise ValueError(f"gemv needs an fp32/bf16 x, got {x.dtype}")
    _row(x, k, "x")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in DTYPES:
        raise ValueError(f"gemv writes fp32 or bf16, not {out_dtype}")
    cfg = config(n, k)
    cfg |= {"X_BF16": int(x.dtype == torch.bfloat16), "Y_BF16": int(out_dtype == torch.bfloat16),
            "NORM": int(norm is not None), "ADD_ROWS": 0, "ROPE_HEAD": 0, "ROPE_OFF": 0}
    nw = res = h_out = cos = sin = None
    eps = 0.0
    if norm is not None:
        nw, eps, res, h_out = norm
        _row(nw, k, "the norm weight", x.dtype)
        res is None or _row(res, k, "the residual", x.dtype)
        h_out is None or _row(h_out, k, "h_out", x.dtype)
    if add is not None:
        cfg["ADD_ROWS"] = _row(add, add.numel(), "add", torch.float32).numel() // n
        if add.numel() != cfg["ADD_ROWS"] * n:
            raise ValueError(f"gemv: add must hold whole rows of {n}, got {tuple(add.shape)}")
    if rope is not None:
        cos, sin, head, off = rope
        if n % head or head % 2 or off % 2:
            raise ValueError(f"gemv: rope heads of {head} (offset {off}) do not tile {n} rows in pairs")
        _row(cos, (head - off) // 2, "cos", torch.float32)
        _row(sin, (head - off) // 2, "sin", torch.float32)
        cfg |= {"ROPE_HEAD": head, "ROPE_OFF": off}
    rows = cfg["ROWS"]
    out = torch.empty(1, n, device=w.device, dtype=out_dtype)
    shared = cfg["STAGES"] * rows * cfg["KC"] * 2 + 4 * k
    _kernel(tuple(sorted(cfg.items())), w.device)(
        min(-(-n // rows), PROGRAMS_PER_SM * sm_count(w.device)), 32 * cfg["WARPS"], shared,
        [w, x, out, n, k, int(pdl), res, nw, h_out, float(eps), add, cos, sin], pdl=pdl)
    return out


def reference(w: torch.Tensor, x: torch.Tensor, norm: tuple | None = None, add: torch.Tensor | None = None,
              rope: tuple | None = None) -> torch.Tensor:
    """The torch result of `gemv` in fp32 `[1, n]` (h_out, if any, written as gemv does)."""
    xf = x.reshape(1, -1).float()
    rstd = 1.0
    if norm is not None:
        nw, eps, res, h_out = norm
        h = (xf + res.reshape(1, -1).float()).to(x.dtype).float() if res is not None else xf
        if h_out is not None:
            h_out.copy_(h.view_as(h_out))
        rstd = torch.rsqrt(h.pow(2).mean() + eps)
        xf = h * nw.float()
    y = (xf @ w.float().T) * rstd                                               # [1, n]
    if rope is not None:
        cos, sin, head, off = rope
        y = y.view(-1, head).clone()                                            # [heads, head]
        pairs = y[:, off:].unflatten(-1, ((head - off) // 2, 2))                # [heads, R/2, 2] (a view)
        a, b = pairs[..., 0].clone(), pairs[..., 1].clone()
        pairs[..., 0], pairs[..., 1] = a * cos - b * sin, b * cos + a * sin
        y = y.view(1, -1)
    if add is not None:
        y = y + add.reshape(-1, y.shape[1]).float().sum(0)
    return y
