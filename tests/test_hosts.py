"""Across hosts: each host a network and PID namespace of its own (benchmarks/rig.py).

Workers on one host read each other's shards (same-host reads); shards for
another host cross its link, which ``tc`` shapes.  The outputs must equal
dask's ``tasks`` shuffle partition by partition whatever the topology, and
a host that dies, a link that drops every packet for a while, or a link far
slower than the others must not cost a row or hang the shuffle; ``p2p``
runs the same faults beside gpushuffle as the control.

Needs root and iproute2; elsewhere these tests skip with the reason (CI
runs as root and sets GPUSHUFFLE_REQUIRE_RIG=1, which makes that a failure).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import dask
import dask.dataframe as dd
import pandas as pd
import pytest
from distributed import Client, wait
from faults import assert_correct, frame, make_part, truth
from truth import checksum

import gpushuffle
from benchmarks.rig import Rig, unusable

WHY = unusable()
if WHY and os.environ.get("GPUSHUFFLE_REQUIRE_RIG"):
    raise RuntimeError(f"GPUSHUFFLE_REQUIRE_RIG is set, but no rig of hosts here: {WHY}")
pytestmark = [
    pytest.mark.hosts,
    pytest.mark.skipif(WHY is not None, reason=f"rig of hosts: {WHY}"),
]

TESTS = os.path.dirname(os.path.abspath(__file__))
#: Workers import the tests' helpers (make_part) like the client does.
RIG_ENV = {"PYTHONPATH": os.pathsep.join([TESTS, os.path.dirname(TESTS)])}
#: No fault test may wait longer than this for its shuffle.
FAULT_LIMIT_S = 120


@pytest.fixture(scope="module", params=[(2, 2), (1, 1, 1)], ids=["2x2", "3x1"])
def rig_client(request) -> Iterator[tuple[Rig, Client]]:
    with Rig(request.param, rate="1gbit", env=RIG_ENV) as rig, Client(rig.scheduler_address) as c:
        yield rig, c


def _wire(client: Client) -> pd.DataFrame:
    stats = gpushuffle.statistics(client)
    return stats[["wire_bytes_sent", "wire_bytes_lent", "wire_bytes_read_from_peers"]]


def _links(rig: Rig) -> list[tuple[int, int]]:
    return [rig.link_bytes(i) for i in range(len(rig.hosts))]


def _by_partition(collection: dd.DataFrame) -> list[pd.DataFrame]:
    return list(dask.compute(*collection.to_delayed()))


def _same(ours: list[pd.DataFrame], theirs: list[pd.DataFrame]) -> None:
    """Partition by partition, the same rows (row order within a partition aside)."""
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert len(a) == len(b), f"partition {i}: {len(a)} rows, tasks has {len(b)}"
        a, b = a.reset_index(drop=True), b.reset_index(drop=True)
        assert checksum(a, index=False) == checksum(b[a.columns], index=False), f"partition {i}"


def test_shuffle_across_hosts_equals_tasks_and_counts_each_path(rig_client):
    rig, client = rig_client
    # Shards of over LEND_MIN_BYTES per column, so that same-host reads apply.
    nin, rows, nout = 8, 100_000, 7
    wire_before, links_before = _wire(client), _links(rig)
    shuffled = frame(nin, rows).shuffle("key", npartitions=nout, shuffle_method=gpushuffle.METHOD)
    # Kept on the workers until the links are read: gathering crosses them too.
    shuffled = client.persist(shuffled)
    wait(shuffled)
    links = [(s - s0, r - r0) for (s, r), (s0, r0) in zip(_links(rig), links_before, strict=True)]
    assert_correct(_by_partition(shuffled), truth(nin, rows, nout))

    wire = _wire(client) - wire_before
    hosts = pd.Series({w: rig.host_of(w) for w in wire.index})
    lent = wire["wire_bytes_lent"].groupby(hosts).sum()
    across = (wire["wire_bytes_sent"] - wire["wire_bytes_lent"]).groupby(hosts).sum()
    read = wire["wire_bytes_read_from_peers"].groupby(hosts).sum()
    # Inside a host, what was lent was read, and nothing else: workers of
    # different hosts never read each other's memory.
    assert (lent == read).all(), (lent, read)
    if max(rig.hosts) > 1:
        assert (lent > 0).all(), "workers on one host did not read each other's shards"
    else:
        assert (lent == 0).all()
    # Across, every host's shards for other hosts crossed its link: the link
    # carried them (shards count their tables' in-memory bytes, a little
    # more than their frames), plus framing, task traffic and TCP's headers.
    for host, (sent, _received) in enumerate(links):
        assert across[host] > 0
        assert 0.8 * across[host] <= sent <= 1.5 * across[host] + (4 << 20), (host, sent, across)


def test_merge_across_hosts_equals_tasks(rig_client):
    _, _client = rig_client
    left = frame(6, 10_000)
    right = frame(4, 5_000)[["key", "x", "s"]].rename(columns={"x": "y", "s": "t"})
    ours = _by_partition(left.merge(right, on="key", how="left", shuffle_method="gpushuffle"))
    tasks = _by_partition(left.merge(right, on="key", how="left", shuffle_method="tasks"))
    _same(ours, tasks)
    expected = pd.concat([make_part(i, 10_000) for i in range(6)]).merge(
        pd.concat([make_part(i, 5_000) for i in range(4)])[["key", "x", "s"]].rename(
            columns={"x": "y", "s": "t"}
        ),
        on="key",
        how="left",
    )
    assert sum(map(len, ours)) == len(expected)


def test_groupby_split_out_across_hosts_equals_tasks(rig_client):
    _, _client = rig_client
    df = frame(8, 20_000)

    def grouped(method: str) -> dd.DataFrame:
        return df.groupby("key").agg({"x": "sum", "n": "count"}, split_out=5, shuffle_method=method)

    ours, tasks = _by_partition(grouped("gpushuffle")), _by_partition(grouped("tasks"))
    _same(ours, tasks)
    whole = pd.concat([make_part(i, 20_000) for i in range(8)])
    assert sum(map(len, ours)) == whole["key"].nunique()


# -- faults of a host ------------------------------------------------------------

NIN, ROWS, NOUT = 12, 100_000, 9


def _start(client: Client, method: str):
    shuffled = frame(NIN, ROWS).shuffle("key", npartitions=NOUT, shuffle_method=method)
    return client.compute(shuffled.to_delayed())


def _when_crossed(rig: Rig, nbytes: int, futures) -> None:
    """Wait until ``nbytes`` more have crossed the links (mid-transfer), within limits."""
    before = sum(s for s, _ in _links(rig))
    deadline = time.monotonic() + 60
    while sum(s for s, _ in _links(rig)) - before < nbytes:
        assert time.monotonic() < deadline, "the shuffle never got going"
        time.sleep(0.02)
    assert not all(f.done() for f in futures), "the shuffle ended before the fault"


def _gather_within(client: Client, futures, seconds: float) -> list[pd.DataFrame]:
    start = time.monotonic()
    done = wait(futures, timeout=seconds, return_when="ALL_COMPLETED")
    assert not done.not_done, f"the shuffle hung: not done {seconds:.0f} s after the fault"
    assert time.monotonic() - start < seconds
    return client.gather(futures)


@pytest.fixture
def fault_rig() -> Iterator[tuple[Rig, Client]]:
    # 30 Mbit/s per host: the transfer takes seconds, so a fault lands in it.
    with Rig((1, 1, 1), rate="30mbit", env=RIG_ENV) as rig, Client(rig.scheduler_address) as c:
        yield rig, c


@pytest.mark.parametrize("method", ["gpushuffle", "p2p"])
def test_a_host_killed_mid_transfer(fault_rig, method):
    rig, client = fault_rig
    expected = truth(NIN, ROWS, NOUT)
    futures = _start(client, method)
    _when_crossed(rig, 4 << 20, futures)
    rig.kill_host(2)
    parts = _gather_within(client, futures, FAULT_LIMIT_S)
    assert_correct(parts, expected)
    assert len(client.scheduler_info()["workers"]) == 2


@pytest.mark.parametrize("method", ["gpushuffle", "p2p"])
def test_a_link_that_drops_every_packet_for_5s(fault_rig, method):
    rig, client = fault_rig
    expected = truth(NIN, ROWS, NOUT)
    futures = _start(client, method)
    _when_crossed(rig, 4 << 20, futures)
    with rig.cut(1):
        sent = rig.link_bytes(1)[0]
        time.sleep(5)
        # Nothing crossed while cut (the bucket may still have sent what it held).
        assert rig.link_bytes(1)[0] - sent < 256 << 10
    parts = _gather_within(client, futures, FAULT_LIMIT_S)
    assert_correct(parts, expected)
    assert len(client.scheduler_info()["workers"]) == 3


def test_a_straggler_link_completes_and_shows_in_the_statistics(fault_rig):
    rig, client = fault_rig
    rig.shape(0, "1gbit")
    rig.shape(1, "1gbit")
    rig.shape(2, "10mbit")  # 100x slower than the others
    expected = truth(NIN, ROWS, NOUT)
    before = gpushuffle.peer_statistics(client)
    futures = _start(client, "gpushuffle")
    parts = _gather_within(client, futures, FAULT_LIMIT_S)
    assert_correct(parts, expected)
    traffic = gpushuffle.peer_statistics(client)
    traffic = traffic.sub(before.reindex(traffic.index).fillna(0))
    rate = traffic["bytes"] / traffic["seconds"]
    hosts = {w: rig.host_of(w) for w in traffic.index.get_level_values("worker")}
    straggler = [(w, p) for w, p in traffic.index if hosts[w] == 2 or rig.host_of(p) == 2]
    others = [pair for pair in traffic.index if pair not in straggler]
    # Every send to or from the slow host ran slower than every other send.
    assert rate[straggler].max() < rate[others].min(), traffic
