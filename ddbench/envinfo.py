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


def kernel_facts(choice=None) -> dict:
    """What the kernel choice (default: every default) runs on this machine's first device
    (`kernels.select.resolve`)."""
    import torch

    from ddbench.kernels.select import KernelChoice, resolve

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return resolve(choice or KernelChoice(), device)


def run(json_out: Path | None = None, choice=None) -> dict:
    f = facts()
    f["kernels"] = kernel_facts(choice)
    console = Console()
    t = Table(title="ddbench env", show_header=False)
    for key in ("host", "python", "torch", "triton", "cuda", "nccl", "driver", "gpu_count"):
        t.add_row(key, str(f.get(key)))
    for g in f.get("gpus", []):
        t.add_row(f"gpu {g['index']}", ", ".join(f"{k}={v}" for k, v in g.items() if k != "index"))
    console.print(t)
    k = Table(title=f"kernel choice on {f['kernels']['device']} (--kernels {f['kernels']['requested']})",
              show_header=False)
    for key, value in f["kernels"].items():
        if key not in ("requested", "device", "tiles"):
            k.add_row(key, str(value))
    for name, table in f["kernels"]["tiles"].items():
        k.add_row(f"tiles {name}", str(table) if not isinstance(table, dict) else
                  ", ".join(f"{a}={b}" for a, b in table.items()))
    console.print(k)
    if not f.get("gpu_count"):
        console.print("[yellow]No NVIDIA GPU found (NVML unavailable or no devices): "
                      "GPU commands will run their CPU-sized presets.[/]")
    if json_out:
        ensure_out_dir(Path(json_out).parent)
        atomic_write_text(json_out, json.dumps(f, indent=2, default=str) + "\n")
    return f
