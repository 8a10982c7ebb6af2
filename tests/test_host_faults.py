"""Faults of a host on the rig of hosts (benchmarks/rig.py): a host killed
mid-transfer, a link that drops every packet for 5 s, a link 100x slower
than the others; ``p2p`` runs the same faults beside gpushuffle as the
control where the scenario allows.  None may cost a row or hang the shuffle.

Needs root and iproute2, as tests/test_hosts.py (whose rig helpers these
share); a module of its own so that test_hosts.py's rigs are gone first.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import pandas as pd
import pytest
from distributed import Client, wait
from faults import assert_correct, frame, truth
from test_hosts import RIG_ENV, _links, pytestmark  # noqa: F401  (skips as test_hosts)

import gpushuffle
from benchmarks.rig import Rig

#: No fault test may wait longer than this for its shuffle.
FAULT_LIMIT_S = 120

NIN, ROWS, NOUT = 12, 100_000, 9


def _start(client: Client, method: str, rows: int = ROWS):
    shuffled = frame(NIN, rows).shuffle("key", npartitions=NOUT, shuffle_method=method)
    return client.compute(shuffled.to_delayed())


def _when_crossed(rig: Rig, nbytes: int, futures) -> None:
    """Wait until ``nbytes`` more have crossed the links (mid-transfer), within limits."""
    before = sum(s for s, _ in _links(rig))
    deadline = time.monotonic() + 60
    while sum(s for s, _ in _links(rig)) - before < nbytes:
        assert time.monotonic() < deadline, "the shuffle never got going"
        time.sleep(0.02)
    assert not all(f.done() for f in futures), "the shuffle ended before the fault"


def _scheduler_tasks(dask_scheduler) -> list[str]:
    """Each task group's tasks by state, and where the processing ones run."""
    from dask.utils import key_split

    states = Counter(
        (key_split(key), ts.state, ts.processing_on.address if ts.processing_on else "")
        for key, ts in dask_scheduler.tasks.items()
    )
    return [f"{n} {group} {state} {where}".rstrip() for (group, state, where), n in states.items()]


def _hang_report(rig: Rig, client: Client) -> str:
    """What a hang left behind: the scheduler's tasks and the end of each host's log."""
    lines = [" ", "scheduler tasks:", *client.run_on_scheduler(_scheduler_tasks)]
    for name in ["scheduler", *(f"host{i}" for i in range(len(rig.hosts)))]:
        lines += [f"--- the end of {name}.log ---", rig.log(name)[-3000:]]
    return "\n".join(lines)


def _gather_within(rig: Rig, client: Client, futures, seconds: float) -> list[pd.DataFrame]:
    try:
        wait(futures, timeout=seconds)
    except TimeoutError:
        pytest.fail(
            f"the shuffle hung: not done {seconds:.0f} s after the fault{_hang_report(rig, client)}"
        )
    return client.gather(futures)


def _mid_transfer(rig: Rig, client: Client, method: str) -> list:
    """A shuffle started and 4 MiB across the links: where each fault lands."""
    truth(NIN, ROWS, NOUT)  # computed (and cached) before the clock starts
    futures = _start(client, method)
    _when_crossed(rig, 4 << 20, futures)
    return futures


def _assert_finishes_right(rig: Rig, client: Client, futures) -> None:
    assert_correct(_gather_within(rig, client, futures, FAULT_LIMIT_S), truth(NIN, ROWS, NOUT))


@pytest.fixture
def fault_rig() -> Iterator[tuple[Rig, Client]]:
    # 30 Mbit/s per host: the transfer takes seconds, so a fault lands in it.
    with Rig((1, 1, 1), rate="30mbit", env=RIG_ENV) as rig, Client(rig.scheduler_address) as c:
        yield rig, c


@pytest.mark.parametrize("method", ["gpushuffle", "p2p"])
def test_a_host_killed_mid_transfer(fault_rig, method):
    rig, client = fault_rig
    futures = _mid_transfer(rig, client, method)
    rig.kill_host(2)
    _assert_finishes_right(rig, client, futures)
    assert len(client.nthreads()) == 2


@pytest.mark.parametrize("method", ["gpushuffle", "p2p"])
def test_a_link_that_drops_every_packet_for_5s(fault_rig, method):
    rig, client = fault_rig
    futures = _mid_transfer(rig, client, method)
    with rig.cut(1):
        sent = rig.link_bytes(1)[0]
        time.sleep(5)
        # Nothing crossed while cut (the bucket may still have sent what it held).
        assert rig.link_bytes(1)[0] - sent < 256 << 10
    _assert_finishes_right(rig, client, futures)
    assert len(client.nthreads()) == 3


def test_a_straggler_link_completes_and_shows_in_the_statistics(fault_rig):
    rig, client = fault_rig
    rig.shape(0, "1gbit")
    rig.shape(1, "1gbit")
    rig.shape(2, "10mbit")  # 100x slower than the others
    rows = ROWS // 2  # 4 MB each way over the slow link: 3-4 s
    expected = truth(NIN, rows, NOUT)
    before = gpushuffle.peer_statistics(client)
    futures = _start(client, "gpushuffle", rows)
    parts = _gather_within(rig, client, futures, FAULT_LIMIT_S)
    assert_correct(parts, expected)
    traffic = gpushuffle.peer_statistics(client)
    traffic = traffic.sub(before.reindex(traffic.index).fillna(0))
    rate = traffic["bytes"] / traffic["seconds"]
    hosts = {w: rig.host_of(w) for w in traffic.index.get_level_values("worker")}
    straggler = [(w, p) for w, p in traffic.index if hosts[w] == 2 or rig.host_of(p) == 2]
    others = [pair for pair in traffic.index if pair not in straggler]
    # Every send to or from the slow host ran slower than every other send.
    assert rate[straggler].max() < rate[others].min(), traffic


@pytest.fixture
def quick_to_give_up_rig() -> Iterator[tuple[Rig, Client]]:
    # A connection whose bytes go unacknowledged for 12 s is dropped
    # (distributed.comm.timeouts.tcp, 30 s by default; at least 11 s, its
    # keepalive probes' count + 1), in every process.
    env = {**RIG_ENV, "DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP": "12s"}
    with Rig((1, 1, 1), rate="30mbit", env=env) as rig, Client(rig.scheduler_address) as c:
        yield rig, c


@pytest.mark.parametrize("method", ["gpushuffle", "p2p"])
def test_a_link_cut_for_good(quick_to_give_up_rig, method):
    """The host behind it is lost to the cluster once distributed's TCP
    timeout passes; the shuffle restarts on the others and completes."""
    rig, client = quick_to_give_up_rig
    futures = _mid_transfer(rig, client, method)
    with rig.cut(1):
        _assert_finishes_right(rig, client, futures)
        workers = client.nthreads()
        assert sorted(rig.host_of(w) for w in workers) == [0, 2]
