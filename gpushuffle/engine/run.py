"""One shuffle run on one worker: split and send inputs, store shards, unpack.

Coordination (run ids, the barrier, restarts, output-worker restrictions) is
distributed's: this class fills in the data path of its ``ShuffleRun``.
"""

from __future__ import annotations

import os
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
from dask.typing import Key
from dask.utils import parse_timedelta
from distributed.core import ErrorMessage, OKMessage
from distributed.metrics import context_meter, thread_time
from distributed.utils import sync
from distributed.utils_comm import retry

from gpushuffle import config
from gpushuffle._distributed import ResourceLimiter, ShuffleRun
from gpushuffle.backends import backend_for
from gpushuffle.engine.memory import worker_memory
from gpushuffle.engine.store import ShardStore
from gpushuffle.transport import Shard

if TYPE_CHECKING:
    from gpushuffle._distributed import ShuffleWorkerPlugin
    from gpushuffle.engine.spec import GPUShuffleSpec


class GPUShuffleRun(ShuffleRun[int, Any]):
    """Worker-side state of one run of a :class:`GPUShuffleSpec`.

    Transfer: each input partition is reordered once by the backend so that
    the rows for each destination worker are contiguous, then cut into one
    :class:`Shard` per worker (views, no copy).  The local shard goes
    straight into the store; the others go through distributed's comm buffer
    (batched, concurrency- and memory-limited) to their workers.

    Unpack: an output partition's pieces are concatenated in input-partition
    order against ``meta``; a partition that received nothing is ``meta``.
    """

    def __init__(
        self,
        spec: GPUShuffleSpec,
        worker_for: dict[int, str],
        run_id: int,
        span_id: str | None,
        plugin: ShuffleWorkerPlugin,
    ) -> None:
        worker = plugin.worker
        super().__init__(
            id=spec.id,
            run_id=run_id,
            span_id=span_id,
            local_address=worker.address,
            # The base class's own buffers are unused (disk=False: it creates
            # no directory); received shards go to ``self.store``.
            directory=os.path.join(worker.local_directory, f"gpushuffle-{spec.id}-{run_id}"),
            executor=plugin._executor,
            rpc=worker.rpc,
            digest_metric=worker.digest_metric,
            scheduler=worker.scheduler,
            memory_limiter_disk=ResourceLimiter(None),
            memory_limiter_comms=plugin.memory_limiter_comms,
            disk=False,
            loop=worker.loop,
        )
        self.spec = spec
        self.column = spec.column
        self.keep_index = not spec.ignore_index
        self.backend = backend_for(spec.meta)
        meta_out = spec.meta.drop(columns=[spec.column])
        if spec.ignore_index:
            meta_out = meta_out.reset_index(drop=True)
        self.meta_out = meta_out
        self.worker_for = worker_for
        memory = worker_memory()
        memory.runs_started += 1
        self.store = ShardStore(
            backend=self.backend,
            memory=memory,
            directory=os.path.join(worker.local_directory, f"gpushuffle-{spec.id}-{run_id}"),
            offload=self.offload,
            wait_timeout=parse_timedelta(config.get("memory.wait-timeout"), default="s") or 0,
            describe=f"gpushuffle {spec.id} on {worker.address}",
        )
        self._layout(worker_for, spec.npartitions)

    def _layout(self, worker_for: dict[int, str], npartitions: int) -> None:
        """Order wanted partitions by destination worker.

        ``self.rank[p]`` is partition ``p``'s position in that order (or
        ``nranks`` if unwanted); worker ``w`` receives ranks
        ``self.rank_range[w]``, i.e. partitions ``self.partitions_of[w]``.
        """
        by_worker: dict[str, list[int]] = {}
        for partition, address in sorted(worker_for.items()):
            by_worker.setdefault(address, []).append(partition)
        nranks = len(worker_for)
        dtype = np.int16 if nranks < np.iinfo(np.int16).max else np.int32
        rank = np.full(npartitions, nranks, dtype=dtype)
        self.partitions_of: dict[str, np.ndarray] = {}
        self.rank_range: dict[str, tuple[int, int]] = {}
        start = 0
        for address, partitions in by_worker.items():
            stop = start + len(partitions)
            rank[partitions] = np.arange(start, stop, dtype=dtype)
            self.partitions_of[address] = np.asarray(partitions, dtype=np.int64)
            self.rank_range[address] = (start, stop)
            start = stop
        self.rank = rank
        self.nranks = nranks

    # -- transfer ---------------------------------------------------------

    def add_partition(self, data: Any, partition_id: int) -> int:
        self.raise_if_closed()
        if self.transferred:
            raise RuntimeError(f"Cannot add more partitions to {self}")
        self.backend.validate(data, self.spec.meta, self.column, partition_id)
        with self._capture_metrics("foreground"):
            with (
                context_meter.meter("p2p-shard-partition-noncpu"),
                context_meter.meter("p2p-shard-partition-cpu", func=thread_time),
            ):
                shards = self._shard_partition(data, partition_id)
            local = shards.pop(self.local_address, None)
            sync(self._loop, self._write, local, shards)
        return self.run_id

    async def _write(
        self, local: tuple[int, Shard] | None, remote: dict[str, tuple[int, Shard]]
    ) -> None:
        if local is not None:
            # Shards for this worker skip serialization and the comm buffer.
            await self._store([local])
        if remote:
            await self._write_to_comm(remote)

    def _shard_partition(self, data: Any, partition_id: int) -> dict[str, tuple[int, Shard]]:
        backend = self.backend
        table, offsets = backend.split(data, self.column, self.rank, self.nranks, self.keep_index)
        out: dict[str, tuple[int, Shard]] = {}
        for address, (first, last) in self.rank_range.items():
            start, stop = int(offsets[first]), int(offsets[last])
            if stop == start:
                continue
            view = backend.slice(table, start, stop)
            out[address] = (
                partition_id,
                Shard(
                    backend=backend.name,
                    input_partition=partition_id,
                    partitions=self.partitions_of[address],
                    offsets=offsets[first : last + 1] - start,
                    table=view,
                    nbytes=backend.nbytes(view),
                ),
            )
        context_meter.digest_metric("p2p-shards", sum(s.nbytes for _, s in out.values()), "bytes")
        context_meter.digest_metric("p2p-shards", len(out), "count")
        return out

    async def send(self, address: str, shards: list[tuple[int, Shard]]) -> OKMessage | ErrorMessage:
        # The base class measures shards with memoryview(), which fails on
        # frames and device buffers; shards serialize themselves instead.
        return await retry(
            partial(self._send, address, shards),
            count=self.RETRY_COUNT,
            delay_min=self.RETRY_DELAY_MIN,
            delay_max=self.RETRY_DELAY_MAX,
        )

    async def _receive(self, data: list[tuple[int, Shard]]) -> None:
        self.raise_if_closed()
        await self._store(data)

    async def _store(self, data: list[tuple[int, Shard]]) -> None:
        for input_partition, shard in data:
            # An input partition re-sent (a retried transfer task) is ignored.
            if input_partition in self.received:
                continue
            self.received.add(input_partition)
            self.total_recvd += shard.nbytes
            try:
                await self.store.put(shard)
            except Exception as e:
                self._exception = e
                raise

    # -- unpack -----------------------------------------------------------

    def _get_output_partition(self, partition_id: int, key: Key, **kwargs: Any) -> Any:
        nrows, tables = self.store.read(partition_id)
        if not nrows:
            return self.backend.empty(self.meta_out)
        return self.backend.assemble(tables, nrows, self.meta_out, self.keep_index)

    def _get_assigned_worker(self, i: int) -> str:
        return self.worker_for[i]

    # -- bookkeeping ------------------------------------------------------

    def heartbeat(self) -> dict[str, Any]:
        heartbeat = super().heartbeat()
        heartbeat["store"] = self.store.statistics.as_dict()
        return heartbeat

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            self.store.close()

    def read(self, path: Any) -> tuple[Any, int]:
        raise NotImplementedError("gpushuffle keeps received shards in its own store")

    def deserialize(self, buffer: Any) -> Any:
        raise NotImplementedError("gpushuffle keeps received shards in its own store")
