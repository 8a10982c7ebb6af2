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
from collections.abc import Iterator

import dask.dataframe as dd
import pandas as pd
import pytest
from distributed import Client, wait
from faults import assert_correct, frame, make_part, truth
from truth import checksum, partitions_of

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


@pytest.fixture(scope="module", params=[(2, 2), (1, 1, 1)], ids=["2x2", "3x1"])
def rig_client(request) -> Iterator[tuple[Rig, Client]]:
    with Rig(request.param, rate="1gbit", env=RIG_ENV) as rig, Client(rig.scheduler_address) as c:
        yield rig, c


def _wire(client: Client) -> pd.DataFrame:
    stats = gpushuffle.statistics(client)
    return stats[
        [
            "wire_bytes_sent",
            "wire_bytes_lent",
            "wire_bytes_read_from_peers",
            "wire_compressed_raw_bytes",
            "wire_compressed_bytes",
        ]
    ]


def _links(rig: Rig) -> list[tuple[int, int]]:
    return [rig.link_bytes(i) for i in range(len(rig.hosts))]


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
    assert_correct(partitions_of(shuffled), truth(nin, rows, nout))

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
    # more than their frames), compressed where gpushuffle.comm.compression
    # chose to, plus framing, task traffic and TCP's headers.
    saved = (wire["wire_compressed_raw_bytes"] - wire["wire_compressed_bytes"]).groupby(hosts).sum()
    on_wire = across - saved
    for host, (sent, _received) in enumerate(links):
        assert across[host] > 0
        assert 0.8 * on_wire[host] <= sent <= 1.5 * on_wire[host] + (4 << 20), (host, sent, on_wire)


def test_merge_across_hosts_equals_tasks(rig_client):
    _, _client = rig_client
    left = frame(6, 10_000)
    right = frame(4, 5_000)[["key", "x", "s"]].rename(columns={"x": "y", "s": "t"})
    ours = partitions_of(left.merge(right, on="key", how="left", shuffle_method="gpushuffle"))
    tasks = partitions_of(left.merge(right, on="key", how="left", shuffle_method="tasks"))
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

    ours, tasks = partitions_of(grouped("gpushuffle")), partitions_of(grouped("tasks"))
    _same(ours, tasks)
    whole = pd.concat([make_part(i, 20_000) for i in range(8)])
    assert sum(map(len, ours)) == whole["key"].nunique()


def test_a_slow_link_carries_compressed_shards_and_the_same_rows():
    """``gpushuffle.comm.compression: auto`` across a 50 Mbit/s link: the
    link (its kernel counters) carries fewer bytes than the shards hold,
    every compressed frame is decompressed by the other host, and every
    output partition equals ``tasks``'."""
    nin, rows, nout = 8, 100_000, 7
    # A short back-pressure threshold: this link never holds a second of
    # these (compressed) shards.
    env = {**RIG_ENV, "DASK_GPUSHUFFLE__COMM__LINK_BACKLOG": "100ms"}
    with Rig((1, 1), rate="50mbit", env=env) as rig, Client(rig.scheduler_address) as client:
        # The link's rate is measured from its first sends: a first shuffle.
        warm = frame(2, rows).shuffle("key", npartitions=3, shuffle_method="gpushuffle")
        wait(client.persist(warm))
        before, links_before = gpushuffle.statistics(client), _links(rig)
        shuffled = frame(nin, rows).shuffle("key", npartitions=nout, shuffle_method="gpushuffle")
        shuffled = client.persist(shuffled)
        wait(shuffled)
        links = [s - s0 for (s, _), (s0, _) in zip(_links(rig), links_before, strict=True)]
        assert_correct(partitions_of(shuffled), truth(nin, rows, nout))
        stats = gpushuffle.statistics(client) - before
    total = stats.sum()
    assert total["wire_compressed_frames"] > 0, total
    assert total["wire_decompressed_frames"] == total["wire_compressed_frames"], total
    # Keys, row numbers, short strings and small integers compress; the
    # random doubles do not (sent raw after their probe).
    assert total["wire_compressed_bytes"] < 0.5 * total["wire_compressed_raw_bytes"], total
    assert sum(links) < 0.75 * total["wire_bytes_sent"], (links, total["wire_bytes_sent"])
    # Transfer tasks waited for the link (gpushuffle.comm.link-backlog)
    # rather than queue all of it.
    assert total["wire_transfers_held"] > 0 and total["wire_transfers_held_ns"] > 0, total
