"""``TrainingState``: a DDP run's model, optimizer and scheduler as one shared state.

Every value that makes a data-parallel replica what it is becomes a named CPU tensor
for ``sync_shared_state`` (docs/shared-state.md), so a joiner receives the run's exact
bytes and a survivor's drift is repaired by the majority:

- ``model/<name>``: every tensor of ``module.state_dict()`` (parameters and buffers),
  by reference, so the sync writes into the module;
- ``optimizer/state/<param name>/<key>``: the optimizer's per-parameter state
  (momentum buffers, Adam moments, step counts), tensors by reference;
- ``optimizer/groups/<i>/<key>``: the numeric hyperparameters of each parameter
  group (``lr``, ``betas``, ``weight_decay``...), which a scheduler changes;
- ``scheduler/<key>``: the numeric leaves of ``scheduler.state_dict()`` (``last_epoch``,
  ``_step_count``, ``_last_lr``...);
- ``step``: the training steps the run has applied (int64).

Python numbers travel as 0-dim tensors (int64 for ints, float64 for floats: both exact;
bool for bools) and are written back with their type by ``restore``. Strings, None and
callables are configuration, equal on every peer by construction (the same script), and
are left alone. Nothing read from the network is unpickled or parsed: the structure
always comes from the local objects; only tensor bytes, verified against the elected
hashes, arrive.
"""

from __future__ import annotations

import torch

from ...errors import InvalidArgumentError

__all__ = ["TrainingState"]


