"""Facts about the device a kernel runs on, shared by the kernel modules (no kernel imports)."""
from __future__ import annotations

import torch

_SMS: dict = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 132 (an H200's) elsewhere, so
    that launch shapes computed off the GPU (tests, the Triton interpreter) are the H200's."""
    device = torch.device(device)
    if device.type != "cuda":
        return 132
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]
