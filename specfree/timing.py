"""Wall-clock readings that include the device's queued work."""

from __future__ import annotations

import time

import torch


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished its queued work (CUDA runs
    asynchronously: without the wait, a forward would seem to take no time)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
