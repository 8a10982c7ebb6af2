"""nvCOMP's codecs on device frames: cuDF shards compressed on the GPU for UCX.

**Not yet run on a GPU** (no GPU has been lent to this project): written
against nvCOMP's Python API (``nvidia-nvcomp-cu12``/``-cu13`` 5.3, the
release RAPIDS 26.10's libcudf loads), every name resolved in the real
wheels by ``ci/rapids_names.py``; the calls and their evidence are in
docs/gpu-calls.md.  Until a GPU run validates it, ``auto`` never picks a
device codec on its own: only ``gpushuffle.comm.compression: lz4`` or
``zstd`` sends device frames through here (see
:data:`gpushuffle.engine.links.DEVICE_CODECS_IN_AUTO`).

Frames are compressed in nvCOMP's own format (``BitstreamKind.NVCOMP_NATIVE``)
with nvCOMP's checksums computed on compression and verified on
decompression (``ChecksumPolicy.COMPUTE_AND_VERIFY``): a damaged frame fails
in nvCOMP, which :func:`gpushuffle.codecs.decode_frames` reports as a
:class:`~gpushuffle.errors.ShuffleCodecError`.  Compressed frames are copied
into RMM memory (a small device-to-device copy: they are the compressed
size) and frames are decompressed into ``rmm.DeviceBuffer``, the type
distributed-ucxx receives into, so every frame UCX sends or gives cuDF comes
from RMM's pool (CUDA IPC from memory of another allocator is never freed,
rapidsmpf found).  Work runs on the legacy default stream, the one RMM's
copies use, so a copy follows the compression it copies.
"""

from __future__ import annotations

import threading
from typing import Any

#: gpushuffle's codec names and nvCOMP's algorithms.
ALGORITHMS = {"lz4": "LZ4", "zstd": "Zstd"}

#: cudaStream_t of the legacy default stream (what RMM's copies use by default).
_DEFAULT_STREAM = 0


class DeviceCodec:
    """One nvCOMP algorithm, with a ``nvcomp.Codec`` per thread (nvCOMP's
    codecs hold scratch state and must not be shared between threads)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._algorithm = ALGORITHMS[name]
        self._local = threading.local()

    def _codec(self) -> Any:
        codec = getattr(self._local, "codec", None)
        if codec is None:
            from nvidia import nvcomp

            codec = nvcomp.Codec(
                algorithm=self._algorithm,
                cuda_stream=_DEFAULT_STREAM,
                bitstream_kind=nvcomp.BitstreamKind.NVCOMP_NATIVE,
                checksum_policy=nvcomp.ChecksumPolicy.COMPUTE_AND_VERIFY,
            )
            self._local.codec = codec
        return codec

    def compress(self, frame: Any) -> Any:
        import rmm
        from nvidia import nvcomp

        encoded = self._codec().encode(nvcomp.as_array(frame))
        # Reading the size waits for the compression (nvCOMP reads it back).
        size = int(encoded.buffer_size)
        pointer = int(encoded.__cuda_array_interface__["data"][0])
        return rmm.DeviceBuffer(ptr=pointer, size=size)

    def decompress(self, data: Any, nbytes: int) -> Any:
        import rmm
        from nvidia import nvcomp

        out = rmm.DeviceBuffer(size=nbytes)
        self._codec().decode(nvcomp.as_array(data), out=out)
        return out

    def checksum(self, data: Any) -> int:
        # nvCOMP checksums its own frames (COMPUTE_AND_VERIFY): reading the
        # bytes back to the host for one here would cost a device round trip.
        return 0


_codecs: dict[str, DeviceCodec] = {}
_lock = threading.Lock()


def device_codec(name: str) -> DeviceCodec:
    """The nvCOMP codec called ``name`` (``lz4`` or ``zstd``); raises
    ImportError where nvCOMP's Python package is not installed."""
    if name not in ALGORITHMS:
        raise ValueError(f"no device codec {name!r}: use one of {', '.join(ALGORITHMS)}")
    with _lock:
        codec = _codecs.get(name)
        if codec is None:
            import importlib.util

            if importlib.util.find_spec("nvidia.nvcomp") is None:
                raise ImportError(
                    "nvCOMP's Python package is not installed (pip install "
                    "nvidia-nvcomp-cu12 or -cu13, as the gpu extras do)"
                )
            codec = _codecs[name] = DeviceCodec(name)
        return codec
