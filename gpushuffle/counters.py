"""Cumulative counters of this process, added to from any thread."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from typing import ClassVar


@dataclass
class Counters:
    """Base of a dataclass of ``int`` counters.

    :meth:`as_dict` names each field ``PREFIX + name + SUFFIX`` (the columns
    of :func:`gpushuffle.statistics`).
    """

    PREFIX: ClassVar[str] = ""
    SUFFIX: ClassVar[str] = ""
    # Serializers, comm threads, task and offload threads all count.
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def add(self, **increments: int) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self, name, getattr(self, name) + int(value))

    def as_dict(self) -> dict[str, int]:
        return {f"{self.PREFIX}{f.name}{self.SUFFIX}": getattr(self, f.name) for f in fields(self)}
