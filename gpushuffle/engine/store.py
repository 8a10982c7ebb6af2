"""Received shards of one run on one worker, held in memory by output partition.

This is the unbounded in-memory store: every shard stays where it arrived
(host memory for pandas, device memory for cuDF) until its output partition
is unpacked.  A budgeted, tiered store replaces it behind the same
``put``/``pop`` interface.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from gpushuffle.backends import TableBackend
from gpushuffle.transport import Shard


@dataclass
class StoreStatistics:
    """Bytes held by a store, now and at peak, and what went through it."""

    bytes_now: int = 0
    bytes_peak: int = 0
    bytes_in: int = 0
    shards_in: int = 0
    partitions_read: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class ShardStore:
    """Shards by output partition; each piece tagged with its input partition.

    Pieces are views into the shard they were cut from, so storing a shard
    copies nothing; its buffers are released once every output partition it
    feeds has been read.
    """

    def __init__(self, backend: TableBackend) -> None:
        self._backend = backend
        self._pieces: defaultdict[int, list[tuple[int, Any, int]]] = defaultdict(list)
        self.statistics = StoreStatistics()

    def put(self, shard: Shard) -> None:
        total_rows = int(shard.offsets[-1] - shard.offsets[0])
        if not total_rows:
            return
        bounds = shard.offsets.tolist()
        for partition, start, stop in zip(
            shard.partitions.tolist(), bounds, bounds[1:], strict=False
        ):
            if stop > start:
                piece = self._backend.slice(shard.table, start, stop)
                nbytes = shard.nbytes * (stop - start) // total_rows
                self._pieces[partition].append((shard.input_partition, piece, nbytes))
        stats = self.statistics
        stats.bytes_now += shard.nbytes
        stats.bytes_in += shard.nbytes
        stats.shards_in += 1
        stats.bytes_peak = max(stats.bytes_peak, stats.bytes_now)

    def pop(self, partition: int) -> list[Any]:
        """The pieces of ``partition`` in input-partition order; forgets them."""
        pieces = self._pieces.pop(partition, [])
        pieces.sort(key=lambda piece: piece[0])
        self.statistics.bytes_now -= sum(nbytes for _, _, nbytes in pieces)
        self.statistics.partitions_read += 1
        return [table for _, table, _ in pieces]

    def clear(self) -> None:
        self._pieces.clear()
        self.statistics.bytes_now = 0

    def __len__(self) -> int:
        return len(self._pieces)
