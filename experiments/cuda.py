"""The probes' CUDA sources (experiments/*.cu), compiled and launched by the product's NVRTC
loader (`ddbench.kernels.cuda.Kernel`): kernels/ stays the include path (common.cuh), and a
probe includes experiments/probe_common.cuh as `#include PROBE_COMMON`, a define that holds
its absolute path (NVRTC does not search the directory of a source given by name)."""
from __future__ import annotations

from pathlib import Path

import torch

from ddbench.kernels.cuda import Kernel

HERE = Path(__file__).resolve().parent


def kernel(source: str, name: str, defines: dict[str, int], device: torch.device, arch_suffix: str = "") -> Kernel:
    """`extern "C"` kernel `name` of experiments/`source`, compiled with `defines` for `device`
    (arch_suffix "a": sm_90a)."""
    return Kernel(str(HERE / source), name, {**defines, "PROBE_COMMON": f'"{HERE / "probe_common.cuh"}"'}, device,
                  arch_suffix)
