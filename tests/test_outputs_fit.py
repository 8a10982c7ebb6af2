"""An output partition too large for its worker fails at the barrier, saying why."""

from __future__ import annotations

import logging

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from conftest import assert_nothing_left_behind

import gpushuffle
from gpushuffle.engine.outputs import FitBudget, OutputSize, build_need, check_outputs_fit, fits

pytestmark = pytest.mark.timeout(180)

GiB = 2**30


def _no_overhead(size):
    return 0


def _check(sizes, limit=4 * GiB, base=0, fail_at=0.75, warn_at=0.5, overhead=_no_overhead):
    budget = FitBudget(limit=limit, base=base, fail_at=fail_at, warn_at=warn_at, memory="the limit")
    check_outputs_fit(sizes, budget, overhead, where="abc on w")


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
    assert "more than the 75% it may take" in message and "the limit (4.00 GiB)" in message
    assert "salt" in message and "npartitions" in message and "more memory" in message
    assert isinstance(info.value, gpushuffle.ShuffleMemoryError)


def test_the_workers_base_counts_and_the_numbers_are_in_the_error():
    sizes = {0: OutputSize(10, 1 << 20), 3: OutputSize(500, 2 * GiB)}
    _check(sizes, base=GiB // 2)  # 2.5 of 3 GiB allowed
    with pytest.raises(gpushuffle.ShuffleOutputTooLargeError) as info:
        _check(sizes, base=GiB + 1)
    message = str(info.value)
    assert (
        "the 1.00 GiB the worker needs besides (gpushuffle.memory.worker-reserve): "
        "3.00 GiB, 75% of the limit" in message
    )


def test_what_assembling_holds_beyond_the_output_counts():
    """The backend's overhead (a piece beside the output, concatenated
    columns twice) is part of the need: a partition that fits on its own
    does not with it."""
    sizes = {3: OutputSize(500, 2 * GiB, largest_piece=64 << 20, concat_bytes=GiB)}
    _check(sizes)
    with pytest.raises(gpushuffle.ShuffleOutputTooLargeError, match=r"1\.06 GiB more while"):
        _check(sizes, overhead=lambda s: s.largest_piece + s.concat_bytes)


def test_the_pandas_backend_budgets_concatenated_columns_twice():
    """Fixed-width columns fill the output in place; strings and objects are
    concatenated at the end (held twice for a moment)."""
    from gpushuffle.backends.pandas import PandasBackend, PandasTable
    from gpushuffle.engine.tables import ASSEMBLY_SLACK

    backend = PandasBackend()
    n = 1000
    numbers = np.arange(n, dtype=np.int64)
    strings = pd.array([f"s{i:05d}" for i in range(n)], dtype=pd.ArrowDtype(pa.string()))
    table = PandasTable([numbers, strings], numbers.copy())
    assert backend.concat_nbytes(table) == strings.nbytes
    assert backend.concat_nbytes(PandasTable([numbers], numbers)) == 0
    size = OutputSize(n, 10 << 20, largest_piece=1 << 20, concat_bytes=strings.nbytes)
    assert backend.assembly_overhead(size) == (1 << 20) + strings.nbytes + ASSEMBLY_SLACK


def test_verdicts_are_a_rule_on_sizes():
    """fits() agrees with the error: the same sizes give the same verdict."""
    size = OutputSize(10, 600 << 20, largest_piece=30 << 20)
    budget = FitBudget(limit=GiB, base=180 << 20, fail_at=0.9, warn_at=0.5, memory="m")

    def overhead(s):
        return s.largest_piece

    assert fits(size, budget, overhead)
    assert build_need(size, budget, overhead) == (810 << 20)
    assert not fits(OutputSize(10, 720 << 20, largest_piece=30 << 20), budget, overhead)


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


def test_the_verdicts_numbers_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="gpushuffle.engine.outputs"):
        _check({3: OutputSize(500, GiB)}, base=GiB // 4)
    (record,) = caplog.records
    assert "the largest output fits" in record.getMessage()
    assert (
        "256 MiB the worker needs besides (gpushuffle.memory.worker-reserve): 1.25 GiB, 31%"
        in record.getMessage()
    )


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


def _device_share(share: int) -> None:
    """On a worker: the device share its runs judge outputs by.  (A test
    double: no GPU exists here; the device tier is the labelled CPU stand-in
    of tests/device_stand_in.py.)"""
    from gpushuffle.engine.memory import worker_memory

    memory = worker_memory()
    memory.device_share = share
    memory.device_known = True


@pytest.mark.parametrize("share_mib, built", [(1024, True), (32, False)])
def test_device_outputs_are_judged_by_the_same_rule(share_mib, built):
    """The device tier (the CPU stand-in) is judged by the same rule: the
    device memory the worker's stores hold, the partition and the backend's
    assembly overhead (everything concatenated, as cuDF's), against
    output-fail of the worker's share of device memory."""
    from device_stand_in import stand_in_device
    from test_memory import cluster_with

    rng = np.random.default_rng(40)
    n = 300_000
    key = rng.integers(0, 10_000, n)
    key[rng.random(n) < 0.8] = 7  # 80% of the rows (about 10 MiB) on one key
    pdf = pd.DataFrame({"key": key, "x": rng.random(n), "y": rng.integers(0, 9, n)})
    df = dd.from_pandas(pdf, npartitions=4, sort=False)
    with cluster_with({}) as client:
        client.run(_device_share, share_mib << 20)
        with stand_in_device(client):
            shuffled = df.shuffle("key", npartitions=4, shuffle_method="gpushuffle")
            if built:
                assert len(shuffled.compute()) == n
                return
            with pytest.raises(gpushuffle.ShuffleOutputTooLargeError) as info:
                shuffled.compute()
    message = str(info.value)
    assert "this worker's share of device memory (32 MiB)" in message, message
    assert "the device memory its shuffles' stores hold" in message, message
