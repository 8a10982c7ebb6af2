"""Exceptions users may catch."""

from __future__ import annotations

import errno


class ShuffleInputError(ValueError):
    """The data cannot be shuffled as given; the message names the fix."""


class ShuffleMemoryError(MemoryError):
    """Received shards do not fit the memory budget and cannot move to disk."""


class ShuffleDiskFullError(OSError):
    """The disk holding spilled shards is full."""

    def __init__(self, directory: str) -> None:
        super().__init__(
            errno.ENOSPC,
            f"No space left on the device holding gpushuffle's spill directory {directory}. "
            "Free space there, point the workers' local directory elsewhere "
            "(--local-directory / temporary-directory), raise "
            "gpushuffle.memory.host-limit, or add workers.",
        )
        self.directory = directory

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (type(self), (self.directory,))

    def __str__(self) -> str:
        return str(self.args[1])


class ShuffleCommError(ConnectionError):
    """Shards could not be sent to a peer; the message names it."""
