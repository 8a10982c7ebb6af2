"""The task functions of gpushuffle's hash join.

A join is two gpushuffle runs, one per side, with the shape of
distributed's ``HashJoinP2P``: each side's transfer tasks compute dask's
partition id and hand the partition to that side's run; each side's barrier
carries its own :class:`~gpushuffle.engine.run.GPUShuffleSpec` (its meta,
once); output partition ``j`` is one task that assembles ``j`` from both
runs and merges the two with the backend.  distributed's scheduler plugin
gives two shuffles that share output tasks the same ``worker_for``, so both
sides of ``j`` land on the same worker, and restarts both when a worker
leaves.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from gpushuffle._distributed import (
    ShuffleId,
    _is_numeric_cast_type,
    _select_columns_or_index,
    partitioning_index,
)
from gpushuffle.engine.partitioning import hash_partitions, plain_keys
from gpushuffle.engine.registry import backend_for
from gpushuffle.engine.tasks import _phase_errors, get_output, raise_if_read, transfer

#: The partition-id column added to each side before its transfer (dask's
#: name for it in ``HashJoinP2P``).
PARTITION_COLUMN = "__hash_partition"


class IdSeries(Protocol):
    """The partition ids of dask's ``partitioning_index``: a Series of the
    input's kind (pandas or cuDF) with its index.  No ``__array__`` here on
    purpose: cuDF refuses implicit device -> host conversion
    (``np.asarray`` of a cudf Series raises), so the type checker rejects
    handing one to numpy."""

    def astype(self, dtype: Any) -> Any: ...


def partition_ids(df: Any, on: Any, npartitions: int, index_merge: bool) -> np.ndarray | IdSeries:
    """Each row's output partition, exactly as dask's p2p hash join computes it.

    Numeric keys are cast to float64 first (so an int key on one side and a
    float key on the other hash alike), then ``partitioning_index``; the
    result lines up with dask's ``tasks`` and ``p2p`` shuffles of the same key.
    """
    # Plain column keys of a pandas frame: the same ids with less of pandas'
    # overhead (gpushuffle.engine.partitioning).  The data's dtypes decide
    # the casts here, as in dask's hash join.
    plain = None if index_merge else plain_keys(df, on, df)
    if plain is not None:
        return hash_partitions(plain, npartitions)
    if index_merge:
        keys = df[[]].copy()
        keys["_index"] = df.index
    else:
        keys = _select_columns_or_index(df, on)
    if isinstance(keys, (str, list, tuple)):
        names = [keys] if isinstance(keys, str) else list(keys)
        keys = df[names]
    casts = {col: np.float64 for col, dtype in keys.dtypes.items() if _is_numeric_cast_type(dtype)}
    if casts:
        keys = keys.astype(casts, errors="ignore")
    return partitioning_index(keys, npartitions)


def join_transfer(
    input: Any,
    on: Any,
    npartitions: int,
    id: ShuffleId,
    input_partition: int,
    index_merge: bool,
) -> int:
    """Transfer one input partition of one side of a join."""
    ids = partition_ids(input, on, npartitions, index_merge)
    # The smallest integer type that holds the ids: less to reorder by.
    # ``ids`` is a numpy array (pandas keys), or a Series of the input's kind
    # with its index (dask's partitioning_index): assigned as dask's p2p join
    # assigns it (dask-expr's assign_index_merge_transfer), so a cuDF
    # partition's ids stay on the device.
    dtype = np.min_scalar_type(max(npartitions - 1, 0))
    frame = input.assign(**{PARTITION_COLUMN: ids.astype(dtype)})
    return transfer(frame, id, input_partition)


def join_unpack(
    id_left: ShuffleId,
    id_right: ShuffleId,
    output_partition: int,
    barrier_left: int,
    barrier_right: int,
    how: str,
    left_on: Any,
    right_on: Any,
    result_meta: Any,
    suffixes: tuple[str, str],
    left_index: bool,
    right_index: bool,
    indicator: bool,
) -> Any:
    """Output partition ``output_partition`` of the join, from both sides' runs.

    Each side is assembled against its meta, then the two are merged by the
    backend; neither side becomes a key of its own in worker memory.
    """
    # Each side's read takes its rows out of its store: where either side
    # needs another run, neither is read, and both run again.
    with _phase_errors(id_left, "unpack", f"output partition {output_partition}"):
        raise_if_read([(id_left, barrier_left), (id_right, barrier_right)], output_partition)
    with _phase_errors(id_left, "unpack", f"output partition {output_partition}, left side"):
        left = get_output(id_left, barrier_left, output_partition)
    with _phase_errors(id_right, "unpack", f"output partition {output_partition}, right side"):
        right = get_output(id_right, barrier_right, output_partition)
    with _phase_errors(id_left, "unpack", f"merge of output partition {output_partition}"):
        return backend_for(result_meta).merge(
            left,
            right,
            how=how,
            left_on=left_on,
            right_on=right_on,
            left_index=left_index,
            right_index=right_index,
            suffixes=suffixes,
            indicator=indicator,
            meta=result_meta,
        )


__all__ = ["PARTITION_COLUMN", "join_transfer", "join_unpack", "partition_ids"]
