"""Frames compressed for the wire: the codecs, and a shard's frames encoded and decoded.

A shard's frames (its backend's serialization) are compressed one by one,
each with the codec a run chose for its link (:mod:`gpushuffle.engine.links`)
or not at all.  Host frames use pyarrow's codecs (``lz4``: the LZ4 frame
format, ``zstd``: level 1); device frames (cuDF over UCX) use nvCOMP's on the
device (:mod:`gpushuffle.device_codecs`, not yet run on a GPU).

What the receiver needs travels in the shard's header: per frame its codec,
its size before compression and a CRC-32 of its compressed bytes.  A frame
whose bytes changed on the way (or a codec that returns the wrong number of
bytes, or fails) is a :class:`~gpushuffle.errors.ShuffleCodecError` naming
the frame, the shard and the sender, never a wrong row: LZ4 and zstd decode
damaged input into plausible bytes without complaint, so the check is ours.
"""

from __future__ import annotations

import numbers
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import pyarrow as pa

from gpushuffle.errors import ShuffleCodecError

#: Header key of a shard whose frames were encoded: one entry per frame,
#: ``None`` (sent as it is) or ``[codec, raw nbytes, crc32 of the compressed bytes]``.
CODECS_KEY = "codecs"

#: Frames smaller than this go as they are: a codec's call and header cost
#: more than it saves on them (distributed's own threshold is 10 kB).
MIN_FRAME_BYTES = 16 * 1024

#: The host codecs, fastest first.
HOST_CODECS = ("lz4", "zstd")


class Codec(Protocol):
    """One compression algorithm for one kind of frame (host or device)."""

    name: str

    def compress(self, frame: Any) -> Any:
        """``frame`` compressed (a buffer of the same kind: host or device)."""

    def decompress(self, data: Any, nbytes: int) -> Any:
        """``data`` decompressed into ``nbytes``; raises on damaged input
        where the codec notices."""

    def checksum(self, data: Any) -> int:
        """A CRC-32 of compressed bytes (on the device for device frames)."""


class HostCodec:
    """A pyarrow codec on host buffers (thread-safe: one call per frame)."""

    def __init__(self, name: str, arrow_name: str, level: int | None = None) -> None:
        self.name = name
        self._codec = pa.Codec(arrow_name, compression_level=level)

    def compress(self, frame: Any) -> pa.Buffer:
        return self._codec.compress(frame)

    def decompress(self, data: Any, nbytes: int) -> pa.Buffer:
        # A buffer of its own, from pyarrow's pool (mimalloc), which keeps
        # freed pages for the next one: no fresh page faults per message.
        return self._codec.decompress(data, decompressed_size=nbytes)

    def checksum(self, data: Any) -> int:
        return zlib.crc32(data)


_host_codecs: dict[str, Codec] = {}


def host_codec(name: str) -> Codec:
    """The host codec called ``name`` (one of :data:`HOST_CODECS`)."""
    codec = _host_codecs.get(name)
    if codec is None:
        if name == "lz4":
            codec = HostCodec("lz4", "lz4")
        elif name == "zstd":
            # Level 1: on TPC-H lineitem 4.7-6x at 290-400 MB/s a core here,
            # where level 3 compressed no better and more slowly.
            codec = HostCodec("zstd", "zstd", level=1)
        else:
            raise ValueError(f"no host codec {name!r}: use one of {', '.join(HOST_CODECS)}")
        _host_codecs[name] = codec
    return codec


def codec_for(name: str, device: bool) -> Codec:
    """The codec ``name`` for host frames, or for device frames (nvCOMP)."""
    if not device:
        return host_codec(name)
    from gpushuffle import device_codecs

    return device_codecs.device_codec(name)


def is_device_frame(frame: Any) -> bool:
    return hasattr(frame, "__cuda_array_interface__")


def frame_nbytes(frame: Any) -> int:
    """A frame's size in bytes: host buffers, and device buffers that say."""
    for attribute in ("nbytes", "size"):
        value = getattr(frame, attribute, None)
        if isinstance(value, numbers.Integral):
            return int(value)
    return memoryview(frame).nbytes


#: How a frame is encoded: given (slot, frame), a codec and the frame it
#: compressed, or None to send the frame as it is.
Compress = Callable[[tuple[int, int], Any], "tuple[Codec, Any] | None"]


def encode_frames(frames: Sequence[Any], compress: Compress) -> tuple[list[Any], list[Any] | None]:
    """Compress the frames ``compress`` takes.

    A frame's *slot* is ``(its position, how many frames the shard has)``:
    the same buffer of the same column in every shard of a run, while the
    backend serializes them alike.  Returns the frames to send and the
    header entries (:data:`CODECS_KEY`; None if no frame was compressed).
    A frame that came out no smaller goes as it is.
    """
    out: list[Any] = []
    entries: list[Any] = []
    count = len(frames)
    for position, frame in enumerate(frames):
        nbytes = frame_nbytes(frame)
        done = compress((position, count), frame) if nbytes >= MIN_FRAME_BYTES else None
        if done is None or frame_nbytes(done[1]) >= nbytes:
            out.append(frame)
            entries.append(None)
            continue
        codec, compressed = done
        out.append(compressed)
        entries.append([codec.name, nbytes, codec.checksum(compressed)])
    if not any(entries):
        return list(frames), None
    return out, entries


def decode_frames(entries: Sequence[Any], frames: Sequence[Any], describe: str) -> list[Any]:
    """The frames as they were before :func:`encode_frames` (``entries``
    from the header); ``describe`` names the shard in errors."""
    if len(entries) != len(frames):
        raise ShuffleCodecError(
            f"gpushuffle: {describe} arrived with {len(frames)} frames where its header "
            f"lists {len(entries)}: the message was damaged on the way"
        )
    out = []
    for position, (entry, frame) in enumerate(zip(entries, frames, strict=True)):
        if entry is None:
            out.append(frame)
            continue
        name, nbytes, crc = entry
        where = f"frame {position} of {describe}, compressed with {name}"
        try:
            codec = codec_for(name, device=is_device_frame(frame))
        except (ImportError, ValueError) as e:
            raise ShuffleCodecError(
                f"gpushuffle: {where}, cannot be decoded on this worker ({e}). "
                "Install the same gpushuffle and codecs on every worker, or set "
                "gpushuffle.comm.compression to none."
            ) from e
        if codec.checksum(frame) != crc:
            raise ShuffleCodecError(
                f"gpushuffle: {where}, does not match its checksum: its bytes changed on the "
                "way (network or memory fault); the shard is refused rather than decoded wrong."
            )
        try:
            decoded = codec.decompress(frame, nbytes)
        except Exception as e:
            raise ShuffleCodecError(f"gpushuffle: {where}, failed to decompress: {e!r}") from e
        if frame_nbytes(decoded) != nbytes:
            raise ShuffleCodecError(
                f"gpushuffle: {where}, decompressed to {frame_nbytes(decoded)} bytes "
                f"where {nbytes} were sent"
            )
        out.append(decoded)
    return out
