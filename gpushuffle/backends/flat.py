"""Fixed-width pandas extension arrays as flat numpy arrays.

Arrow-backed fixed-width columns (``decimal128``, ``date32``, timestamps,
pyarrow ints and floats: what ``read_parquet`` gives), tz-aware datetimes,
pandas' masked arrays (``Int64``, ``Float64``, ``boolean``) and categoricals
of one known dtype are, under their pandas types, one or two plain
numpy-typed buffers (a categorical's codes: its categories are the
dtype's).  Taken and filled as such, they take the numpy path of the split
and the unpack: gathered with ``np.take`` into pooled memory, and an output
column filled in place piece by piece.  The other way (an extension
``take`` per piece into fresh memory, then ``_concat_same_type`` and, for
Arrow, ``combine_chunks``) copies the rows of a borrowed piece twice and
allocates twice.

:func:`flat` gives an array's buffers as numpy views, or None when it has
no flat form: Arrow chunks with nulls (their validity bitmaps are bits, not
bytes), several chunks where one is needed, booleans and other types.
:func:`flat_dtypes` says which numpy arrays an output column of a dtype is
filled into, and :func:`unflat` builds the pandas array back from them
(no copy).
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pandas as pd
import pyarrow as pa
from pandas.api.extensions import ExtensionArray
from pandas.arrays import BooleanArray, DatetimeArray, FloatingArray, IntegerArray
from pandas.core.dtypes.dtypes import BaseMaskedDtype

from gpushuffle.backends import arrow

#: numpy dtypes of Arrow values buffers, by bytes per value (the others are
#: opaque bytes: ``np.take`` has a fast loop for 16 and 32 as well).
_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bytes_dtype(width: int) -> np.dtype:
    return np.dtype(_UINTS[width]) if width in _UINTS else np.dtype((np.void, width))


def _arrow_values(dtype: Any) -> tuple[pa.DataType, np.dtype] | None:
    """The Arrow type of an ``ArrowDtype`` with a flat form and the numpy
    dtype of its values buffer, else None."""
    if not isinstance(dtype, pd.ArrowDtype):
        return None
    width = arrow._fixed_width(dtype.pyarrow_dtype)
    return None if width is None else (dtype.pyarrow_dtype, _bytes_dtype(width))


def flat_dtypes(dtype: Any) -> tuple[np.dtype, ...] | None:
    """The numpy arrays an output column of ``dtype`` is filled into, else None.

    Only extension dtypes: plain numpy columns are filled as they are.
    """
    arrow_values = _arrow_values(dtype)
    if arrow_values is not None:
        return (arrow_values[1],)
    if isinstance(dtype, pd.DatetimeTZDtype):
        return (np.dtype(np.int64),)
    if isinstance(dtype, BaseMaskedDtype):
        return (np.dtype(cast(Any, dtype).numpy_dtype), np.dtype(np.bool_))
    if isinstance(dtype, pd.CategoricalDtype) and dtype.categories is not None:
        return (pd.Categorical.from_codes([], dtype=dtype).codes.dtype,)
    return None


def same_dtype(values: Any, dtype: Any) -> bool:
    """Whether ``values`` is of ``dtype`` for :func:`flat`: equal, and for a
    categorical with its categories in the same order (unordered dtypes
    compare equal whatever the order; codes mean the same only in the same
    order)."""
    if getattr(values, "dtype", None) != dtype:
        return False
    return not isinstance(values, pd.Categorical) or values.categories.equals(dtype.categories)


def flat(values: Any, dtype: Any, checked: bool = False) -> tuple[np.ndarray, ...] | None:
    """``values`` (of pandas dtype ``dtype`` exactly) as views of its buffers
    in :func:`flat_dtypes` form, or None if it has none.  ``checked``: the
    caller knows :func:`same_dtype` holds."""
    if not checked and not same_dtype(values, dtype):
        return None
    if isinstance(values, DatetimeArray) and isinstance(dtype, pd.DatetimeTZDtype):
        return (values._ndarray.view(np.int64),)
    if isinstance(values, IntegerArray | FloatingArray | BooleanArray):
        masked: Any = values
        return (masked._data, masked._mask)
    if isinstance(values, pd.Categorical):
        return (values.codes,)
    arrow_values = _arrow_values(dtype)
    if arrow_values is None or not arrow.is_arrow(values):
        return None
    raw = arrow_values[1]
    chunks = [c for c in values._pa_array.chunks if len(c)]
    if not chunks:
        return (np.empty(0, raw),)
    if len(chunks) > 1 or chunks[0].null_count:
        return None
    (chunk,) = chunks
    return (
        np.frombuffer(
            chunk.buffers()[1], raw, count=len(chunk), offset=chunk.offset * raw.itemsize
        ),
    )


def unflat(arrays: tuple[np.ndarray, ...], dtype: Any) -> ExtensionArray:
    """The pandas array of ``dtype`` whose buffers are ``arrays`` (not copied)."""
    if isinstance(dtype, pd.DatetimeTZDtype):
        datetimes: Any = DatetimeArray
        return datetimes._simple_new(arrays[0].view(f"M8[{dtype.unit}]"), dtype=dtype)
    if isinstance(dtype, BaseMaskedDtype):
        data, mask = arrays
        masked_type: Any = dtype.construct_array_type()
        return masked_type(data, mask)
    if isinstance(dtype, pd.CategoricalDtype):
        return pd.Categorical.from_codes(arrays[0], dtype=dtype, validate=False)
    arrow_values = _arrow_values(dtype)
    assert arrow_values is not None, dtype
    (values,) = arrays
    chunk = pa.Array.from_buffers(
        arrow_values[0], len(values), [None, pa.py_buffer(values)], null_count=0
    )
    return pd.arrays.ArrowExtensionArray(chunk)


__all__ = ["flat", "flat_dtypes", "unflat"]
