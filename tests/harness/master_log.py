"""Watching the master's log from a test: ``MasterWarnings(*needles)`` collects the
``torch_pccl.master`` warnings that contain every needle, and ``seen`` is set at the first,
so a test waits on it with a deadline instead of sleeping."""

import logging
import threading


class MasterWarnings(logging.Handler):
    """The master's WARNING (and above) lines that contain all of ``needles``, in
    ``lines``; ``seen`` is set at the first. A context manager: attached to the
    ``torch_pccl.master`` logger inside the ``with`` only."""

    def __init__(self, *needles: str):
        super().__init__(logging.WARNING)
        self.needles = needles
        self.lines: list[str] = []
        self.seen = threading.Event()

    def emit(self, record):
        line = record.getMessage()
        if all(n in line for n in self.needles):
            self.lines.append(line)
            self.seen.set()

    def __enter__(self):
        logging.getLogger("torch_pccl.master").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("torch_pccl.master").removeHandler(self)
