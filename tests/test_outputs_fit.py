"""An output partition too large for its worker fails at the barrier, saying why."""

from __future__ import annotations

import logging

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from conftest import assert_nothing_left_behind

import gpushuffle
from gpushuffle.engine.outputs import OutputSize, check_outputs_fit

pytestmark = pytest.mark.timeout(180)

GiB = 2**30


def _check(sizes, limit=4 * GiB, held=0, fail_at=0.75, warn_at=0.5):
    check_outputs_fit(
        sizes,
        limit,
        held,
        fail_at=fail_at,
        warn_at=warn_at,
        where="abc on w",
        memory="the limit",
    )


def test_a_partition_over_the_limit_is_named_with_its_size_and_share():
    sizes = {
        0: OutputSize(100, 10 << 20),
        7: OutputSize(9_000, 3_500 << 20),
        9: OutputSize(900, 90 << 20),
    }
    with pytest.raises(gpushuffle.ShuffleOutputTooLargeError) as info:
        _check(sizes)
    message = str(info.value)
    assert "output partition 7 holds 3.42 GiB (9,000 rows, 90% of the rows" in message
    assert "more than 75% of the limit (4.00 GiB)" in message
    assert "salt" in message and "npartitions" in message and "more memory" in message
    assert isinstance(info.value, gpushuffle.ShuffleMemoryError)


def test_what_the_worker_holds_already_counts():
    sizes = {0: OutputSize(10, 1 << 20), 3: OutputSize(500, 2 * GiB)}
    _check(sizes, held=GiB // 2)  # 2.5 of 3 GiB allowed
    with pytest.raises(gpushuffle.ShuffleOutputTooLargeError, match=r"with the 1\.00 GiB"):
        _check(sizes, held=GiB + 1)


def test_partitions_that_fit_but_take_most_memory_are_warned_about(caplog):
    sizes = {0: OutputSize(10, 1 << 20), 3: OutputSize(500, int(2.5 * GiB))}
    with caplog.at_level(logging.WARNING, logger="gpushuffle.engine.outputs"):
        _check(sizes)
    (record,) = caplog.records
    assert "output partition 3" in record.getMessage() and "it fits" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpushuffle.engine.outputs"):
        _check({0: OutputSize(10, 1 << 20)})
    assert not caplog.records


def test_the_check_can_be_turned_off():
    _check({0: OutputSize(1, 10 * GiB)}, fail_at=0)


def test_a_hot_key_too_large_for_its_worker_fails_the_shuffle_clearly(client):
    """On a cluster, with the limit scaled down (output-fail): the shuffle
    fails with the error, and nothing is left on the workers."""
    rng = np.random.default_rng(35)
    n = 200_000
    key = rng.integers(0, 10_000, n)
    key[rng.random(n) < 0.6] = 7  # 60% of the rows on one key
    pdf = pd.DataFrame({"key": key, "x": rng.random(n)})
    df = dd.from_pandas(pdf, npartitions=4, sort=False)
    # A limit below what any worker holds: the plumbing, from the first
    # unpack to the user (test_scale.py has a real worker limit).
    client.run(lambda: dask.config.set({"gpushuffle.memory.output-fail": 1e-6}))
    try:
        with pytest.raises(gpushuffle.ShuffleOutputTooLargeError, match="output partition"):
            df.shuffle("key", npartitions=8, shuffle_method="gpushuffle").compute()
    finally:
        client.run(lambda: dask.config.set({"gpushuffle.memory.output-fail": 0.9}))
    assert_nothing_left_behind(client)
    # The same shuffle with the default limit goes through.
    out = df.shuffle("key", npartitions=8, shuffle_method="gpushuffle").compute()
    assert len(out) == n
