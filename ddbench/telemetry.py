"""Versions, GPU facts and NVML readings (energy, power, temperature, clocks)."""
from __future__ import annotations

import contextlib
import importlib


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except Exception:  # noqa: BLE001 - a missing or broken package is reported as None
        return None


def versions() -> dict:
    out = {"torch": _version("torch"), "triton": _version("triton"), "cuda": None, "nccl": None}
    try:
        import torch

        out["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001
        pass
    return out


def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - no driver, no library: no GPU telemetry
        return None


def gpu_info() -> dict:
    """GPU name/count/driver/memory/clocks/links; `gpu_count: 0` when there is no GPU."""
    nv = _nvml()
    if nv is None:
        return {"gpu_count": 0, "gpu_name": None, "driver": None}
    n = nv.nvmlDeviceGetCount()
    info = {"gpu_count": n, "driver": nv.nvmlSystemGetDriverVersion(), "gpus": []}
    for i in range(n):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        g = {"index": i, "name": nv.nvmlDeviceGetName(h),
             "memory_gib": round(nv.nvmlDeviceGetMemoryInfo(h).total / 2**30, 1)}
        with contextlib.suppress(Exception):
            g["sm_clock_mhz"] = nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
            g["mem_clock_mhz"] = nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)
            g["max_sm_clock_mhz"] = nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)
        with contextlib.suppress(Exception):
            g["power_limit_w"] = nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000
        with contextlib.suppress(Exception):
            g["pcie_gen"] = nv.nvmlDeviceGetCurrPcieLinkGeneration(h)
            g["pcie_width"] = nv.nvmlDeviceGetCurrPcieLinkWidth(h)
        links = 0
        for link in range(18):
            with contextlib.suppress(Exception):
                links += nv.nvmlDeviceGetNvLinkState(h, link) == 1
        g["nvlinks_active"] = links
        info["gpus"].append(g)
    info["gpu_name"] = info["gpus"][0]["name"] if n else None
    return info


class NvmlSampler:
    """Energy used by GPU `index` over a `with` block, and its power, temperature and SM
    clock at the end (nothing without NVML)."""

    def __init__(self, index: int = 0):
        self.nv = _nvml()
        self.index = index
        self.readings: dict = {}

    def _read(self) -> dict:
        nv = self.nv
        r = {}
        try:
            h = nv.nvmlDeviceGetHandleByIndex(self.index)
        except Exception:  # noqa: BLE001 - NVML without this GPU: no readings
            return r
        with contextlib.suppress(Exception):
            r["energy_mj"] = nv.nvmlDeviceGetTotalEnergyConsumption(h)
        with contextlib.suppress(Exception):
            r["power_w"] = nv.nvmlDeviceGetPowerUsage(h) / 1000
        with contextlib.suppress(Exception):
            r["temp_c"] = nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)
        with contextlib.suppress(Exception):
            r["sm_clock_mhz"] = nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
        return r

    def __enter__(self):
        if self.nv is not None:
            self.start = self._read()
        return self

    def __exit__(self, *exc):
        if self.nv is None:
            return False
        end = self._read()
        if "energy_mj" in end and "energy_mj" in getattr(self, "start", {}):
            self.readings["energy_j"] = (end["energy_mj"] - self.start["energy_mj"]) / 1000
        for k in ("power_w", "temp_c", "sm_clock_mhz"):
            if k in end:
                self.readings[f"{k}_end"] = end[k]
        return False
