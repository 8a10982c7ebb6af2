"""Whether each output partition can be assembled where it is to be built.

At the barrier every worker knows what it holds for each of its output
partitions.  A hot key (a null key, a default customer) can put most of a
shuffle's rows in one partition; assembling it needs the whole output in the
worker's memory at once, and a partition larger than the worker can hold
ends, with ``p2p`` and naively here, in the worker being restarted until the
computation fails with ``KilledWorker``.  This says so at the barrier
instead, naming the partition, its size and what to do, and warns about
partitions that fit but take most of the worker's memory.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from gpushuffle.errors import ShuffleOutputTooLargeError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutputSize:
    nrows: int
    nbytes: int


def check_outputs_fit(
    sizes: Mapping[int, OutputSize],
    limit: int,
    held: int,
    *,
    fail_at: float,
    warn_at: float,
    where: str,
    memory: str,
) -> None:
    """Raise :class:`ShuffleOutputTooLargeError` where the largest partition,
    on top of the ``held`` bytes the worker holds now, would pass
    ``fail_at * limit``; log a warning for partitions over ``warn_at * limit``
    on their own.

    ``where`` names the shuffle and worker, ``memory`` the limit (e.g.
    "this worker's memory limit").  ``fail_at`` 0 turns the check off.
    """
    if not sizes or limit <= 0 or fail_at <= 0:
        return
    total_rows = sum(s.nrows for s in sizes.values())
    total_bytes = sum(s.nbytes for s in sizes.values())
    even = total_bytes / len(sizes)
    partition, largest = max(sizes.items(), key=lambda item: item[1].nbytes)

    def describe(p: int, size: OutputSize) -> str:
        share = size.nrows / total_rows if total_rows else 0.0
        times = size.nbytes / even if even else 0.0
        return (
            f"output partition {p} holds {_size(size.nbytes)} ({size.nrows:,} rows, "
            f"{share:.0%} of the rows this worker received for its {len(sizes)} "
            f"partitions, {times:.1f}x their mean)"
        )

    if held + largest.nbytes > fail_at * limit:
        raise ShuffleOutputTooLargeError(
            f"gpushuffle {where}: {describe(partition, largest)}; with the "
            f"{_size(held)} the worker holds already, building it would take more than "
            f"{fail_at:.0%} of {memory} ({_size(limit)}), and the worker would be "
            "restarted until the computation fails. A key shared by many rows (a null or "
            "default key) makes such a partition: spread it (add a random salt column to "
            "the key and aggregate in two steps), use more output partitions "
            "(npartitions=) where the keys are many, or give workers more memory. "
            "(gpushuffle.memory.output-fail sets this limit.)"
        )
    for p, size in sizes.items():
        if size.nbytes > warn_at * limit:
            logger.warning(
                "gpushuffle %s: %s, more than %.0f%% of %s (%s); it fits, but leaves "
                "little for anything else while it is built and held.",
                where,
                describe(p, size),
                100 * warn_at,
                memory,
                _size(limit),
            )


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"
