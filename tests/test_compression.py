"""Shards compressed for the wire (gpushuffle.codecs) and the choice per link
(gpushuffle.engine.links).

Compressed shards must decode to the same rows for every column kind, on
the host tier (pandas) and on the CPU stand-in of the device tier; a damaged
frame or a failing codec is a clear error, never a wrong row; ``auto`` sends
columns that do not compress raw after one probe, and compresses nothing
where the link is fast or the cores are busy.  Across real hosts with shaped
links: tests/test_hosts.py.
"""

from __future__ import annotations

import contextlib

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from conftest import assert_nothing_left_behind
from device_stand_in import DeviceStandInBackend, StandInTable, stand_in_device
from distributed import Client
from test_memory import cluster_with
from test_pandas_backend import _ALL_KINDS, column
from test_shuffle import check, make_frame
from test_transport import _wire, wire_delta

import gpushuffle
from gpushuffle import codecs
from gpushuffle.backends.pandas import PandasBackend, PandasTable
from gpushuffle.engine import links
from gpushuffle.engine import run as run_module
from gpushuffle.engine.links import LinkMeter, LinkState, RunCompression

pytestmark = pytest.mark.timeout(180)

#: A link of 100 Mbit/s with CPU time free: every codec pays on real columns.
SLOW = LinkState(rate=12.5e6, cpu_price=1.0)


