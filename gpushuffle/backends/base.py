"""What the backends share: the checks every backend makes of its input.

The interface they implement, :class:`~gpushuffle.engine.tables.TableBackend`,
is the engine's (:mod:`gpushuffle.engine.tables`).
"""

from __future__ import annotations

from typing import Any

from gpushuffle.engine.tables import OWN_FRAMES, TableBackend, refuse_pickle
from gpushuffle.errors import ShuffleInputError


def dtype_mismatch(
    name: Any, input_partition: int, actual: Any, expected: Any
) -> ShuffleInputError:
    """The error for a column whose dtype cannot stand for meta's."""
    return ShuffleInputError(
        f"gpushuffle: column {name!r} of input partition {input_partition} "
        f"has dtype {actual}, but the collection's meta says {expected}, and "
        "one cannot stand for the other. Fix the data (`astype`) or the "
        "meta (`map_partitions(..., meta=...)`) so they agree."
    )


def check_frame(
    frame: Any, meta: Any, frame_type: type[Any], input_partition: int, column: str
) -> None:
    """The checks every backend makes: frame type, columns, partition column."""
    if not isinstance(frame, frame_type):
        raise ShuffleInputError(
            f"gpushuffle: input partition {input_partition} is a {type(frame).__name__}, "
            f"expected a {frame_type.__module__.split('.')[0]}.{frame_type.__name__} like "
            "the collection's meta."
        )
    if list(frame.columns) != list(meta.columns):
        missing = [c for c in meta.columns if c not in frame.columns]
        extra = [c for c in frame.columns if c not in meta.columns]
        raise ShuffleInputError(
            f"gpushuffle: the columns of input partition {input_partition} do not match "
            f"the collection's meta (missing: {missing}, unexpected: {extra}, or a "
            "different order). Make every partition carry the same columns, e.g. with "
            "`df[columns]` before shuffling."
        )
    if frame[column].dtype.kind not in "iu":
        raise ShuffleInputError(
            f"gpushuffle: the partition column {column!r} of input partition "
            f"{input_partition} has dtype {frame[column].dtype}; it must hold integers "
            "(dask's partitioning_index)."
        )


__all__ = [
    "OWN_FRAMES",
    "TableBackend",
    "check_frame",
    "dtype_mismatch",
    "refuse_pickle",
]
