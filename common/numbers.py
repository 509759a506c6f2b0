"""Numbers: what counts as one in a request (the checks of ``inputs.py`` and
``sampling_params.py``), and ``cdiv``, the block arithmetic every layer does."""

from __future__ import annotations

import math
import operator

import torch


def is_int(x: object) -> bool:
    """An integer of any kind (Python, NumPy, a 0-d integer tensor or array), but not a bool."""
    # ``type(x) is int`` answers the usual case at once; the general check is ~20x slower,
    # which shows when every token of every prompt is checked.
    if type(x) is int:
        return True
    if isinstance(x, bool):
        return False
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and not (
            x.is_floating_point() or x.is_complex() or x.dtype is torch.bool
        )
    try:  # what Python itself accepts as an index: NumPy integers, 0-d integer arrays
        operator.index(x)
    except TypeError:
        return False
    return True


def is_number(x: object) -> bool:
    """A finite real number (an integer as ``is_int`` says, or a float), not a bool."""
    if isinstance(x, bool) or not (is_int(x) or isinstance(x, float)):
        return False
    return math.isfinite(float(x))


def cdiv(a: int, b: int) -> int:
    """Ceiling division (vLLM's ``cdiv``): the blocks that ``a`` tokens fill at ``b`` a block."""
    return -(-a // b)
