"""Bytes copied by each stage of a shuffle, counted in this process.

The floor of a shuffle is one copy of every byte into its output, plus the
kernel's copies of the bytes that go to another worker.  These counters say
how far each path is from it: ``bytes copied / bytes shuffled``, per stage,
in :func:`gpushuffle.statistics` (``copied_<stage>_bytes``) and in
``gpushuffle bench``.

Stages, in a row's order through a shuffle:

``split``
    The input partition reordered by destination (a take or gather).
``serialize``
    Bytes a backend copied to make frames: pickled in band, or packed into
    one contiguous buffer (cuDF).  Buffers handed to the comm as they are
    (pickle protocol 5 out of band) are not copies.
``compress`` / ``decompress``
    Bytes (before compression) of frames compressed for another host, and
    decompressed on receipt (:mod:`gpushuffle.codecs`).
``send`` / ``receive``
    Frames written to and read from the comm: on TCP the kernel copies them
    into the socket and out of it into a fresh receive buffer.
``deserialize``
    Bytes copied to rebuild a table from frames (in-band pickle data, host
    frames copied to the device).
``spill``
    Bytes written to spill files (a copy into the page cache).  Reading back
    maps the file (no copy until unpack).
``move``
    Bytes moved between device and host memory by the store.
``unpack``
    Bytes copied into output partitions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from gpushuffle.counters import Counters

STAGES = (
    "split",
    "serialize",
    "compress",
    "send",
    "receive",
    "decompress",
    "deserialize",
    "spill",
    "move",
    "unpack",
)


@dataclass
class StageCounters(Counters):
    """One counter per stage (:data:`STAGES`)."""

    split: int = 0
    serialize: int = 0
    compress: int = 0
    send: int = 0
    receive: int = 0
    decompress: int = 0
    deserialize: int = 0
    spill: int = 0
    move: int = 0
    unpack: int = 0


@dataclass
class CopyStatistics(StageCounters):
    """Bytes copied per stage (cumulative, this process)."""

    PREFIX = "copied_"
    SUFFIX = "_bytes"


_STAGE_SET = frozenset(STAGES)

#: This process's counters (stages run on task, comm and offload threads).
statistics = CopyStatistics()


@dataclass
class StageBusyNs(StageCounters):
    """Nanoseconds each stage was under way (cumulative, this process): the
    time while at least one of its operations ran, so overlapping sends (or
    two task threads splitting) count once."""

    PREFIX = "busy_"
    SUFFIX = "_ns"


@dataclass
class StageSpentNs(StageBusyNs):
    """Nanoseconds spent in each stage, summed over its operations: two task
    threads splitting at once count twice (thread time, as a copy on one
    thread is measured)."""

    PREFIX = "spent_"


#: This process's time per stage (:func:`timed`): under way, and summed.
busy = StageBusyNs()
spent = StageSpentNs()

_running: dict[str, int] = dict.fromkeys(STAGES, 0)
_since: dict[str, int] = dict.fromkeys(STAGES, 0)
_running_lock = threading.Lock()


@contextmanager
def timed(stage: str) -> Iterator[None]:
    """Count the time inside the block as ``stage`` being under way (in
    :data:`busy`, once for blocks that overlap) and spent (in :data:`spent`,
    every block), in any thread.  A busy interval is added when the last of
    its overlapping blocks ends."""
    assert stage in _STAGE_SET, stage
    start = time.perf_counter_ns()
    with _running_lock:
        if not _running[stage]:
            _since[stage] = start
        _running[stage] += 1
    try:
        yield
    finally:
        end = time.perf_counter_ns()
        spent.add(**{stage: end - start})
        with _running_lock:
            _running[stage] -= 1
            if not _running[stage]:
                busy.add(**{stage: end - _since[stage]})


def memcpy_seconds_per_byte(nbytes: int = 128 * 2**20, repeat: int = 3) -> float:
    """Seconds per byte of a plain copy (``numpy.copyto``) of ``nbytes``
    between two buffers already touched, at best of ``repeat``: the floor
    each stage's time per byte is set against (``gpushuffle bench``).

    The buffers are larger than a core's caches, as the stages' data is.
    """
    source = np.ones(nbytes, dtype=np.uint8)
    target = np.zeros(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return best / nbytes


def count(stage: str, nbytes: int) -> None:
    """Record ``nbytes`` copied by ``stage`` (one of :data:`STAGES`)."""
    assert stage in _STAGE_SET, stage
    if nbytes:
        statistics.add(**{stage: nbytes})
