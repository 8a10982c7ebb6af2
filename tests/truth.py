"""Independent truths to compare gpushuffle's output with."""

from __future__ import annotations

import dask
import numpy as np
import pandas as pd


def checksum(df: pd.DataFrame, index: bool = True) -> int:
    """Order-independent content checksum: the sum of per-row hashes."""
    if not len(df):
        return 0
    return int(pd.util.hash_pandas_object(df, index=index).to_numpy().sum(dtype=np.uint64))


def partitions_of(collection) -> list[pd.DataFrame]:
    """Compute every output partition, in one graph."""
    return list(dask.compute(*collection.to_delayed()))


def canonical(df: pd.DataFrame) -> pd.DataFrame:
    """Rows sorted by every column and the index, to compare row multisets."""
    out = df.reset_index()
    out.columns = [str(c) for c in out.columns]
    return out.sort_values(list(out.columns), kind="stable").reset_index(drop=True)


def assert_same_partitions(ours: list[pd.DataFrame], truth: list[pd.DataFrame]) -> None:
    """Each output partition holds the same rows as the truth's partition."""
    assert len(ours) == len(truth)
    for i, (a, b) in enumerate(zip(ours, truth, strict=True)):
        assert len(a) == len(b), f"partition {i}: {len(a)} rows, truth has {len(b)}"
        assert checksum(a) == checksum(b), f"partition {i}: rows differ from the truth"


def assert_meta_dtypes(parts: list[pd.DataFrame], meta: pd.DataFrame) -> None:
    for i, part in enumerate(parts):
        pd.testing.assert_series_equal(part.dtypes, meta.dtypes, obj=f"dtypes of partition {i}")
        assert list(part.columns) == list(meta.columns)
