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

from gpushuffle import codecs, samehost
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
    #: How many chunks the shard was cut into: a receiver holds all of an
    #: input's rows for its partitions once it has every one.
    chunks: int = 1
    #: Which of the receiver's groups of output partitions the rows are for
    #: (0 in a run that recovers nothing; :mod:`gpushuffle.engine.recovery`).
    bucket: int = 0
    #: The sending worker's address (named in errors about what it sent).
    sender: str = ""
    #: Sender: whether the large frames are lent to a receiver on this
    #: machine (:mod:`gpushuffle.samehost`) rather than sent.
    lend: bool = False
    #: Sender: frames lent so far, alive until the receiver has answered.
    lent: list[Any] | None = None
    #: Sender: the run's lease on what it lends (:class:`samehost.Lease`),
    #: withdrawn before the run lets go of frames a receiver may still read.
    lease: samehost.Lease | None = None
    #: Sender: whether gpushuffle decides the compression of the frames
    #: (``gpushuffle.comm.compression`` is not ``none``): distributed's
    #: compression then leaves them as they are.
    own_compression: bool = False
    #: Sender: the frames already serialized and compressed, off the event
    #: loop (:func:`encode`), for the comm's serializer to hand over.
    encoded: Encoded | None = None


@dataclass(slots=True)
class Encoded:
    """A shard's serialization with its frames compressed (:mod:`gpushuffle.codecs`)."""

    device_frames: bool
    header: dict[str, Any]
    frames: list[Any]
    codecs: list[Any] | None

    @property
    def wire_bytes(self) -> int:
        return sum(_frame_bytes(f) for f in self.frames)


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
    #: Lent messages read while their sender's run closed (its lease
    #: withdrawn): not stored (counted by the receiver).
    reads_withdrawn: int = 0
    #: Frames compressed for the wire, their bytes before and after, and
    #: frames decompressed on receipt (:mod:`gpushuffle.codecs`).
    compressed_frames: int = 0
    compressed_raw_bytes: int = 0
    compressed_bytes: int = 0
    decompressed_frames: int = 0
    #: Messages to other hosts encoded (serialized and compressed) off the
    #: event loop, and those that left with no frame compressed.
    messages_encoded: int = 0
    messages_sent_raw: int = 0
    #: Transfer tasks held until their worker's links caught up
    #: (``gpushuffle.comm.link-backlog``), and for how long in all.
    transfers_held: int = 0
    transfers_held_ns: int = 0
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
    """What this process sent to each peer: messages, bytes (shards' own and
    on the wire, after compression), and seconds from each send's start to
    the peer's answer (retries included), cumulative.

    A peer behind a slow link, or one slow to store what it receives, shows
    as a low rate; :func:`gpushuffle.peer_statistics` gathers every worker's.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[str, list[float]] = {}

    def add(
        self,
        peer: str,
        nbytes: int,
        seconds: float,
        failed: bool = False,
        wire_bytes: int | None = None,
    ) -> None:
        with self._lock:
            row = self._peers.setdefault(peer, [0, 0, 0.0, 0, 0])
            row[0] += 1
            row[1] += nbytes
            row[2] += seconds
            row[3] += int(failed)
            row[4] += nbytes if wire_bytes is None else wire_bytes

    def as_dict(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {
                peer: {"messages": m, "bytes": b, "seconds": s, "failed": f, "wire_bytes": w}
                for peer, (m, b, s, f, w) in self._peers.items()
            }


#: This process's sends by peer (the event loop adds; statistics read from any thread).
peer_traffic = PeerTraffic()


def wire_payload(shards: Sequence[Shard]) -> Serialize:
    """The ``data`` of one message: shards that each reach their serializer."""
    statistics.add(
        messages_sent=1, shards_sent=len(shards), bytes_sent=sum(s.nbytes for s in shards)
    )
    return to_serialize(list(shards))


def encode(shard: Shard, compress: codecs.Compress, device_frames: bool = False) -> Encoded:
    """Serialize ``shard`` and compress its frames (in a thread, before its
    send); the comm's serializer then hands the result over."""
    header, frames = _backend_serialize(shard, device_frames)
    with copies.timed("compress"):
        frames, entries = codecs.encode_frames(frames, compress)
    if entries is not None:
        copies.count("compress", sum(e[1] for e in entries if e is not None))
        statistics.add(
            compressed_frames=sum(e is not None for e in entries),
            compressed_raw_bytes=sum(e[1] for e in entries if e is not None),
            compressed_bytes=sum(
                _frame_bytes(f) for f, e in zip(frames, entries, strict=True) if e is not None
            ),
        )
    statistics.add(messages_encoded=1)
    shard.encoded = Encoded(device_frames, header, frames, entries)
    return shard.encoded


