"""Target of the ``torch.backends`` entry point (see pyproject.toml).

torch calls ``register()`` at the end of ``import torch``, so scripts can use
``backend="pccl"`` without ``import torch_pccl``. It runs while torch is still
importing: it only touches ``torch.distributed`` (imported by then) and never
loads the native extension. ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns it off.
"""

from .c10d import backend as _backend


def register() -> None:
    """Registers the "pccl" c10d backend (see ``torch_pccl.c10d.backend.register``)."""
    # When the script imports torch_pccl before torch, backend.py's own
    # `import torch` lands here before backend.py has defined register(); the
    # package's __init__ registers as soon as that import returns.
    backend_register = getattr(_backend, "register", None)
    if backend_register is not None:
        backend_register()
