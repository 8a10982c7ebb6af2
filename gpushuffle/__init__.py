"""gpushuffle: a peer-to-peer shuffle for Dask DataFrames that keeps data where it lives.

Importing the package registers the shuffle method name ``"gpushuffle"``
with dask, so ``df.shuffle(..., shuffle_method="gpushuffle")``, merges,
groupbys, ``set_index`` and ``sort_values`` can use it.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from gpushuffle import config as _config  # noqa: F401  (loads defaults)
from gpushuffle import transport as _transport  # noqa: F401  (registers serializers)
from gpushuffle.api import METHOD, install, peer_statistics, shuffle, statistics
from gpushuffle.errors import (
    ShuffleCodecError,
    ShuffleCommError,
    ShuffleDiskFullError,
    ShuffleInputError,
    ShuffleMemoryError,
    ShuffleOutputTooLargeError,
    ShuffleSchedulerError,
)

try:
    __version__ = version("gpushuffle")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

install()

__all__ = [
    "METHOD",
    "ShuffleCodecError",
    "ShuffleCommError",
    "ShuffleDiskFullError",
    "ShuffleInputError",
    "ShuffleMemoryError",
    "ShuffleOutputTooLargeError",
    "ShuffleSchedulerError",
    "__version__",
    "peer_statistics",
    "shuffle",
    "statistics",
]
