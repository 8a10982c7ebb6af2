"""gpushuffle.compare: methods side by side on a live cluster, answers checked."""

from __future__ import annotations

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from test_memory import cluster_with

from gpushuffle.compare import compare, partition_checksums


def _frame(n: int = 60_000) -> dd.DataFrame:
    rng = np.random.default_rng(3)
    pdf = pd.DataFrame(
        {"k": rng.integers(0, 500, n), "v": rng.random(n), "s": rng.choice(list("abc"), n)}
    )
    return dd.from_pandas(pdf, npartitions=6)


def test_checksums_ignore_row_order_and_see_one_changed_value():
    pdf = pd.DataFrame({"k": [1, 2, 3, 4], "v": [0.5, 1.5, 2.5, 3.5]})
    changed = pdf.copy()
    changed.loc[3, "v"] = 3.25
    with dask.config.set(scheduler="sync"):  # no cluster needed
        same = partition_checksums(dd.from_pandas(pdf, npartitions=1))
        shuffled = partition_checksums(
            dd.from_pandas(pdf.iloc[[2, 0, 3, 1]], npartitions=1, sort=False)
        )
        other = partition_checksums(dd.from_pandas(changed, npartitions=1))
    assert same.equals(shuffled)
    assert not same.equals(other)
    assert same["rows"].tolist() == [4]
    # Where the index only numbers the rows (a merge's fresh RangeIndex),
    # index=False: the same rows in another order, renumbered, are the same.
    renumbered = dd.from_pandas(pdf.iloc[[2, 0, 3, 1]].reset_index(drop=True), npartitions=1)
    with dask.config.set(scheduler="sync"):
        assert partition_checksums(renumbered, index=False).equals(
            partition_checksums(dd.from_pandas(pdf, npartitions=1), index=False)
        )
        assert not partition_checksums(renumbered).equals(same)


def test_compare_times_each_method_and_checks_their_partitions():
    df = _frame()
    with cluster_with({}):
        df = df.persist()
        result = compare(
            lambda m: df.shuffle("k", npartitions=5, shuffle_method=m),
            methods=("gpushuffle", "tasks"),
            repeat=2,
        )
        table = result.table()
        assert result.same_results()
        assert list(table.index) == ["gpushuffle", "tasks"]
        assert table["runs"].tolist() == [2, 2]
        assert (table["rows"] == len(df)).all()
        assert table.loc["gpushuffle", "x_gpushuffle"] == 1.0
        # gpushuffle's stages ran (its counters moved); tasks has none.
        assert result.stage_seconds()["split"] > 0
        assert all(not r.stage_seconds for r in result.runs if r.method == "tasks")
        html = result._repr_html_()
        assert "<table" in html and "data:image/png;base64," in html
        assert "same rows in every partition" in html

        # A method that loses rows is seen as different.
        wrong = compare(
            lambda m: df.shuffle("k", npartitions=5, shuffle_method="tasks").map_partitions(
                lambda p: p.iloc[1:] if m == "broken" else p
            ),
            methods=("tasks", "broken"),
        )
        assert not wrong.same_results()
        assert wrong.table()["same_partitions"].tolist() == [True, False]


def test_compare_refuses_a_result_the_cluster_already_holds():
    df = _frame()
    with cluster_with({}):
        kept = df.shuffle("k", npartitions=5, shuffle_method="tasks").persist()
        with pytest.raises(ValueError, match="already holds the result"):
            compare(lambda m: df.shuffle("k", npartitions=5, shuffle_method=m), methods=("tasks",))
        del kept
        with pytest.raises(ValueError, match="at least one"):
            compare(lambda m: df, methods=())
