"""What crosses the wire: a :class:`Shard`, and how distributed serializes it.

One input partition yields at most one shard per destination worker: the rows
bound for that worker, grouped by output partition.  Shards are serialized by
their backend, registered in both of distributed's serializer families that
carry data: ``dask`` (TCP) and ``cuda`` (UCX, which sends frames exposing
``__cuda_array_interface__`` device to device).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from dask.sizeof import sizeof
from distributed.protocol import (
    cuda_deserialize,
    cuda_serialize,
    dask_deserialize,
    dask_serialize,
)

from gpushuffle.backends import backend_named


@dataclass(slots=True)
class Shard:
    """Rows of one input partition bound for one worker.

    Rows of output partition ``partitions[k]`` are
    ``table[offsets[k]:offsets[k + 1]]``, in their input order.  Large
    shards travel as several chunks (consecutive row ranges, ``chunk`` 0, 1,
    ...) so that no message holds more than the comm's message limit.
    """

    backend: str
    input_partition: int
    partitions: np.ndarray
    offsets: np.ndarray
    table: Any
    nbytes: int
    chunk: int = 0


def _serialize(shard: Shard, device_frames: bool = False) -> tuple[dict[str, Any], list[Any]]:
    header, frames = backend_named(shard.backend).serialize(
        shard.table, device_frames=device_frames
    )
    return {
        "backend": shard.backend,
        "input_partition": shard.input_partition,
        "partitions": shard.partitions.tolist(),
        "offsets": shard.offsets.tolist(),
        "nbytes": shard.nbytes,
        "chunk": shard.chunk,
        "table": header,
    }, frames


def _deserialize(header: dict[str, Any], frames: Sequence[Any]) -> Shard:
    backend = backend_named(header["backend"])
    return Shard(
        backend=header["backend"],
        input_partition=header["input_partition"],
        partitions=np.asarray(header["partitions"], dtype=np.int64),
        offsets=np.asarray(header["offsets"], dtype=np.int64),
        table=backend.deserialize(header["table"], frames),
        nbytes=header["nbytes"],
        chunk=header["chunk"],
    )


def _serialize_device(shard: Shard) -> tuple[dict[str, Any], list[Any]]:
    return _serialize(shard, device_frames=True)


# TCP uses the "dask" family: host frames.  UCX uses "cuda" first: device
# buffers stay device buffers and distributed-ucxx sends them as CUDA frames.
dask_serialize.register(Shard)(_serialize)
dask_deserialize.register(Shard)(_deserialize)
cuda_serialize.register(Shard)(_serialize_device)
cuda_deserialize.register(Shard)(_deserialize)


@sizeof.register(Shard)
def _sizeof_shard(shard: Shard) -> int:
    return shard.nbytes
