"""What users call: :func:`shuffle`, and ``shuffle_method="gpushuffle"``.

dask has no plug-in point for shuffle methods: dask-expr lowers every
abstract ``Shuffle`` through ``Shuffle._lower``, which knows only ``p2p``,
``disk``, ``simple`` and ``tasks`` and raises otherwise.  Importing
gpushuffle wraps that one method (:func:`install`): for the method name
``"gpushuffle"`` it returns :class:`GPUShuffle`, an expression that stays
visible to dask-expr's optimizer; every other name goes to dask's own code
unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

from gpushuffle import config
from gpushuffle._distributed import (
    P2PBarrierTask,
    Shuffle,
    ShuffleId,
    SimpleShuffle,
    Task,
    TaskRef,
    barrier_key,
    get_default_shuffle_method,
)
from gpushuffle.backends import backend_for
from gpushuffle.engine.spec import GPUShuffleSpec
from gpushuffle.engine.tasks import barrier as barrier_task
from gpushuffle.engine.tasks import transfer, unpack

METHOD = "gpushuffle"


class GPUShuffle(SimpleShuffle):
    """gpushuffle's lowering of an abstract ``Shuffle`` expression.

    The graph has distributed's P2P shape: one transfer task per input
    partition, one barrier task carrying the :class:`GPUShuffleSpec` (and so
    ``meta``, once), one unpack task per output partition.
    """

    @property
    def _funcname(self) -> str:
        return "gpushuffle-unpack"

    @functools.cached_property
    def _meta(self) -> Any:
        meta = self.frame._meta.drop(columns=self.partitioning_index)
        if self.ignore_index:
            meta = meta.reset_index(drop=True)
        return meta

    def _layer(self) -> dict:
        frame_meta = self.frame._meta
        backend_for(frame_meta)  # unsupported frame types fail here, not on workers
        if self.npartitions_out < 1:
            raise ValueError(f"npartitions must be at least 1, got {self.npartitions_out}")
        token = self._name.split("-")[-1]
        shuffle_id = ShuffleId(token)
        parts_out = self._partitions if self._filtered else list(range(self.npartitions_out))

        dsk: dict = {}
        transfers = []
        for i in range(self.frame.npartitions):
            t = Task(
                (f"gpushuffle-transfer-{token}", i),
                transfer,
                TaskRef((self.frame._name, i)),
                token,
                i,
            )
            dsk[t.key] = t
            transfers.append(t.ref())

        barrier = P2PBarrierTask(
            barrier_key(shuffle_id),
            barrier_task,
            token,
            *transfers,
            spec=GPUShuffleSpec(
                id=shuffle_id,
                disk=False,
                npartitions=self.npartitions_out,
                column=self.partitioning_index,
                meta=frame_meta,
                parts_out=tuple(parts_out) if self._filtered else self.npartitions_out,
                ignore_index=bool(self.ignore_index),
            ),
        )
        dsk[barrier.key] = barrier
        for i, part_out in enumerate(parts_out):
            t = Task((self._name, i), unpack, token, part_out, barrier.ref())
            dsk[t.key] = t
        return dsk


def takes_gpushuffle(method: str, meta: Any) -> bool:
    """Whether a shuffle with this method name and ``meta`` lowers to gpushuffle.

    ``"gpushuffle"`` always does; ``"p2p"`` does for cuDF-backed frames when
    ``gpushuffle.p2p-on-cudf`` is true, so RAPIDS code that asks for p2p gets
    the device path without edits.
    """
    if method == METHOD:
        return True
    return (
        method == "p2p"
        and bool(config.get("p2p-on-cudf"))
        and type(meta).__module__.split(".")[0] == "cudf"
    )


def _lower_with_gpushuffle(self: Shuffle, _dask_lower: Any) -> Any:
    method = self.method or get_default_shuffle_method()
    if not takes_gpushuffle(method, self.frame._meta):
        return _dask_lower(self)
    # Like p2p, no Repartition first when reducing the partition count: the
    # shuffle itself maps any number of inputs to any number of outputs.
    return GPUShuffle(
        self.frame,
        self.partitioning_index,
        self.npartitions_out,
        self.ignore_index,
        self.options,
        self.original_partitioning_index,
    )


def install() -> None:
    """Teach dask-expr the shuffle method name ``"gpushuffle"`` (idempotent)."""
    current = Shuffle._lower
    if getattr(current, "_gpushuffle", False):
        return

    @functools.wraps(current)
    def _lower(self: Shuffle) -> Any:
        return _lower_with_gpushuffle(self, current)

    _lower._gpushuffle = True  # type: ignore[attr-defined]
    Shuffle._lower = _lower  # type: ignore[method-assign]


def shuffle(
    df: Any,
    on: str | list[str],
    npartitions: int | None = None,
    *,
    ignore_index: bool = False,
) -> Any:
    """Shuffle ``df`` so rows with equal ``on`` share an output partition.

    Rows land in the partition that dask's ``partitioning_index`` assigns, as
    with ``shuffle_method="tasks"`` or ``"p2p"``, so frames shuffled by either
    stay co-partitioned; within an output partition rows are grouped by
    input partition, in input order.

    Parameters
    ----------
    df
        A dask DataFrame (pandas- or cuDF-backed).
    on
        Column name(s) to hash, or the index name.
    npartitions
        Number of output partitions; defaults to ``df.npartitions``.
    ignore_index
        Drop the index instead of carrying it (less data to move).

    Returns
    -------
    dask.dataframe.DataFrame
    """
    if npartitions is not None and int(npartitions) < 1:
        raise ValueError(f"npartitions must be at least 1, got {npartitions}")
    return df.shuffle(on, npartitions=npartitions, ignore_index=ignore_index, shuffle_method=METHOD)


def _worker_statistics() -> dict[str, Any]:
    from gpushuffle import transport
    from gpushuffle.engine.memory import worker_memory
    from gpushuffle.engine.pool import host_pool

    row = worker_memory().snapshot()
    for key, value in host_pool().statistics.as_dict().items():
        row[f"host_pool_{key}"] = value
    row.update(transport.statistics.as_dict())
    return row


def statistics(client: Any) -> Any:
    """Memory statistics of every worker, one row each (a pandas DataFrame).

    Columns, cumulative since the worker started unless noted: for each tier
    (``device``, ``host``, ``disk``) its ``_limit``, the ``_bytes`` received
    shards hold there now and the ``_peak_bytes``; bytes and seconds moved
    between tiers each way (``host_to_disk_bytes``, ``disk_to_host_seconds``,
    ...); ``spilled_bytes`` (device -> host plus host -> disk); ``runs``; the
    host buffer pool's counters (``host_pool_...``); and what crossed the
    wire (``wire_shards_sent``, ``wire_shards_serialized``,
    ``wire_shards_deserialized``, their ``_bytes``, and ``wire_device_frames``,
    frames handed to UCX as device buffers).
    """
    import pandas as pd

    rows = client.run(_worker_statistics)
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("worker")
