"""Exceptions users may catch."""

from __future__ import annotations

import errno


class ShuffleInputError(ValueError):
    """The data cannot be shuffled as given; the message names the fix."""


class ShuffleSchedulerError(RuntimeError):
    """A gpushuffle graph was computed without a distributed cluster."""

    def __init__(self) -> None:
        super().__init__(
            "gpushuffle runs on Dask's distributed scheduler, and this task is not "
            "running on a distributed worker (one of dask's local schedulers, "
            "'sync', 'threads' or 'processes', is computing it). Create a client "
            "first (`from distributed import Client; client = Client()`), or choose "
            "a shuffle method that runs anywhere (`shuffle_method='tasks'`)."
        )

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (type(self), ())


class ShuffleMemoryError(MemoryError):
    """Received shards do not fit the memory budget and cannot move to disk."""


class ShuffleOutputTooLargeError(ShuffleMemoryError):
    """An output partition is too large for the worker that must build it."""


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


class ShuffleCodecError(RuntimeError):
    """A compressed frame could not be decoded; the message names it and its sender."""


class JobError(Exception):
    """The job cannot run as asked: the input, output, key or cluster is wrong.

    The message is one line that names the problem and, where there is one,
    the fix.
    """
