"""What crosses the wire: a :class:`Shard`, and how distributed serializes it.

One input partition yields at most one shard per destination worker: the rows
bound for that worker, grouped by output partition.  Shards are serialized by
their backend, registered in both of distributed's serializer families that
carry data: ``dask`` (TCP: host frames) and ``cuda`` (UCX, which sends frames
exposing ``__cuda_array_interface__`` device to device).

distributed picks a serializer by the type at the top of what it is given:
a message must carry a *list of shards* (:func:`wire_payload`), each of which
then reaches its registered serializer.  A list of ``(key, shard)`` tuples
would be pickled whole instead, bypassing the backend (for cuDF, pickling a
pylibcudf table would carry a raw device address).  Backend tables therefore
refuse plain pickling (:func:`gpushuffle.engine.tables.refuse_pickle`), so
such a mistake fails loudly.
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from dask.sizeof import sizeof
from distributed.protocol import (
    Serialize,
    cuda_deserialize,
    cuda_serialize,
    dask_deserialize,
    dask_serialize,
    to_serialize,
)

from gpushuffle import samehost
from gpushuffle.counters import Counters
from gpushuffle.engine import copies
from gpushuffle.engine.registry import backend_named
from gpushuffle.engine.tables import OWN_FRAMES


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
    #: Sender: whether the large frames are lent to a receiver on this
    #: machine (:mod:`gpushuffle.samehost`) rather than sent.
    lend: bool = False
    #: Sender: frames lent so far, alive until the receiver has answered.
    lent: list[Any] | None = None


@dataclass
class WireStatistics(Counters):
    """Shards this process sent, serialized and deserialized (cumulative).

    Every shard sent to another worker is serialized once by its backend and
    deserialized once by the receiver's: over a cluster, the three counts
    agree.  ``device_frames`` counts frames handed to the comm as device
    buffers (UCX with cuDF).
    """

    messages_sent: int = 0
    #: Bytes lent to (sent) and read from (received) workers on this machine.
    bytes_lent: int = 0
    bytes_read_from_peers: int = 0
    #: Messages a receiver could not read, sent again as bytes (counted
    #: by the sender), and lent messages this process refused to use (by
    #: the receiver: not readable, or not proved to come from the sender).
    lends_refused: int = 0
    reads_refused: int = 0
    shards_sent: int = 0
    shards_serialized: int = 0
    shards_deserialized: int = 0
    bytes_sent: int = 0
    bytes_serialized: int = 0
    bytes_deserialized: int = 0
    device_frames: int = 0

    PREFIX = "wire_"


#: This process's wire statistics (serializers may run in comm threads).
statistics = WireStatistics()


class PeerTraffic:
    """What this process sent to each peer: messages, bytes, and seconds from
    each send's start to the peer's answer (retries included), cumulative.

    A peer behind a slow link, or one slow to store what it receives, shows
    as a low rate; :func:`gpushuffle.peer_statistics` gathers every worker's.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[str, list[float]] = {}

    def add(self, peer: str, nbytes: int, seconds: float, failed: bool = False) -> None:
        with self._lock:
            row = self._peers.setdefault(peer, [0, 0, 0.0, 0])
            row[0] += 1
            row[1] += nbytes
            row[2] += seconds
            row[3] += int(failed)

    def as_dict(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {
                peer: {"messages": m, "bytes": b, "seconds": s, "failed": f}
                for peer, (m, b, s, f) in self._peers.items()
            }


#: This process's sends by peer (the event loop adds; statistics read from any thread).
peer_traffic = PeerTraffic()


def wire_payload(shards: Sequence[Shard]) -> Serialize:
    """The ``data`` of one message: shards that each reach their serializer."""
    statistics.add(
        messages_sent=1, shards_sent=len(shards), bytes_sent=sum(s.nbytes for s in shards)
    )
    return to_serialize(list(shards))


def _serialize(shard: Shard, device_frames: bool = False) -> tuple[dict[str, Any], list[Any]]:
    with copies.timed("serialize"):
        header, frames = backend_named(shard.backend).serialize(
            shard.table, device_frames=device_frames
        )
    lender = None
    if shard.lend and not device_frames and (me := samehost.identity()) is not None:
        lent, frames, kept = samehost.lend(frames, own=header.get(OWN_FRAMES, ()))
        if lent:
            lender = {**me, "frames": lent}
            # Every attempt's frames stay alive: a receiver may still read
            # those of an attempt that timed out.
            shard.lent = [*(shard.lent or ()), *kept]
            statistics.add(bytes_lent=sum(frame[2] for frame in lent))
    copies.count("send", sum(_frame_bytes(f) for f in frames))
    statistics.add(
        shards_serialized=1,
        bytes_serialized=shard.nbytes,
        device_frames=sum(hasattr(f, "__cuda_array_interface__") for f in frames),
    )
    return {
        "lender": lender,
        "backend": shard.backend,
        "input_partition": shard.input_partition,
        "partitions": shard.partitions.tolist(),
        "offsets": shard.offsets.tolist(),
        "nbytes": shard.nbytes,
        "chunk": shard.chunk,
        "table": header,
    }, frames


def _deserialize(header: dict[str, Any], frames: Sequence[Any]) -> Shard:
    copies.count("receive", sum(_frame_bytes(f) for f in frames))
    shard = Shard(
        backend=header["backend"],
        input_partition=header["input_partition"],
        partitions=np.asarray(header["partitions"], dtype=np.int64),
        offsets=np.asarray(header["offsets"], dtype=np.int64),
        table=None,
        nbytes=header["nbytes"],
        chunk=header["chunk"],
    )
    if header.get("lender") is not None:
        # Read later, by the receiving run (read_lent), which can answer a
        # refusal; distributed's comm could only fail the message.
        shard.table = LentTable(header["table"], header["lender"], list(frames))
        return shard
    shard.table = _table(shard, header["table"], frames)
    return shard


def _table(shard: Shard, header: dict[str, Any], frames: Sequence[Any]) -> Any:
    statistics.add(shards_deserialized=1, bytes_deserialized=shard.nbytes)
    with copies.timed("deserialize"):
        return backend_named(shard.backend).deserialize(header, frames)


@dataclass(slots=True)
class LentTable:
    """A received shard's table whose large frames are still in the sender's memory."""

    header: dict[str, Any]
    lender: dict[str, Any]
    carried: list[Any]


def read_lent(shard: Shard, allocate: Callable[[int], np.ndarray] | None = None) -> None:
    """Read a received shard's lent frames from its sender (a worker on this
    machine), into one buffer from ``allocate`` (bytes -> uint8 array), and
    deserialize its table; raises :class:`~gpushuffle.samehost.LendRefused`."""
    lent = shard.table
    if not isinstance(lent, LentTable):
        return
    with copies.timed("receive"):
        frames = samehost.read(lent.lender, lent.carried, allocate)
    nbytes = sum(frame[2] for frame in lent.lender["frames"])
    copies.count("receive", nbytes)
    statistics.add(bytes_read_from_peers=nbytes)
    shard.table = _table(shard, lent.header, frames)


def _frame_bytes(frame: Any) -> int:
    """A frame's size: host buffers, numpy and cupy arrays, rmm.DeviceBuffer."""
    # Only statistics: whatever a frame is, counting it must not fail a send.
    for attribute in ("nbytes", "size"):
        value = getattr(frame, attribute, None)
        if isinstance(value, numbers.Integral):
            return int(value)
    try:
        return memoryview(frame).nbytes
    except Exception:  # pragma: no cover - an unknown frame type: not counted
        return 0


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
