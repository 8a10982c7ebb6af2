"""Compression chosen per link, by what pays.

Each message a run sends to a worker on another host may have its frames
compressed (:mod:`gpushuffle.codecs`).  Whether, and with which codec, is
decided per message from what this process measured:

* the link: the rate at which wire bytes to that host went while any were
  in flight (:class:`LinkMeter`, shared by every run of the process), and
  how many wire bytes are still ahead of this message on it;
* the codecs: each one's ratio and speed on this run's own data, per frame
  *slot* (a column's buffer: :func:`gpushuffle.codecs.encode_frames`),
  from a probe of the first frame in each slot; a slot that compresses by
  less than :data:`MIN_RATIO` is sent as it is from then on;
* the CPU: how busy this machine's cores were over the last moments.

A codec pays where the link time it saves is more than the time it costs:
its compression on this worker and its decompression on the receiver,
priced by how scarce CPU time is (1 while the link is behind by more than
:data:`LINK_BEHIND_S`, which makes the link the limit; else ``1 / (1 -
utilisation)``: on busy cores compression slows the splits that feed every
link), plus any time the link would wait for the compression.  Workers on
the same host never compress (same-host reads, or a loopback socket).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from distributed.comm import get_address_host

from gpushuffle.codecs import HOST_CODECS, Codec, codec_for, frame_nbytes, is_device_frame

#: Settings of ``gpushuffle.comm.compression``.
MODES = ("auto", "none", *HOST_CODECS)

#: A slot whose best codec compresses it by less than this is sent raw.
MIN_RATIO = 1.1

#: The link is the limit while what is in flight on it takes longer than
#: this to drain and it has been busy without a break for at least
#: :data:`LINK_BUSY_S`: compression's CPU time then costs nothing the run
#: waits for.  (A link the cores cannot keep busy has breaks.)
LINK_BEHIND_S = 0.5
LINK_BUSY_S = 0.5

#: A link's rate until one is measured (1 Gbit/s).
PRIOR_RATE = 125e6

#: CPU time costs at most this many times link time (cores saturated).
MAX_CPU_PRICE = 20.0

#: Rates follow the last seconds of a link: the counts halve past this.
RATE_WINDOW_S = 5.0

#: Only messages at least this large (on the wire) time a link: a small
#: one's time is its round trip and the peers' event loops, not the link's
#: rate.  (At 1 MiB, compressed messages of a slow link, 0.5 MB for 3 MB of
#: lineitem, no longer timed it: 100 Mbit/s ran 37% slower.)
RATE_MIN_BYTES = 64 << 10

#: A message to a host whose rate is not known yet waits this long at most
#: for the first send there to be answered (the link is busy meanwhile).
FIRST_ANSWER_S = 1.0


@dataclass(frozen=True)
class CodecPrior:
    """A codec's ratio and seconds per byte (compressing and decompressing)
    before this run has measured it: measured on TPC-H lineitem here."""

    ratio: float
    seconds_per_byte: float


PRIORS = {"lz4": CodecPrior(2.5, 2.5e-9), "zstd": CodecPrior(4.0, 4.5e-9)}

#: Whether ``auto`` may compress device frames (nvCOMP, :mod:`gpushuffle.device_codecs`).
#: Not before that path has run on a GPU: until then only a codec set by
#: name (``lz4``, ``zstd``) sends device frames through nvCOMP.
DEVICE_CODECS_IN_AUTO = False


class LinkMeter:
    """Wire bytes sent to one host: how many are in flight now, and the rate
    at which they went while any were in flight (busy time, overlapping
    sends counted once).  Called on the event loop."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.in_flight = 0
        self._sends = 0
        self._since = 0.0
        self._busy = 0.0
        self._bytes = 0.0
        self._answered: asyncio.Event | None = None
        self._answered_loop: asyncio.AbstractEventLoop | None = None
        #: Whether the current busy period carried a message large enough to time.
        self._timed = False
        #: Wire and shard bytes of the latest sends (each send halves the past).
        self._wire_total = 0.0
        self._raw_total = 0.0

    def started(self, nbytes: int, raw: int | None = None) -> None:
        """A send of ``nbytes`` on the wire (``raw`` before compression) began."""
        if not self._sends:
            self._since = self._clock()
            self._timed = False
        self._sends += 1
        self.in_flight += nbytes
        self._wire_total = self._wire_total / 2 + nbytes
        self._raw_total = self._raw_total / 2 + (nbytes if raw is None else raw)

    def wire_ratio(self) -> float:
        """Wire bytes per shard byte of the latest sends (1 before any; less
        where they were compressed), for what still waits to be sent."""
        return self._wire_total / self._raw_total if self._raw_total else 1.0

    def finished(self, nbytes: int, delivered: bool = True) -> None:
        self._sends -= 1
        self.in_flight -= nbytes
        if delivered:
            if self._answered is not None and self._answered_loop is _running_loop():
                self._answered.set()
            if nbytes >= RATE_MIN_BYTES:
                self._bytes += nbytes
                self._timed = True
        if not self._sends:
            if self._timed:
                self._busy += self._clock() - self._since
            self._timed = False
            if self._busy > RATE_WINDOW_S:
                self._busy /= 2
                self._bytes /= 2

    def busy_for(self) -> float:
        """Seconds the link has had sends in flight without a break (0 if none now)."""
        return self._clock() - self._since if self._sends else 0.0

    def rate(self) -> float | None:
        """Bytes per second while busy, once a message of
        :data:`RATE_MIN_BYTES` or more was answered (None before)."""
        busy = self._busy + (self.busy_for() if self._timed else 0.0)
        return self._bytes / busy if self._bytes > 0 and busy > 0 else None

    async def first_answer(self, timeout: float) -> None:
        """Where no rate is known yet: return at once for the first message,
        and have later ones wait until a send is answered (at most
        ``timeout``)."""
        if self.rate() is not None:
            return
        loop = asyncio.get_running_loop()
        if self._answered is None or self._answered_loop is not loop:
            # (The meter outlives event loops: in-process clusters, one after another.)
            self._answered, self._answered_loop = asyncio.Event(), loop
            return  # the first message: it goes, and measures
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._answered.wait(), timeout)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class CpuMeter:
    """How busy this machine's cores were lately (0 to 1), from the kernel's
    counters (``psutil.cpu_times``), smoothed over about half a second."""

    def __init__(self, interval: float = 0.1, smoothing: float = 0.5) -> None:
        self._interval = interval
        self._smoothing = smoothing
        self._lock = threading.Lock()
        self._last: tuple[float, float, float] | None = None
        self._utilisation = 0.0

    @staticmethod
    def _read() -> tuple[float, float]:
        import psutil

        times = psutil.cpu_times()
        idle = times.idle + getattr(times, "iowait", 0.0)
        return sum(times), idle

    def utilisation(self) -> float:
        now = time.monotonic()
        with self._lock:
            if self._last is not None and now - self._last[0] < self._interval:
                return self._utilisation
            total, idle = self._read()
            if self._last is not None:
                _, total0, idle0 = self._last
                spent = total - total0
                if spent > 0:
                    busy = max(0.0, min(1.0, 1 - (idle - idle0) / spent))
                    weight = min(1.0, (now - self._last[0]) / self._smoothing)
                    self._utilisation += weight * (busy - self._utilisation)
            self._last = (now, total, idle)
            return self._utilisation


