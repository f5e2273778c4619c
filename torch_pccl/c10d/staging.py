"""CUDA staging: the native layer reads and writes host memory only.

A tensor that is not on the CPU is copied to a host tensor before its op
(``host``) and the result copied back after it (``copy_back``); a CPU tensor is
used in place, with no copy.
"""

from __future__ import annotations

import torch


def host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when it is on the CPU, else a (detached) CPU copy of it."""
    return tensor if tensor.device.type == "cpu" else tensor.detach().to("cpu")


def copy_back(tensor: torch.Tensor, host_tensor: torch.Tensor) -> None:
    """Copies the op's result from ``host_tensor`` (from ``host(tensor)``) into ``tensor``,
    unless they are the same tensor (a CPU tensor, written in place)."""
    if host_tensor is not tensor:
        tensor.copy_(host_tensor)
