"""dtypes of pandas frames against meta: which kinds of data stand for each
other (checked at the split) and which dtype an output column gets (at the
unpack: meta's where a cast keeps every value, as p2p decides)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from pandas.core.dtypes.cast import find_common_type  # type: ignore[attr-defined]  # as p2p

from gpushuffle.backends import flat


def _dtypes(frame: pd.DataFrame) -> list[Any]:
    """``list(frame.dtypes)`` without building a Series (cached by pandas)."""
    get_dtypes = getattr(frame._mgr, "get_dtypes", None)
    return list(frame.dtypes if get_dtypes is None else get_dtypes())


def output_dtype(actual: Any, expected: Any) -> Any:
    """The dtype of an output column whose rows came as ``actual``, where
    meta says ``expected``.

    Meta's where the cast keeps every value (int32 rows in an int64 column,
    object strings in a string column); otherwise the type both fit, as
    distributed's p2p gives (``find_common_type``, distributed issue 8183):
    NaN that a left or outer join brought into an int64 column stays NaN in
    float64, booleans with NaN stay object, and the output's dtype then
    differs from meta's, as with ``p2p`` and ``tasks``.
    """
    if actual == expected:
        return expected
    if isinstance(expected, pd.StringDtype) and (
        actual == np.dtype(object) or isinstance(actual, pd.StringDtype)
    ):
        return expected  # dask's meta often says string where rows are object
    if (
        isinstance(actual, np.dtype)
        and isinstance(expected, np.dtype)
        and np.can_cast(actual, expected, "safe")
    ):
        return expected
    return find_common_type([actual, expected])


def dtype_family(dtype: Any) -> str:
    """A coarse kind of data: dtypes of one family can be cast to each other."""
    if isinstance(dtype, pd.CategoricalDtype):
        return "category"
    if pd.api.types.is_bool_dtype(dtype) or pd.api.types.is_numeric_dtype(dtype):
        return "number"
    if isinstance(dtype, pd.DatetimeTZDtype):
        return f"datetime[{dtype.tz}]"
    if pd.api.types.is_datetime64_dtype(dtype):
        return "datetime"
    if pd.api.types.is_timedelta64_dtype(dtype):
        return "timedelta"
    if pd.api.types.is_string_dtype(dtype):
        return "object"
    return str(dtype)


def _compatible(actual: Any, expected: Any) -> bool:
    """Whether data of dtype ``actual`` can be cast to ``expected`` without loss.

    dask's meta is often loose (an int column that became float where a
    partition had nulls, object strings against string[pyarrow]); those are
    cast at unpack.  Different kinds of data (numbers against strings, naive
    against tz-aware timestamps) are an error in the input.
    """
    a, e = dtype_family(actual), dtype_family(expected)
    if a == e:
        return True
    # Strings and categories of strings stand for each other; object columns
    # may hold anything, including what meta describes.
    return {a, e} <= {"object", "category"} or a == "object" or e == "object"


def _plain_index(index: pd.Index) -> bool:
    # An Index of an extension dtype (string, nullable ints) is no numpy array.
    return (
        type(index) in (pd.Index, pd.RangeIndex)
        and isinstance(index.dtype, np.dtype)
        and _poolable(np.empty(0, index.dtype))
    )


def _fill_dtypes(dtype: Any) -> tuple[np.dtype, ...] | None:
    """The arrays an output column of ``dtype`` is filled into in place: plain
    numpy data as itself, fixed-width extension arrays as their flat buffers
    (:mod:`~gpushuffle.backends.flat`); None for the others."""
    if isinstance(dtype, np.dtype):
        return None if dtype.hasobject else (dtype,)
    return flat.flat_dtypes(dtype)


def _poolable(values: Any) -> bool:
    return isinstance(values, np.ndarray) and not values.dtype.hasobject