#: This process's links, by host (every run's sends count), and its cores.
_links: dict[str, LinkMeter] = {}
cpu = CpuMeter()


def link_to(host: str) -> LinkMeter:
    meter = _links.get(host)
    if meter is None:
        meter = _links[host] = LinkMeter()
    return meter


def seconds_behind(hosts: Iterable[str], waiting: Iterable[tuple[str, int]]) -> float:
    """The longest time, over ``hosts``, to send what is in flight there and
    what ``waiting`` holds for it (``(worker address, shard bytes)`` not yet
    sent, scaled by the link's recent wire bytes per byte), at each link's
    measured rate (links with none yet count 0)."""
    queued: dict[str, float] = {}
    for address, nbytes in waiting:
        host = get_address_host(address)
        queued[host] = queued.get(host, 0) + nbytes
    worst = 0.0
    for host in hosts:
        link = link_to(host)
        rate = link.rate()
        if rate:
            wire = link.in_flight + queued.get(host, 0) * link.wire_ratio()
            worst = max(worst, wire / rate)
    return worst


@dataclass
class CodecStats:
    """What one codec did on one slot: bytes in and out, thread seconds
    compressing, and decompressing its probe."""

    raw: int = 0
    compressed: int = 0
    seconds: float = 0.0
    decode_raw: int = 0
    decode_seconds: float = 0.0

    def add(self, other: CodecStats) -> None:
        self.raw += other.raw
        self.compressed += other.compressed
        self.seconds += other.seconds
        self.decode_raw += other.decode_raw
        self.decode_seconds += other.decode_seconds

    def ratio(self) -> float:
        return self.raw / self.compressed if self.compressed else 1.0

    def seconds_per_byte(self) -> float:
        """Compressing and decompressing, per byte before compression."""
        compress = self.seconds / self.raw if self.raw else 0.0
        decode = self.decode_seconds / self.decode_raw if self.decode_raw else compress / 3
        return compress + decode


