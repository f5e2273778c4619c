"""What an example peer records during a run, and the files it writes at the end.

Shared by ``train_diloco.py``, ``elastic_ddp.py`` and ``train_sharded_diloco.py``: ``Record``
(losses, world size, joins and departures, bytes), ``write_run`` (``summary.json`` and
``loss.png``, matplotlib).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field


@dataclass
class Record:
    """What a peer logs during the run (the final rank 0's copy goes into summary.json)."""

    train_curve: list = field(default_factory=list)  # (step, loss of this peer's batch)
    eval_curve: list = field(default_factory=list)  # (step, eval loss of the outer params)
    world_curve: list = field(default_factory=list)  # (step, world size) at every change
    syncs: list = field(default_factory=list)  # one dict per outer step / per DDP step
    events: list = field(default_factory=list)  # (step, text): joins and departures
    tokens: int = 0  # tokens in the updates the group applied
    ddp_equivalent_bytes: int = 0  # what DDP would have sent per peer for the same steps

    def world(self, step: int, size: int) -> None:
        if not self.world_curve or self.world_curve[-1][1] != size:
            self.world_curve.append((step, size))


def write_run(out_dir: str, summary: dict, rec: Record, title: str, eval_label: str,
              xlabel: str = "step", world_label: str = "world size") -> None:
    """Write ``summary.json`` and ``loss.png`` into ``out_dir``: train and eval losses on the
    left axis, the world size (``rec.world_curve``, named ``world_label``) on the right, joins
    and departures marked; ``summary["steps"]`` ends the world-size line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")

    fig, ax = plt.subplots(figsize=(8, 4.8))
    steps, losses = zip(*rec.train_curve)
    ax.plot(steps, losses, lw=0.5, alpha=0.3, color="C0", label="train loss (this peer's batches)")
    window = 25
    if len(losses) >= window:
        smooth = [sum(losses[i - window:i]) / window for i in range(window, len(losses) + 1)]
        ax.plot(steps[window - 1:], smooth, lw=1.2, color="C0", label=f"train, mean of {window}")
    ev_steps, ev_losses = zip(*rec.eval_curve)
    ax.plot(ev_steps, ev_losses, "o-", color="C3", lw=1.5, label=eval_label)
    for step, text in rec.events:
        ax.axvline(step, color="gray", ls=":", lw=1)
        ax.annotate(text, (step, ax.get_ylim()[1]), rotation=90, va="top", ha="right",
                    fontsize=7, color="gray")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("cross-entropy (nats / character)")
    ax2 = ax.twinx()
    ws = [w for _, w in rec.world_curve] + [rec.world_curve[-1][1]]
    xs = [s for s, _ in rec.world_curve] + [summary["steps"]]
    ax2.step(xs, ws, where="post", color="C2", lw=1, alpha=0.7, label=world_label)
    ax2.set_ylabel(world_label)
    ax2.set_ylim(0, max(ws) + 1)
    ax2.yaxis.get_major_locator().set_params(integer=True)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=120)
    plt.close(fig)
