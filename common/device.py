"""The one thing about devices that every timer needs: waiting for the work queued on them."""

from __future__ import annotations

import torch


def synchronize(device: str | torch.device) -> None:
    """Block until ``device`` has finished the work queued on it. A GPU (CUDA or Apple's MPS)
    runs asynchronously: a clock read right after a call would time only the launch. On the CPU
    every call has finished when it returns: nothing to wait for."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
