"""Target of the ``torch.backends`` entry point (see pyproject.toml), and the one place
that wires the package's layers together.

torch calls ``register()`` at the end of ``import torch``, so scripts can use
``backend="pccl"`` without ``import torch_pccl``. It runs while torch is still
importing: it only touches ``torch.distributed`` (imported by then) and never
loads the native extension. ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns it off.

c10d does not import the elastic layer above it; the elastic layer registers its
group factory with c10d (``c10d.backend.register_group_factory``) when
``torch_pccl.elastic.rendezvous`` is imported. ``register`` gives c10d
``load_elastic``, which imports it at the first group or ``pccl://`` rendezvous, so the
factory is there for every pccl group, in a script that never imports torch_pccl too.
"""

from .c10d import backend as _backend


def register() -> None:
    """Registers the "pccl" c10d backend (see ``torch_pccl.c10d.backend.register``), with
    ``load_elastic`` as the loader of the elastic layer's group factory."""
    # When the script imports torch_pccl before torch, backend.py's own
    # `import torch` lands here before backend.py has defined register(); the
    # package's __init__ registers as soon as that import returns.
    backend_register = getattr(_backend, "register", None)
    if backend_register is not None:
        backend_register(load_factories=load_elastic)


def load_elastic() -> None:
    """Imports the elastic layer's rendezvous module, which registers the factory of the
    groups formed through a master (loads torch and the native extension)."""
    # Deferred to the first group: the native extension must not load at `import torch`.
    from .elastic import rendezvous  # noqa: F401