class TrainingState:
    """The shared-state entries of a data-parallel run (see the module docstring).

    Args:
        module: the model (CPU tensors, as ``sync_shared_state`` requires).
        optimizer: a ``torch.optim.Optimizer`` over parameters of ``module``.
        scheduler: an LR scheduler of ``optimizer`` (anything with ``state_dict`` and
            ``load_state_dict``), or None.

    Raises:
        InvalidArgumentError: a tensor of the module is not on the CPU; the optimizer
            holds a parameter that is not the module's.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler=None):
        for name, t in module.state_dict(keep_vars=True).items():
            if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                raise InvalidArgumentError(
                    f"ElasticDDP keeps the run's state with sync_shared_state, which takes CPU "
                    f"tensors; {name} is on {t.device}")
        names = {id(p): n for n, p in module.named_parameters()}
        self._params: list[tuple[str, torch.Tensor]] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in names:
                    raise InvalidArgumentError(
                        "the optimizer holds a parameter that is not the module's "
                        f"(shape {tuple(p.shape)}); ElasticDDP syncs the module's state")
                self._params.append((names[id(p)], p))
        self._module = module
        self._optimizer = optimizer
        self._scheduler = scheduler
        self._step = torch.zeros((), dtype=torch.int64)

    @property
    def step(self) -> int:
        """Training steps applied by the run (its optimizer steps; shared)."""
        return int(self._step)

    def advance(self) -> None:
        """One more step applied."""
        self._step += 1

    # -- the optimizer's lazily created state -----------------------------------

    def has_state(self) -> torch.Tensor:
        """int32 flags, one per optimizer parameter in group order: 1 where this peer's
        optimizer holds state for it (torch optimizers create it at their first step)."""
        return torch.tensor([1 if self._optimizer.state.get(p) else 0 for _, p in self._params],
                            dtype=torch.int32)

    def materialize(self, wanted: torch.Tensor) -> int:
        """Creates the optimizer state of the parameters flagged in ``wanted`` that have none
        here, so this peer's entries match the peers that have stepped; returns how many.

        One optimizer step on zero gradients, for those parameters only (the others get no
        gradient, so the optimizer skips them), without the optimizer's hooks; parameters
        and gradients are put back as they were. The values it leaves are placeholders that
        the following sync overwrites with the run's (a peer that never synced is outvoted).
        """
        missing = [p for (_, p), w in zip(self._params, wanted.tolist())
                   if w and not self._optimizer.state.get(p)]
        if not missing:
            return 0
        chosen = {id(p) for p in missing}
        every = [p for _, p in self._params]
        saved = [(p.detach().clone(), p.grad) for p in every]
        try:
            for p in every:
                p.grad = torch.zeros_like(p) if id(p) in chosen else None
            # The class's step without the hooks torch wraps around it: a user's post-step
            # hook (a scheduler's counter, a DiLoCo wrapper) must not see this step.
            raw = getattr(type(self._optimizer).step, "__wrapped__", type(self._optimizer).step)
            with torch.no_grad():
                raw(self._optimizer)
        finally:
            with torch.no_grad():
                for p, (value, grad) in zip(every, saved):
                    p.copy_(value)
                    p.grad = grad
        return len(missing)

    # -- the entries -----------------------------------------------------------

    def entries(self) -> dict[str, torch.Tensor]:
        """The shared state now: tensors by reference, numbers as fresh 0-dim tensors
        (``restore`` writes those back after a sync)."""
        out: dict[str, torch.Tensor] = {}
        for name, t in self._module.state_dict().items():
            if isinstance(t, torch.Tensor):
                out[f"model/{name}"] = t
        for name, p in self._params:
            for key, value in sorted(self._optimizer.state.get(p, {}).items(), key=_key):
                _flatten(value, f"optimizer/state/{name}/{key}", out)
        for i, group in enumerate(self._optimizer.param_groups):
            for key in sorted(group):
                if key != "params":
                    _flatten(group[key], f"optimizer/groups/{i}/{key}", out)
        if self._scheduler is not None:
            _flatten(self._scheduler.state_dict(), "scheduler", out)
        out["step"] = self._step
        return out

    def restore(self, entries: dict[str, torch.Tensor]) -> None:
        """Writes the numbers of ``entries`` (after a sync) back into the optimizer's state
        and groups and the scheduler, with their Python types."""
        for name, p in self._params:
            state = self._optimizer.state.get(p)
            for key in list(state or ()):
                state[key] = _restore(state[key], f"optimizer/state/{name}/{key}", entries)
        for i, group in enumerate(self._optimizer.param_groups):
            for key in group:
                if key != "params":
                    group[key] = _restore(group[key], f"optimizer/groups/{i}/{key}", entries)
        if self._scheduler is not None:
            self._scheduler.load_state_dict(
                _restore(self._scheduler.state_dict(), "scheduler", entries))


def _key(item) -> str:
    return str(item[0])


def _flatten(value, name: str, out: dict[str, torch.Tensor]) -> None:
    """Adds the tensors and numbers of ``value`` (nested dicts, lists, tuples) to ``out``."""
    if isinstance(value, torch.Tensor):
        out[name] = value
    elif isinstance(value, bool):
        out[name] = torch.tensor(value, dtype=torch.bool)
    elif isinstance(value, int):
        out[name] = torch.tensor(value, dtype=torch.int64)
    elif isinstance(value, float):
        out[name] = torch.tensor(value, dtype=torch.float64)
    elif isinstance(value, dict):
        for key, v in sorted(value.items(), key=_key):
            _flatten(v, f"{name}/{key}", out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten(v, f"{name}/{i}", out)


def _restore(value, name: str, entries: dict[str, torch.Tensor]):
    """``value`` with its numbers replaced by those of ``entries`` (same structure)."""
    if isinstance(value, torch.Tensor):
        return value                    # written in place by the sync
    if isinstance(value, bool):
        return bool(entries[name].item())
    if isinstance(value, int):
        return int(entries[name].item())
    if isinstance(value, float):
        return float(entries[name].item())
    if isinstance(value, dict):
        return {k: _restore(v, f"{name}/{k}", entries) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_restore(v, f"{name}/{i}", entries) for i, v in enumerate(value))
    if isinstance(value, list):
        return [_restore(v, f"{name}/{i}", entries) for i, v in enumerate(value)]
    return value
