"""The probes' CUDA sources (experiments/*.cu), compiled and launched by the product's NVRTC
loader (`ddbench.kernels.cuda.Kernel`): kernels/ stays the include path (common.cuh), and a
probe includes experiments/probe_common.cuh as `#include PROBE_COMMON`, a define that holds
its absolute path (NVRTC does not search the directory of a source given by name)."""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ddbench.kernels import cuda
from ddbench.kernels.cuda import Kernel

HERE = Path(__file__).resolve().parent


def kernel(source: str, name: str, defines: dict[str, int], device: torch.device, arch_suffix: str = "") -> Kernel:
    """`extern "C"` kernel `name` of experiments/`source`, compiled with `defines` for `device`
    (arch_suffix "a": sm_90a)."""
    return Kernel(str(HERE / source), name, {**defines, "PROBE_COMMON": f'"{HERE / "probe_common.cuh"}"'}, device,
                  arch_suffix)


def resources(k: Kernel) -> dict:
    """What the loaded kernel uses a thread: registers and local memory bytes (spills), from the
    driver (cuFuncGetAttribute NUM_REGS, LOCAL_SIZE_BYTES): the device's own compile, which may
    differ from a local nvcc's."""
    out = {}
    for name, attr in (("registers", 4), ("local_bytes", 3)):
        v = ctypes.c_int()
        cuda._check(cuda._driver().cuFuncGetAttribute(ctypes.byref(v), attr, k.fn), k.name)
        out[name] = v.value
    return out