@dataclass(frozen=True)
class LinkState:
    """What a message's encoding is decided from, read on the event loop:
    the link's rate (bytes per second), and what a second of CPU time costs
    in seconds of link time."""

    rate: float
    cpu_price: float

    def value_per_byte(self, ratio: float, seconds_per_byte: float) -> float:
        """Link seconds a byte compressed this well saves, less what
        compressing and decompressing it costs at this price."""
        return (1 - 1 / ratio) / self.rate - self.cpu_price * seconds_per_byte


@dataclass
class Slot:
    """A frame slot of a run: raw for good, or its codecs' numbers."""

    raw: bool = False
    codecs: dict[str, CodecStats] = field(default_factory=dict)


def configured_mode() -> str:
    """``gpushuffle.comm.compression``, checked (a ValueError names the choices)."""
    from gpushuffle import config

    mode = config.get("comm.compression")
    if mode not in MODES:
        raise ValueError(f"gpushuffle.comm.compression: {mode!r} is not one of {', '.join(MODES)}")
    return str(mode)


class RunCompression:
    """One run's compression of what it sends: its setting, the slots'
    probes and the codecs' numbers, and per message, the choice."""

    def __init__(self, mode: str, codecs: Sequence[str] = HOST_CODECS) -> None:
        if mode not in MODES:
            raise ValueError(
                f"gpushuffle.comm.compression: {mode!r} is not one of {', '.join(MODES)}"
            )
        self.mode = mode
        self.codecs = tuple(codecs) if mode == "auto" else (mode,)
        self._slots: dict[tuple[int, int], Slot] = {}
        self._lock = threading.Lock()
        #: Bytes waiting for or under compression in this run (the encoder backlog).
        self.encoding = 0

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def state(self, link: LinkMeter) -> LinkState:
        """The link's state for the next message (a prior rate, and CPU
        priced at 1, until the link's first answer)."""
        rate = link.rate()
        if rate is None:
            return LinkState(PRIOR_RATE, 1.0)
        behind = link.in_flight / rate > LINK_BEHIND_S and link.busy_for() >= LINK_BUSY_S
        if behind:
            return LinkState(rate, 1.0)
        idle = max(1 / MAX_CPU_PRICE, 1 - cpu.utilisation())
        return LinkState(rate, 1 / idle)

    def fastest_seconds_per_byte(self) -> float:
        """Compression seconds per byte of the fastest codec measured (0 before any)."""
        costs = [t.seconds / t.raw for t in self._totals().values() if t.raw]
        return min(costs, default=0.0)

    def _totals(self) -> dict[str, CodecStats]:
        with self._lock:
            totals: dict[str, CodecStats] = {}
            for slot in self._slots.values():
                if slot.raw:
                    continue
                for name, stats in slot.codecs.items():
                    totals.setdefault(name, CodecStats()).add(stats)
            return totals

    def candidates(self, state: LinkState) -> list[str]:
        """Codecs that could pay on this link: those for which even a frame
        that vanished entirely would save more link time than the codec
        costs (measured in this run, else :data:`PRIORS`)."""
        if self.mode != "auto":
            return list(self.codecs)
        totals = self._totals()
        out = []
        for name in self.codecs:
            measured = totals.get(name)
            cost = (
                measured.seconds_per_byte()
                if measured is not None and measured.raw
                else PRIORS[name].seconds_per_byte
            )
            if 1 / state.rate > state.cpu_price * cost:
                out.append(name)
        return out

    def worth_encoding(self, state: LinkState, nbytes: int, encoding_s: float = 0.0) -> bool:
        """Whether a message of ``nbytes`` is worth compressing: a codec pays
        on the run's data so far (or on its priors, before probes), by more
        than the link would wait for the encoder (``encoding_s``: the
        encoder's backlog, this message included, less what is queued on
        the link)."""
        if self.mode != "auto":
            return True
        names = self.candidates(state)
        if not names:
            return False
        totals = self._totals()
        with self._lock:
            unprobed = not self._slots
        best = 0.0
        for name in names:
            measured = totals.get(name)
            if measured is not None and measured.raw and not unprobed:
                value = state.value_per_byte(measured.ratio(), measured.seconds_per_byte())
            else:
                prior = PRIORS[name]
                value = state.value_per_byte(prior.ratio, prior.seconds_per_byte)
            best = max(best, value)
        if not totals and not unprobed:
            # Every slot probed raw: nothing in this run's data compresses.
            return False
        return best * nbytes > encoding_s

    def compressor(self, state: LinkState) -> Callable[[tuple[int, int], Any], Any]:
        """What :func:`gpushuffle.codecs.encode_frames` calls for each frame
        of a message sent in ``state`` (in a thread)."""
        names = self.candidates(state)

        def compress(slot_key: tuple[int, int], frame: Any) -> tuple[Codec, Any] | None:
            device = is_device_frame(frame)
            with self._lock:
                slot = self._slots.setdefault(slot_key, Slot())
                unprobed = [n for n in names if n not in slot.codecs]
            if slot.raw:
                return None
            if unprobed:
                probed = self._probe(slot, frame, device, unprobed)
                if probed is None:
                    return None
            else:
                probed = {}
            name = self._pick(slot, state, names)
            if name is None:
                return None
            if name in probed:
                return probed[name]
            codec = codec_for(name, device)
            start = time.thread_time()
            compressed = codec.compress(frame)
            self._record(slot, name, frame_nbytes(frame), compressed, time.thread_time() - start)
            return codec, compressed

        return compress

    def _probe(
        self, slot: Slot, frame: Any, device: bool, names: Sequence[str]
    ) -> dict[str, tuple[Codec, Any]] | None:
        """Compress (and decompress) a frame with each codec in ``names`` that
        its slot has no numbers for; None if the slot turned out raw."""
        nbytes = frame_nbytes(frame)
        results: dict[str, tuple[Codec, Any]] = {}
        for name in names:
            codec = codec_for(name, device)
            start = time.thread_time()
            compressed = codec.compress(frame)
            seconds = time.thread_time() - start
            start = time.thread_time()
            codec.decompress(compressed, nbytes)
            decode = time.thread_time() - start
            self._record(slot, name, nbytes, compressed, seconds, decode)
            results[name] = (codec, compressed)
        with self._lock:
            best = max(stats.ratio() for stats in slot.codecs.values())
            if self.mode == "auto" and best < MIN_RATIO:
                slot.raw = True
                return None
        return results

    def _record(
        self,
        slot: Slot,
        name: str,
        nbytes: int,
        compressed: Any,
        seconds: float,
        decode_seconds: float | None = None,
    ) -> None:
        with self._lock:
            stats = slot.codecs.setdefault(name, CodecStats())
            stats.raw += nbytes
            stats.compressed += frame_nbytes(compressed)
            stats.seconds += seconds
            if decode_seconds is not None:
                stats.decode_raw += nbytes
                stats.decode_seconds += decode_seconds

    def _pick(self, slot: Slot, state: LinkState, names: Sequence[str]) -> str | None:
        """The codec of ``names`` that saves the most time per byte on this slot, if any."""
        if self.mode != "auto":
            return self.mode
        with self._lock:
            stats = {n: slot.codecs[n] for n in names if n in slot.codecs}
        best, best_value = None, 0.0
        for name, numbers in stats.items():
            value = state.value_per_byte(numbers.ratio(), numbers.seconds_per_byte())
            if value > best_value:
                best, best_value = name, value
        return best

    def slots(self) -> dict[tuple[int, int], Slot]:
        """The run's frame slots so far (a copy of the mapping)."""
        with self._lock:
            return dict(self._slots)