def every_kind(n: int = 20_000, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({f"c_{k}": column(k, n, rng) for k in _ALL_KINDS})
    df.index = pd.Index(np.arange(n) * 2, name="idx")
    return df


def _table(df: pd.DataFrame) -> PandasTable:
    values = [df[c].to_numpy() if isinstance(df[c].dtype, np.dtype) else df[c].array for c in df]
    return PandasTable(values, df.index, tuple(df.columns))


def _round_trip(backend, table, compression: RunCompression, state: LinkState = SLOW):
    header, frames = backend.serialize(table)
    sent, entries = codecs.encode_frames(frames, compression.compressor(state))
    assert entries is not None, "nothing was compressed"
    assert sum(codecs.frame_nbytes(f) for f in sent) < sum(codecs.frame_nbytes(f) for f in frames)
    received = [bytes(memoryview(f)) for f in sent]  # as a comm delivers them
    return backend.deserialize(header, codecs.decode_frames(entries, received, "a test shard"))


def _assembled(backend, table, meta: pd.DataFrame) -> pd.DataFrame:
    return backend.assemble([table], len(meta) if not len(table) else len(table), meta, True)


@pytest.mark.parametrize("mode", ["lz4", "zstd", "auto"])
def test_every_column_kind_decodes_to_the_same_rows(mode):
    df = every_kind()
    backend = PandasBackend()
    table = _round_trip(backend, _table(df), RunCompression(mode))
    out = backend.assemble([table], len(df), df.iloc[:0], True)
    pd.testing.assert_frame_equal(out, df)


@pytest.mark.parametrize("mode", ["lz4", "zstd"])
def test_the_device_tier_stand_in_decodes_to_the_same_rows(mode):
    # TEST DOUBLE: the CPU stand-in of the device tier (tests/device_stand_in.py);
    # nvCOMP's device codecs need a GPU (tests/test_gpu.py).
    df = make_frame(5000)
    backend = DeviceStandInBackend()
    pandas_table = _table(df)
    table = StandInTable(len(df), PandasBackend().nbytes(pandas_table), table=pandas_table)
    received = _round_trip(backend, table, RunCompression(mode))
    assert isinstance(received, StandInTable) and received.table is not None
    out = backend.assemble([received], len(df), df.iloc[:0], True)
    pd.testing.assert_frame_equal(out, df)


def _compressed(n: int = 200_000) -> tuple[list[bytes], list]:
    frame = np.arange(n, dtype=np.int64) // 7
    sent, entries = codecs.encode_frames([frame], RunCompression("zstd").compressor(SLOW))
    assert entries is not None and entries[0] is not None
    return [bytes(memoryview(sent[0]))], entries


def test_a_damaged_frame_is_refused_with_a_clear_error():
    frames, entries = _compressed()
    damaged = bytearray(frames[0])
    damaged[len(damaged) // 2] ^= 0xFF
    with pytest.raises(gpushuffle.ShuffleCodecError, match=r"checksum.*changed on the way"):
        codecs.decode_frames(entries, [bytes(damaged)], "the shard of input partition 3")
    with pytest.raises(gpushuffle.ShuffleCodecError, match="input partition 3"):
        codecs.decode_frames(entries, [bytes(damaged)], "the shard of input partition 3")
    with pytest.raises(gpushuffle.ShuffleCodecError, match="arrived with 0 frames"):
        codecs.decode_frames(entries, [], "a shard")


def test_a_codec_that_fails_or_returns_the_wrong_size_is_a_clear_error(monkeypatch):
    frames, entries = _compressed()
    lying = [[entries[0][0], entries[0][1] + 8, entries[0][2]]]
    with pytest.raises(gpushuffle.ShuffleCodecError, match="frame 0 of a shard"):
        codecs.decode_frames(lying, frames, "a shard")

    def broken(self, data, nbytes):
        raise RuntimeError("codec exploded")

    monkeypatch.setattr(codecs.HostCodec, "decompress", broken)
    with pytest.raises(gpushuffle.ShuffleCodecError, match=r"failed to decompress.*codec exploded"):
        codecs.decode_frames(entries, frames, "a shard")
    unknown = [["brotli-9000", entries[0][1], entries[0][2]]]
    with pytest.raises(gpushuffle.ShuffleCodecError, match="cannot be decoded on this worker"):
        codecs.decode_frames(unknown, frames, "a shard")


def test_auto_sends_a_column_that_does_not_compress_raw_after_one_probe():
    rng = np.random.default_rng(1)
    noise = rng.random(100_000)  # random doubles: 1.0-1.09x
    steady = np.arange(100_000, dtype=np.int64) // 3
    compression = RunCompression("auto")
    _, entries = codecs.encode_frames([noise, steady], compression.compressor(SLOW))
    assert entries is not None and entries[0] is None and entries[1] is not None
    probed = compression.slots()
    assert probed[(0, 2)].raw and not probed[(1, 2)].raw
    spent = {name: s.raw for name, s in probed[(0, 2)].codecs.items()}
    assert set(spent) == set(links.PRIORS), "the probe tries every codec once"
    # The next message: the noise slot costs no codec time at all.
    _, entries = codecs.encode_frames([noise * 2, steady + 1], compression.compressor(SLOW))
    assert entries is not None and entries[0] is None and entries[1] is not None
    after = compression.slots()
    assert {name: s.raw for name, s in after[(0, 2)].codecs.items()} == spent
    # On a slow link the better ratio wins: zstd.
    assert entries[1][0] == "zstd"


def test_auto_compresses_nothing_on_a_fast_link_or_on_busy_cores():
    compression = RunCompression("auto")
    steady = np.arange(100_000, dtype=np.int64) // 3
    codecs.encode_frames([steady], compression.compressor(SLOW))  # measured: it compresses well
    fast = LinkState(rate=1.25e9, cpu_price=1.0)  # 10 Gbit/s
    busy = LinkState(rate=125e6, cpu_price=links.MAX_CPU_PRICE)  # 1 Gbit/s, cores saturated
    for state in (fast, busy):
        assert compression.candidates(state) == []
        assert not compression.worth_encoding(state, 16 << 20)
        _, entries = codecs.encode_frames([steady], compression.compressor(state))
        assert entries is None
    assert compression.worth_encoding(SLOW, 16 << 20)
    # A message the encoder could not finish before the link ran dry is sent raw.
    assert not compression.worth_encoding(SLOW, 1 << 20, encoding_s=10.0)
    # Fixed codecs compress whatever the link.
    assert RunCompression("lz4").worth_encoding(fast, 1 << 20)


def test_a_bad_setting_names_the_key_and_the_choices():
    with pytest.raises(ValueError, match=r"gpushuffle.comm.compression: 'gzip'.*auto, none, lz4"):
        RunCompression("gzip")


def test_link_meter_counts_overlapping_sends_once():
    now = [0.0]
    meter = LinkMeter(clock=lambda: now[0])
    assert meter.rate() is None
    meter.started(4_000_000)
    now[0] = 0.5
    meter.started(2_000_000)  # overlaps the first
    assert meter.in_flight == 6_000_000 and meter.busy_for() == 0.5
    now[0] = 1.0
    meter.finished(4_000_000)
    now[0] = 2.0
    meter.finished(2_000_000)
    assert meter.rate() == pytest.approx(3_000_000)  # 6 MB in 2 s busy
    now[0] = 10.0  # idle time does not count
    meter.started(4_000_000)
    now[0] = 11.0
    meter.finished(4_000_000, delivered=False)  # a failed send times nothing
    assert meter.rate() == pytest.approx(3_000_000)
    meter.started(1000)
    now[0] = 12.0
    meter.finished(1000)  # a small message's time is its round trip, not the link's
    assert meter.rate() == pytest.approx(3_000_000)
    meter.started(3_000_000)
    now[0] = 13.0
    meter.finished(3_000_000)
    assert meter.rate() == pytest.approx(3_000_000)  # 9 MB in 3 s


def _shuffle_and_check(client: Client, pdf: pd.DataFrame) -> dict[str, dict[str, int]]:
    before = client.run(_wire)
    df = dd.from_pandas(pdf, npartitions=6, sort=False)
    check(
        df.shuffle("key", npartitions=5, shuffle_method="gpushuffle"),
        df.shuffle("key", npartitions=5, shuffle_method="tasks"),
        pdf,
    )
    delta = wire_delta(client, before)
    return {k: sum(d[k] for d in delta.values()) for k in next(iter(delta.values()))}


@pytest.mark.parametrize("device", [False, True], ids=["pandas", "device-stand-in"])
def test_shuffles_with_compression_equal_tasks(device):
    # Same-host reads off: shards travel over the comm, where a codec set by
    # name compresses them (auto would not, between workers on one host).
    settings = {"gpushuffle.comm.same-host-reads": False, "gpushuffle.comm.compression": "zstd"}
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(cluster_with(settings))
        stack.enter_context(stand_in_device(client) if device else contextlib.nullcontext())
        total = _shuffle_and_check(client, make_frame(60_000, seed=3))
    assert total["wire_compressed_frames"] > 0, total
    # Every frame compressed by one worker was decompressed by the other.
    assert total["wire_decompressed_frames"] == total["wire_compressed_frames"], total
    assert total["wire_compressed_bytes"] < total["wire_compressed_raw_bytes"] / 2, total


def test_auto_leaves_workers_on_one_host_uncompressed():
    with cluster_with({"gpushuffle.comm.same-host-reads": False}) as client:
        total = _shuffle_and_check(client, make_frame(60_000, seed=4))
    assert total["wire_shards_sent"] > 0 and total["wire_compressed_frames"] == 0, total


def _damage_what_this_worker_sends(dask_worker=None) -> None:
    """Frames this worker compresses arrive as if changed on the way: their
    checksums no longer match (a frame itself changed would be the same)."""
    from gpushuffle import codecs

    original = codecs.encode_frames

    def damaged(frames, compress):
        out, entries = original(frames, compress)
        if entries is not None:
            entries = [None if e is None else [e[0], e[1], e[2] ^ 1] for e in entries]
        return out, entries

    damaged.original = original  # type: ignore[attr-defined]
    codecs.encode_frames = damaged


def _repair(dask_worker=None) -> None:
    from gpushuffle import codecs

    codecs.encode_frames = getattr(codecs.encode_frames, "original", codecs.encode_frames)


def test_a_frame_damaged_on_a_live_cluster_fails_the_shuffle_clearly():
    with cluster_with(
        {"gpushuffle.comm.same-host-reads": False, "gpushuffle.comm.compression": "lz4"}
    ) as client:
        first = sorted(client.nthreads())[0]
        client.run(_damage_what_this_worker_sends, workers=[first])
        df = dd.from_pandas(make_frame(60_000, seed=5), npartitions=6, sort=False)
        with pytest.raises(
            gpushuffle.ShuffleCodecError, match=f"from {first}, .*does not match its checksum"
        ):
            df.shuffle("key", npartitions=5, shuffle_method="gpushuffle").compute()
        # The failed run freed what it held; the next shuffle is right.
        client.run(_repair)
        total = _shuffle_and_check(client, make_frame(20_000, seed=6))
        assert total["wire_compressed_frames"] > 0
        assert_nothing_left_behind(client)


def test_a_bad_setting_fails_the_shuffle_naming_it(client):
    df = dd.from_pandas(make_frame(2000), npartitions=4, sort=False)
    # Set where the graph is made: it fails there, before any task runs.
    with (
        dask.config.set({"gpushuffle.comm.compression": "gzip"}),
        pytest.raises(ValueError, match=r"gpushuffle\.comm\.compression: 'gzip'"),
    ):
        df.shuffle("key", npartitions=3, shuffle_method="gpushuffle").compute()
    # Set on the workers only: the transfer fails, naming it.
    client.run(lambda: dask.config.set({"gpushuffle.comm.compression": "gzip"}))
    try:
        with pytest.raises(RuntimeError, match=r"gpushuffle\.comm\.compression: 'gzip'"):
            df.shuffle("key", npartitions=3, shuffle_method="gpushuffle").compute()
    finally:
        client.run(lambda: dask.config.set({"gpushuffle.comm.compression": "auto"}))


def test_a_link_meter_outlives_event_loops():
    """The meters are the process's: the first message on a new loop goes at
    once; the next waits for an answer, then the rate is known."""
    import asyncio

    meter = LinkMeter()

    async def one_loop() -> float:
        loop = asyncio.get_running_loop()
        await meter.first_answer(5.0)  # the first: at once
        meter.started(1 << 20)
        loop.call_later(0.05, meter.finished, 1 << 20)
        start = loop.time()
        await meter.first_answer(5.0)  # waits for the answer
        return loop.time() - start

    assert 0.03 < asyncio.run(one_loop()) < 2.0
    assert meter.rate() is not None
    meter = LinkMeter()
    asyncio.run(meter.first_answer(5.0))  # a loop closed since: no error on the next
    assert 0.03 < asyncio.run(one_loop()) < 2.0


def test_a_transfer_held_for_a_slow_link_first_sends_what_it_held_back(monkeypatch):
    """The back-pressure counts the small shards held back for a fuller
    message, which only a later write (or the barrier) sends: where they
    alone pass the backlog at a link's measured rate (a slow rate measured
    on a busy machine), a transfer waiting for the link to catch up would
    wait for good, its worker's thread with it.  It sends them first."""
    import asyncio
    from types import SimpleNamespace

    from gpushuffle.engine.linger import HeldBack
    from gpushuffle.transport import Shard

    now = [0.0]
    meter = LinkMeter(clock=lambda: now[0])
    monkeypatch.setattr(links, "_links", {"10.0.0.2": meter})
    meter.started(500_000)
    now[0] = 1.0
    meter.finished(500_000)  # 0.5 MB/s

    run_class = run_module.GPUShuffleRun

    class Sender:
        """The state of a run that its back-pressure reads, with the run's
        own methods; the comm buffer (a stand-in) records what it is given."""

        _hold_while_a_link_is_behind = run_class._hold_while_a_link_is_behind
        _seconds_behind = run_class._seconds_behind
        _send_all_lingering = run_class._send_all_lingering
        _send_lingering = run_class._send_lingering
        link_backlog_s = 1.0
        _remote_hosts = ["10.0.0.2"]

        def __init__(self) -> None:
            self.held_back = HeldBack(message_bytes=16 << 20, on_device=False)
            self._comm_buffer = SimpleNamespace(sizes={}, raise_on_exception=lambda: None)
            self.written: list[dict] = []

        def raise_if_closed(self) -> None:
            pass

        async def _write_to_comm(self, shards: dict) -> None:
            self.written.append(shards)

    sender = Sender()
    peer = "tcp://10.0.0.2:1234"
    shard = Shard("pandas", 0, np.array([0]), np.array([0, 1]), None, 800_000)
    assert sender.held_back.waits(peer, shard)  # under the 1 MiB a peer's message waits for
    sender.held_back.add(peer, shard)
    assert sender._seconds_behind() == pytest.approx(1.6)  # 0.8 MB at 0.5 MB/s
    asyncio.run(asyncio.wait_for(sender._hold_while_a_link_is_behind(), 10))
    assert sender.written == [{peer: shard}]
    assert sender.held_back.total == 0


def test_seconds_behind_counts_what_is_in_flight_and_what_waits(monkeypatch):
    """The back-pressure's measure (gpushuffle.comm.link-backlog): per host,
    wire bytes in flight plus shard bytes waiting, scaled by the link's
    recent wire bytes per byte, over its rate; the slowest host counts."""
    now = [0.0]
    meters = {"10.0.0.2": LinkMeter(clock=lambda: now[0]), "10.0.0.3": LinkMeter()}
    monkeypatch.setattr(links, "_links", meters)
    slow = meters["10.0.0.2"]
    slow.started(1_000_000, raw=2_000_000)  # compressed 2:1
    now[0] = 1.0
    slow.finished(1_000_000)  # 1 MB/s
    slow.started(500_000, raw=1_000_000)  # in flight
    waiting = [("tcp://10.0.0.2:1234", 1_000_000), ("tcp://10.0.0.3:99", 5_000_000)]
    # 0.5 MB in flight + 1 MB waiting at 0.5 wire bytes per byte, at 1 MB/s;
    # 10.0.0.3 has no rate yet and holds nothing back.
    behind = links.seconds_behind(["10.0.0.2", "10.0.0.3"], waiting)
    assert behind == pytest.approx(1.0, rel=0.05)
    assert links.seconds_behind(["10.0.0.3"], waiting) == 0.0
