"""The answers to one epoch's keyed pending queries (docs/membership.md, "Where the checks
may go"): the master fixes each key's count when it is first asked, so every member asking
the same key gets the same answer, however far apart in time they ask."""

from __future__ import annotations

from typing import Callable

MAX_ANSWERS_PER_EPOCH = 100_000
"""Bounds the master's memory per epoch: a member asks a few times per collective at most."""


class PendingAnswers:
    """The fixed answers of the current epoch, keyed by ``(ops, index)``.

    Keys up to ``quiet_up_to``'s (answered alone by members while the master was away) and
    keys first asked while members are re-registering answer 0 and are *quiet*: every
    member's answer to them is, so a DiLoCo wrapper skips that boundary's sync alike
    (docs/membership.md, "When the master dies").
    """

    def __init__(self):
        self._answers: dict[tuple[int, int], int] = {}
        self._quiet: tuple[int, int] = (-1, -1)
        self._quiet_keys: set[tuple[int, int]] = set()

    def reset(self) -> None:
        """A new epoch: no key answered yet."""
        self._answers, self._quiet, self._quiet_keys = {}, (-1, -1), set()

    def quiet_up_to(self, key: tuple[int, int]) -> None:
        """A member answered ``key`` and every earlier key alone: they answer 0, quietly."""
        self._quiet = max(self._quiet, tuple(key))

    def answer(self, key: tuple[int, int], count_now: Callable[[], int],
               resuming: bool) -> tuple[int, bool] | None:
        """The answer to ``key``: ``(count, quiet)``, the count fixed when the key was first
        asked (``count_now()`` then; 0 for a quiet key, or while ``resuming``). None when
        the epoch already holds ``MAX_ANSWERS_PER_EPOCH`` keys and ``key`` is new."""
        if key not in self._answers and (key <= self._quiet or resuming):
            self._answers[key] = 0
            self._quiet_keys.add(key)
        count = self._answers.get(key)
        if count is None:
            if len(self._answers) >= MAX_ANSWERS_PER_EPOCH:
                return None
            count = self._answers[key] = count_now()
        return count, key in self._quiet_keys
