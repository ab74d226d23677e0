"""`ddbench env`: what this machine is, in one table (and optionally JSON)."""
from __future__ import annotations

import json
import platform
import socket
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ddbench import telemetry
from ddbench.results import atomic_write_text, ensure_out_dir


def facts() -> dict:
    f = {"host": socket.gethostname(), "python": platform.python_version(),
         **telemetry.versions(), **telemetry.gpu_info()}
    try:
        import torch

        f["torch_cuda_devices"] = torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        f["torch_cuda_devices"] = 0
    return f


def run(json_out: Path | None = None) -> dict:
    f = facts()
    console = Console()
    t = Table(title="ddbench env", show_header=False)
    for key in ("host", "python", "torch", "triton", "cuda", "nccl", "driver", "gpu_count"):
        t.add_row(key, str(f.get(key)))
    for g in f.get("gpus", []):
        t.add_row(f"gpu {g['index']}", ", ".join(f"{k}={v}" for k, v in g.items() if k != "index"))
    console.print(t)
    if not f.get("gpu_count"):
        console.print("[yellow]No NVIDIA GPU found (NVML unavailable or no devices): "
                      "GPU commands will run their CPU-sized presets.[/]")
    if json_out:
        ensure_out_dir(Path(json_out).parent)
        atomic_write_text(json_out, json.dumps(f, indent=2, default=str) + "\n")
    return f
