"""Building an output partition's columns: pieces copied into columns
allocated once where they fit, collected and concatenated where they do
not."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from gpushuffle.backends import arrow, flat
from gpushuffle.backends.pandas_columns import (
    _concat_column,
    _concat_index,
    _own_large_chunks,
    _same_memory,
    _take_column,
)
from gpushuffle.engine import copies
from gpushuffle.engine.pool import HostBufferPool

#: Pieces smaller than this are gathered and copied together.
_BATCH_BYTES = 256 << 10


_BATCH_PIECES = 256

#: Dtype objects a column remembers as its own (see _ColumnBuilder._flat).
_OWN_DTYPES = 16


class _ColumnBuilder:
    """One output column, filled piece by piece.

    Pieces are copied straight into ``outs``, pooled arrays of the output's
    length (one for numpy data, an extension array's flat buffers for the
    fixed-width ones), so each piece can be released once copied.  Pieces
    that do not fit (other dtypes, numpy data that would not cast safely, an
    Arrow piece with nulls) are collected and concatenated at the end,
    after what was filled until then.
    """

    def __init__(
        self,
        dtype: Any,
        pool: HostBufferPool,
        outs: tuple[np.ndarray, ...] | None,
        index: bool = False,
    ) -> None:
        self.dtype = dtype
        self.pool = pool
        self.index = index
        #: Filled as flat buffers of an extension dtype (else numpy data).
        self.extension = not isinstance(dtype, np.dtype)
        self.outs = outs
        self.position = 0
        self.copied = 0  # counted once, at the end (the counters take a lock)
        self.parts: list[Any] = []
        #: Per part: True for memory of its own (a take), else the addresses
        #: of the received buffers that are (PandasTable.standalone).
        self.owned: list[bool | frozenset[int]] = []
        #: Dtype objects found to be the column's own (flat.same_dtype),
        #: weakly: a shard's pieces share theirs, and so do pieces read back
        #: through one store's memo.  Comparing a categorical's dtype
        #: compares its categories, once per piece and per check without
        #: this; holding it would hold a received one's categories, views
        #: of its whole message, after the piece was copied.
        self._own_dtypes: list[weakref.ref[Any]] = []

    @property
    def filling(self) -> bool:
        """Whether pieces still go straight into ``outs``."""
        return self.outs is not None

    def _flat(self, values: Any) -> tuple[np.ndarray, ...] | None:
        """:func:`flat.flat` of ``values`` in the column's dtype."""
        dtype = getattr(values, "dtype", None)
        for own in self._own_dtypes:
            if own() is dtype and dtype is not None:
                return flat.flat(values, self.dtype, checked=True)
        if not flat.same_dtype(values, self.dtype):
            return None
        if len(self._own_dtypes) < _OWN_DTYPES:
            with contextlib.suppress(TypeError):  # a dtype without weak references
                self._own_dtypes.append(weakref.ref(dtype))
        return flat.flat(values, self.dtype, checked=True)

    def _fits(self, values: Any) -> tuple[np.ndarray, ...] | None:
        """``values`` as the arrays to copy into ``outs``, or None if it does not fit."""
        if self.extension:
            return self._flat(values)
        if isinstance(values, np.ndarray) and (
            # can_cast costs ten times the comparison, once a column and piece
            values.dtype == self.dtype or np.can_cast(values.dtype, self.dtype, "safe")
        ):
            return (values,)
        return None

    def _filled(self) -> Any:
        """The rows filled so far, as an array of the column's dtype."""
        assert self.outs is not None
        outs = tuple(out[: self.position] for out in self.outs)
        return flat.unflat(outs, self.dtype) if self.extension else outs[0]

    def _stop_filling(self) -> None:
        if self.outs is not None and self.position:
            self.parts.append(self._filled())
            self.owned.append(True)
        self.outs = None

    def add(self, values: Any, owned: bool | frozenset[int] = False) -> None:
        n = len(values)
        parts = self._fits(values) if self.filling else None
        if parts is not None:
            assert self.outs is not None
            for out, part in zip(self.outs, parts, strict=True):
                out[self.position : self.position + n] = part
                self.copied += part.nbytes
        else:
            self._stop_filling()
            if values.dtype == self.dtype:
                # Of the column's own dtype, its chunks are kept at the end
                # (_coalesce); others are converted then, a copy anyway.
                values, owned, copied = _own_large_chunks(values, owned)
                self.copied += copied
            self.parts.append(values)
            self.owned.append(owned)
        self.position += n

    def add_taken(self, values: Any, rows: np.ndarray, arrow_rows: list[arrow.Positions]) -> None:
        """:meth:`add` ``values.take(rows)``, gathered straight into the output
        where it can be."""
        n = len(rows)
        parts: tuple[np.ndarray, ...] | None = None
        if self.filling:
            if self.extension:
                parts = self._flat(values)
            elif type(values) is np.ndarray and values.dtype == self.dtype:
                parts = (values,)
        if parts is not None:
            assert self.outs is not None
            for out, part in zip(self.outs, parts, strict=True):
                np.take(part, rows, out=out[self.position : self.position + n], mode="clip")
                self.copied += n * part.itemsize
            self.position += n
            return
        taken = _take_column(values, rows, arrow_rows, stage="unpack")
        copies.count("unpack", int(taken.nbytes))
        self.add(taken, owned=True)

    def add_all(
        self, values: list[Any], owned: Sequence[bool | frozenset[int]] | None = None
    ) -> None:
        """:meth:`add` each of ``values``; those that fit in one copy per buffer."""
        if len(values) > 1 and self.filling:
            assert self.outs is not None
            if not self.extension and {(type(v), v.dtype) for v in values} == {
                (np.ndarray, self.dtype)
            }:
                # numpy data of the column's dtype, the common case: one
                # check for the batch (with many partitions a batch is
                # hundreds of pieces of a row or two, and per-piece checks
                # cost more than the copy).
                n = sum([len(v) for v in values])
                chunk = self.outs[0][self.position : self.position + n]
                np.concatenate(values, out=chunk)
                self.copied += chunk.nbytes
                self.position += n
                return
            fits = [self._fits(v) for v in values]
            fitting = [parts for parts in fits if parts is not None]
            if len(fitting) == len(values):
                n = sum(len(v) for v in values)
                for k, out in enumerate(self.outs):
                    chunk = out[self.position : self.position + n]
                    np.concatenate([parts[k] for parts in fitting], out=chunk, casting="safe")
                    self.copied += chunk.nbytes
                self.position += n
                return
        for i, v in enumerate(values):
            self.add(v, False if owned is None else owned[i])

    def finish(self) -> Any:
        copies.count("unpack", self.copied)
        if self.outs is not None:
            return self._filled()
        if self.index:
            out = _concat_index([pd.Index(p, copy=False) for p in self.parts], self.pool).values
            if len(self.parts) != 1 or not _same_memory(out, self.parts[0]):
                copies.count("unpack", int(out.nbytes))
            return out
        out, copied = _concat_column(self.parts, self.dtype, self.pool, self.owned)
        copies.count("unpack", copied)
        return out
