"""What c10d's C++ side reads from a group besides its ops: names and backends.

c10d code (dist.recv without src, FSDP2, DeviceMesh, object collectives,
dist.distributed_c10d helpers) asks a group for its backend's name, its group
name and description, and the backend of a device. A group built in Python
cannot register a c10d Backend (its constructor is not exposed), so a
``ProcessGroupPCCL`` is its own backend for every device it serves, and answers
what c10d reads from a backend. ``BackendView`` is that part of the group, a base
class of ``ProcessGroupPCCL`` ahead of ``dist.ProcessGroup``.
"""

from __future__ import annotations

import torch

from ..config import BACKEND_NAME


class BackendView:
    """The group's answers to c10d about itself: backend name, group name and
    description, and the backend (itself) of a cpu or cuda device."""

    DEVICE_TYPES = ("cpu", "cuda")
    supports_splitting = False
    supports_coalescing = False
    supports_shrinking = False
    supports_time_estimate = False
    _group_name: str | None = None     # set by c10d through setGroupName
    _group_desc = "undefined"

    def getBackendName(self) -> str:
        """``"pccl"`` (``config.BACKEND_NAME``)."""
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:
        """Records the name c10d gives the group at creation."""
        self._group_name = name

    def getGroupName(self) -> str:
        """The name c10d gave the group.

        Raises:
            RuntimeError: none was set yet (c10d's message).
        """
        if self._group_name is None:
            raise RuntimeError("ProcessGroup name not set")
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        """Records c10d's description of the group."""
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        """c10d's description of the group (``"undefined"`` until set)."""
        return self._group_desc

    def _get_backend(self, device) -> BackendView:
        """This group, for a cpu or cuda device (``torch.device`` or str); mirrors c10d's.

        Raises:
            RuntimeError: another device type, with c10d's message.
        """
        kind = torch.device(device).type
        if kind not in self.DEVICE_TYPES:
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return self

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(kind) for kind in self.DEVICE_TYPES]

    def supports_tensor_alloc(self, device) -> bool:
        """False: tensors come from torch's allocator (no symmetric memory)."""
        return False
