"""Comm faults: sends retried like p2p's, failures naming the peer, stalled peers bounded.

A worker's ``shuffle_receive`` handler (the endpoint every shard message
goes to) is replaced by one that fails or stalls: the sender sees what it
would see from a broken or unresponsive peer, over real TCP comms.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from faults import (
    assert_correct,
    assert_scheduler_clean,
    assert_workers_clean,
    cluster_test,
    gpushuffled,
    truth,
    wait_for,
)

import gpushuffle
from gpushuffle.engine.memory import reset_worker_memory

pytestmark = pytest.mark.timeout(180)

NIN, ROWS, NOUT = 12, 3000, 8

FAST_RETRIES = {
    "distributed.p2p.comm.retry.delay.min": "10ms",
    "distributed.p2p.comm.retry.delay.max": "50ms",
}


@pytest.fixture(autouse=True)
def _process_state():
    reset_worker_memory()
    yield
    reset_worker_memory()


class FaultyReceive:
    """Replaces ``worker``'s ``shuffle_receive``: fails its first ``failures`` calls.

    ``after_receive``: the shards are stored first and the reply is lost, so
    the sender's retry delivers them a second time.  ``stall``: the handler
    never answers (until ``release()``).
    """

    def __init__(
        self, worker: Any, failures: int, after_receive: bool = False, stall: bool = False
    ) -> None:
        self.original = worker.handlers["shuffle_receive"]
        self.failures = failures
        self.after_receive = after_receive
        self.stall = stall
        self.failed = 0
        self.succeeded = 0
        self.first_call: float | None = None
        self._release = asyncio.Event()
        worker.handlers["shuffle_receive"] = self.receive

    async def receive(self, **kwargs: Any) -> Any:
        if self.first_call is None:
            self.first_call = time.monotonic()
        if self.failed < self.failures:
            self.failed += 1
            if self.stall:
                await self._release.wait()
                raise OSError("injected: released after the test")
            if self.after_receive:
                response = await self.original(**kwargs)
                assert response["status"] == "OK"
            raise OSError("injected: connection reset by peer")
        self.succeeded += 1
        return await self.original(**kwargs)

    def release(self) -> None:
        self._release.set()


def release(futures: list) -> None:
    """Let go of erred futures: a failed shuffle's runs live until then, as p2p's do.

    (``del`` is not enough: the raised exception's traceback holds them.)
    """
    for future in futures:
        future.release()


async def parts_of(c: Any, collection: Any) -> list:
    return await c.gather(c.compute(collection.to_delayed()))


@pytest.mark.parametrize("after_receive", [False, True], ids=["lost-request", "lost-reply"])
@cluster_test(
    n_workers=2,
    config={**FAST_RETRIES, "distributed.p2p.comm.retry.count": 3},
)
async def test_failed_sends_are_retried(c, s, a, b, after_receive):
    """Sends that fail with OSError are retried; shards delivered twice count once."""
    faulty = FaultyReceive(b, failures=3, after_receive=after_receive)
    parts = await parts_of(c, gpushuffled(NIN, ROWS, NOUT))
    assert faulty.failed == 3  # the faults happened ...
    assert faulty.succeeded > 0  # ... and the retries got through
    assert_correct(parts, truth(NIN, ROWS, NOUT))
    await assert_workers_clean(c)
    await c.close()
    await assert_scheduler_clean(s)


@cluster_test(
    n_workers=2,
    config={**FAST_RETRIES, "distributed.p2p.comm.retry.count": 2},
)
async def test_send_that_finally_fails_names_the_peer(c, s, a, b):
    faulty = FaultyReceive(b, failures=10**9)
    futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
    with pytest.raises(gpushuffle.ShuffleCommError) as info:
        await c.gather(futures)
    message = str(info.value)
    release(futures)
    assert f"to {b.address} failed after 2 retries" in message
    assert "distributed.p2p.comm.retry.count" in message
    assert "injected: connection reset by peer" in message
    assert faulty.failed >= 3  # one try and two retries of a message
    assert faulty.succeeded == 0
    await assert_workers_clean(c)
    await c.close()
    await assert_scheduler_clean(s)


@cluster_test(
    n_workers=2,
    config={
        **FAST_RETRIES,
        "distributed.p2p.comm.retry.count": 1,
        "gpushuffle.comm.timeout": "2s",
    },
)
async def test_stalled_peer_fails_the_shuffle_in_bounded_time(c, s, a, b):
    """A peer that never answers fails the shuffle after about (retries + 1) x timeout."""
    faulty = FaultyReceive(b, failures=10**9, stall=True)
    try:
        futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
        with pytest.raises(gpushuffle.ShuffleCommError) as info:
            await c.gather(futures)
        assert faulty.first_call is not None
        elapsed = time.monotonic() - faulty.first_call
        message = str(info.value)
        release(futures)
        assert f"to {b.address} failed after 1 retries" in message
        assert "2 s (gpushuffle.comm.timeout)" in message
        assert "TimeoutError" in message
        # Two tries of 2 s each, and not much more: the bound is the config.
        # Timed from the peer's first receive, which starts a little after
        # the sender's first try did (seen: 3.99992 s), so the lower bound
        # has slack; one try alone would take about 2 s.
        assert 3.5 <= elapsed < 15, elapsed
    finally:
        faulty.release()
    await assert_workers_clean(c)
    await c.close()
    await assert_scheduler_clean(s)


@cluster_test(n_workers=2)
async def test_cancelled_shuffle_stops_its_sends_at_once(c, s, a, b):
    """A closing run does not wait for sends in flight (here to a peer that never answers).

    Otherwise the run, and the shards it holds, would stay until the send
    timed out (gpushuffle.comm.timeout, 120 s) and its retries gave up.
    """
    faulty = FaultyReceive(b, failures=10**9, stall=True)
    try:
        futures = c.compute(gpushuffled(NIN, ROWS, NOUT).to_delayed())
        await wait_for(lambda: faulty.failed > 0, what="a send to reach b")
        start = time.monotonic()
        release(futures)  # the scheduler forgets the shuffle; workers close its runs
        await assert_workers_clean(c, timeout=10)
        assert time.monotonic() - start < 10
    finally:
        faulty.release()
    await c.close()
    await assert_scheduler_clean(s)


def test_peer_errors_are_rebuilt_from_the_schedulers_text():
    """The barrier's error as distributed's scheduler words it, quotes and all."""
    from gpushuffle.engine.tasks import _error_of_a_peer

    message = 'gpushuffle x: sending to tcp://10.0.0.2:4001 failed: OSError: can\'t "connect"'
    for cls in (gpushuffle.ShuffleCommError, gpushuffle.ShuffleMemoryError):
        # The scheduler only has the worker's exception as text (Exception(repr(e))).
        from_scheduler = RuntimeError(
            f"Unexpected error encountered during P2P barrier: {Exception(repr(cls(message)))!r}"
        )
        rebuilt = _error_of_a_peer(from_scheduler)
        assert type(rebuilt) is cls
        assert str(rebuilt) == message
    for other in (
        RuntimeError("Worker ['tcp://10.0.0.2:4001'] left during shuffle"),
        RuntimeError(f"Unexpected error ...: {Exception(repr(KeyError('k')))!r}"),
        RuntimeError("Unexpected error ...: Exception(not a literal)"),
    ):
        assert _error_of_a_peer(other) is None