def _backend_serialize(shard: Shard, device_frames: bool) -> tuple[dict[str, Any], list[Any]]:
    with copies.timed("serialize"):
        return backend_named(shard.backend).serialize(shard.table, device_frames=device_frames)


def _serialize(shard: Shard, device_frames: bool = False) -> tuple[dict[str, Any], list[Any]]:
    encoded = shard.encoded
    entries = None
    if encoded is not None and encoded.device_frames == device_frames:
        header, frames, entries = encoded.header, encoded.frames, encoded.codecs
    else:
        header, frames = _backend_serialize(shard, device_frames)
    lender = None
    lease = shard.lease
    if (
        shard.lend
        and lease is not None
        and not device_frames
        and (me := samehost.identity()) is not None
    ):
        lent, frames, kept = samehost.lend(frames, own=header.get(OWN_FRAMES, ()))
        if lent:
            lender = {**me, "frames": lent, "lease": lease.as_message()}
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
    message = {
        "lender": lender,
        "backend": shard.backend,
        "input_partition": shard.input_partition,
        "partitions": shard.partitions.tolist(),
        "offsets": shard.offsets.tolist(),
        "nbytes": shard.nbytes,
        "chunk": shard.chunk,
        "chunks": shard.chunks,
        "bucket": shard.bucket,
        "sender": shard.sender,
        "table": header,
    }
    if entries is not None:
        message[codecs.CODECS_KEY] = entries
    if shard.own_compression and lender is None:
        # gpushuffle chose per frame; distributed's compression (if a user
        # turned it on for every message) would only spend time again.
        message["compression"] = (False,) * len(frames)
    return message, frames


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
        chunks=header.get("chunks", 1),
        bucket=header.get("bucket", 0),
        sender=header.get("sender", ""),
    )
    if header.get("lender") is not None:
        # Read later, by the receiving run (read_lent), which can answer a
        # refusal; distributed's comm could only fail the message.
        shard.table = LentTable(header["table"], header["lender"], list(frames))
        return shard
    if header.get(codecs.CODECS_KEY) is not None:
        # Decompressed later, by the receiving run, off the event loop.
        shard.table = EncodedTable(header["table"], header[codecs.CODECS_KEY], list(frames))
        return shard
    shard.table = _table(shard, header["table"], frames)
    return shard


def _table(shard: Shard, header: dict[str, Any], frames: Sequence[Any]) -> Any:
    statistics.add(shards_deserialized=1, bytes_deserialized=shard.nbytes)
    with copies.timed("deserialize"):
        return backend_named(shard.backend).deserialize(header, frames)


@dataclass(slots=True)
class EncodedTable:
    """A received shard's table whose frames are still compressed."""

    header: dict[str, Any]
    codecs: list[Any]
    frames: list[Any]


def decode(shard: Shard) -> None:
    """Decompress a received shard's frames and deserialize its table (in a
    thread); raises :class:`~gpushuffle.errors.ShuffleCodecError`."""
    encoded = shard.table
    if not isinstance(encoded, EncodedTable):
        return
    describe = (
        f"the shard of input partition {shard.input_partition} from {shard.sender or 'a peer'}"
    )
    with copies.timed("decompress"):
        frames = codecs.decode_frames(encoded.codecs, encoded.frames, describe)
    decompressed = [e[1] for e in encoded.codecs if e is not None]
    copies.count("decompress", sum(decompressed))
    statistics.add(decompressed_frames=len(decompressed))
    shard.table = _table(shard, encoded.header, frames)


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
    try:
        return codecs.frame_nbytes(frame)
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
