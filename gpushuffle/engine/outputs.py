"""Whether each output partition can be assembled where it is to be built.

At the barrier every worker knows what it holds for each of its output
partitions.  A hot key (a null key, a default customer) can put most of a
shuffle's rows in one partition; assembling it needs the whole output in the
worker's memory at once, and a partition larger than the worker can hold
ends, with ``p2p`` and naively here, in the worker being restarted until the
computation fails with ``KilledWorker``.  This says so at the barrier
instead, naming the partition, its size and what to do, and warns about
partitions that fit but take most of the worker's memory.

The verdict is a rule on sizes, so that the same data on the same cluster
gets the same answer every run (:func:`build_need`): the partition's bytes,
what assembling it holds beyond them (the backend's
:meth:`~gpushuffle.engine.tables.TableBackend.assembly_overhead`, from the
partition's pieces), and the worker's *base*: what it holds that the build
cannot move, measured once the run has made room (engine/budget.py), which
does not depend on the moment the way a reading of RSS in mid-shuffle does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpushuffle.errors import ShuffleOutputTooLargeError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutputSize:
    """What a worker holds for one output partition."""

    nrows: int
    nbytes: int
    #: The largest of its pieces (an assembly holds one beside the output).
    largest_piece: int = 0
    #: Bytes of its columns an assembly concatenates at the end instead of
    #: filling the output in place (held twice, for a moment).
    concat_bytes: int = 0


@dataclass(frozen=True)
class FitBudget:
    """The memory an output is built within, and the numbers the verdict uses."""

    #: The worker's memory limit (its share of device memory, for cuDF).
    limit: int
    #: What the worker holds that the build cannot move, once room is made.
    base: int
    #: The verdict's line: a build needing more than ``fail_at * limit`` is refused.
    fail_at: float
    #: Outputs over ``warn_at * limit`` on their own are logged as warnings.
    warn_at: float
    #: The limit's name in messages ("this worker's memory limit").
    memory: str
    #: Where ``base`` comes from, for messages.
    base_note: str = "gpushuffle.memory.worker-reserve"


def build_need(size: OutputSize, budget: FitBudget, overhead: Callable[[OutputSize], int]) -> int:
    """Bytes a worker holds at the peak of building an output of ``size``:
    its base, the output, and what the assembly holds beyond it."""
    return budget.base + size.nbytes + overhead(size)


def fits(size: OutputSize, budget: FitBudget, overhead: Callable[[OutputSize], int]) -> bool:
    """Whether an output of ``size`` is built within ``budget`` (always, with
    the check off: ``fail_at`` 0, or no limit)."""
    if budget.limit <= 0 or budget.fail_at <= 0:
        return True
    return build_need(size, budget, overhead) <= budget.fail_at * budget.limit


def check_outputs_fit(
    sizes: Mapping[int, OutputSize],
    budget: FitBudget,
    overhead: Callable[[OutputSize], int],
    *,
    where: str,
) -> None:
    """Raise :class:`ShuffleOutputTooLargeError` where the largest partition
    would not be built within ``budget``; log the verdict's numbers for it
    (INFO), and a warning for partitions over ``warn_at`` of the limit.

    ``where`` names the shuffle and worker.
    """
    if not sizes or budget.limit <= 0 or budget.fail_at <= 0:
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

    extra = overhead(largest)
    need = build_need(largest, budget, overhead)
    numbers = (
        f"building it holds the output, {_size(extra)} more while it is assembled, "
        f"and the {_size(budget.base)} the worker needs besides ({budget.base_note}): "
        f"{_size(need)}, "
        f"{need / budget.limit:.0%} of {budget.memory} ({_size(budget.limit)})"
    )
    if need > budget.fail_at * budget.limit:
        raise ShuffleOutputTooLargeError(
            f"gpushuffle {where}: {describe(partition, largest)}; {numbers}, more than "
            f"the {budget.fail_at:.0%} it may take, and the worker would be restarted "
            "until the computation fails. A key shared by many rows (a null or "
            "default key) makes such a partition: spread it (add a random salt column to "
            "the key and aggregate in two steps), use more output partitions "
            "(npartitions=) where the keys are many, or give workers more memory. "
            "(gpushuffle.memory.output-fail sets this limit.)"
        )
    logger.info("gpushuffle %s: the largest output fits: %s", where, numbers)
    for p, size in sizes.items():
        if size.nbytes > budget.warn_at * budget.limit:
            logger.warning(
                "gpushuffle %s: %s, more than %.0f%% of %s (%s); it fits, but leaves "
                "little for anything else while it is built and held.",
                where,
                describe(p, size),
                100 * budget.warn_at,
                budget.memory,
                _size(budget.limit),
            )


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"
