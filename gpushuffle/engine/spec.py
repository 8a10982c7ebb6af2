"""The shuffle spec: what the scheduler and workers need to start a run.

It travels once, on the barrier task (:class:`P2PBarrierTask`), and carries
``meta``: workers build output partitions from it and never need to look at
data to learn the schema.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpushuffle._distributed import ShuffleRun, ShuffleSpec, pin_output_tasks

if TYPE_CHECKING:
    from gpushuffle._distributed import ShuffleWorkerPlugin


@dataclass(frozen=True)
class GPUShuffleSpec(ShuffleSpec[int]):
    """A hash shuffle of a DataFrame by a precomputed partition-id column.

    Parameters
    ----------
    npartitions
        Number of output partitions.
    column
        Column holding each row's output partition, computed by dask's
        ``partitioning_index`` so rows land where the ``tasks`` and ``p2p``
        methods would put them.  It is dropped from the output.
    meta
        Empty frame with the input's schema, ``column`` included.
    parts_out
        The output partitions wanted: all of them (an ``int``) or a subset.
    ignore_index
        Whether to drop the index instead of carrying it.
    borrow_inputs
        Whether the input partitions are persisted data, which workers hold
        whatever the shuffle does: the rows a worker keeps of its own inputs
        may then stay in them instead of being copied into its store
        (``gpushuffle.memory.borrow-inputs``).
    """

    npartitions: int
    column: str
    meta: Any
    parts_out: tuple[int, ...] | int
    ignore_index: bool
    borrow_inputs: bool = False

    @property
    def output_partitions(self) -> Generator[int]:
        parts_out = self.parts_out
        yield from range(parts_out) if isinstance(parts_out, int) else parts_out

    def pick_worker(self, partition: int, workers: Sequence[str]) -> str:
        # Range sharding, as p2p does: contiguous output partitions per worker.
        return workers[len(workers) * partition // self.npartitions]

    def create_new_run(self, worker_for: dict[int, str], span_id: str | None) -> Any:
        state = super().create_new_run(worker_for=worker_for, span_id=span_id)
        from gpushuffle.engine.tasks import output_partition_of

        pin_output_tasks(self.id, worker_for, output_partition_of)
        return state

    def create_run_on_worker(
        self,
        run_id: int,
        span_id: str | None,
        worker_for: dict[int, str],
        plugin: ShuffleWorkerPlugin,
    ) -> ShuffleRun:
        from gpushuffle.engine.run import GPUShuffleRun

        return GPUShuffleRun(
            spec=self,
            worker_for=worker_for,
            run_id=run_id,
            span_id=span_id,
            plugin=plugin,
        )
