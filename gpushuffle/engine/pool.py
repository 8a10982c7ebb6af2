"""A pool of reusable host buffers, given back to the OS when shuffles stop.

Fresh host memory is expensive: the kernel zeroes every page on first touch,
and a worker started by a Nanny hands freed memory straight back to the OS
(``MALLOC_TRIM_THRESHOLD_``), so every large allocation pays that again.
Splits, unpacks and reads from disk allocate their buffers here instead.  A
buffer returns to the pool when the last array viewing it is garbage
collected, wherever that happens (after a shard was sent, after an output
partition was consumed), and is handed out again to the next request of a
similar size.

Blocks are anonymous private mappings of their own (``mmap``), so
releasing one unmaps it and the memory really leaves the process whatever
the allocator's settings (glibc keeps freed heap memory, and per-thread
arenas are trimmed only by ``malloc_trim``).  They are advised to use
transparent huge pages (fewer faults and TLB misses), except on a virtual
machine that reports free memory of huge-page size to its hypervisor
(``gpushuffle.memory.host-pool.huge-pages``, :func:`free_pages_reported`).

A request for several arrays (an output partition's columns) that no
free block holds whole is spread over the free blocks there are
(:meth:`HostBufferPool.empty_buffers`): the split buffers a transfer gave
back then hold the unpack's outputs, and those, given back, the next
transfer's splits, so a warm shuffle faults in almost no fresh pages.

Free blocks are bounded (``gpushuffle.memory.host-pool.limit``).  While a
shuffle transfers (:meth:`HostBufferPool.hold`) they wait for its unpack.
Once every shuffle on the worker unpacks, a block unused for an eighth of
``gpushuffle.memory.host-pool.idle-release`` is unmapped: the outputs do
not need it.  Once no shuffle has run on the worker for the whole
``idle-release``, every free block goes and malloc is trimmed, so a worker
returns to the memory it had before the shuffle, while shuffles that follow
each other closely still reuse the blocks.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
import ctypes
import logging
import mmap
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

#: Smaller requests are left to the allocator: they are cheap and many.
MIN_POOLED_BYTES = 1 << 20
#: Arrow memory freed on a worker over its spill fraction that makes the
#: pool trim the allocators again (:meth:`HostBufferPool.release_idle`).
ARROW_FREED_BYTES = 16 << 20
#: How long after a large Arrow column was pickled (distributed spilling an
#: output, most often) what pyarrow frees goes back at once, and how often the
#: worker's event loop looks (:meth:`HostBufferPool.watch_arrow_frees`).
ARROW_WATCH_SECONDS = 2.0
ARROW_WATCH_INTERVAL = 0.005
#: What pandas keeps in an Arrow-backed array's ``__dict__``.
_ARROW_ARRAY_STATE = frozenset({"_pa_array", "_dtype", "_cache"})
#: A free buffer serves requests down to about 1 / (SLACK * HEADROOM) of its size.
SLACK = 1.25
#: Fresh blocks are mapped this much larger than asked (only touched pages
#: become memory), so that requests of about the same size reuse them.
HEADROOM = 1.125
_PAGE = 1 << 16
_HUGE = 1 << 21
#: Blocks at least this large are rounded to whole huge pages: the kernel
#: then aligns the mapping so that every page of it can be a huge page.
_HUGE_ROUND_FROM = 8 << 20

#: What a buffer is for; :meth:`HostBufferPool.usage` reports bytes in use by tag.
TAGS = ("split", "receive", "unpack", "read", "other")


@dataclass
class PoolStatistics:
    requests: int = 0
    reused: int = 0
    bytes_reused: int = 0
    bytes_fresh: int = 0
    bytes_released: int = 0
    bytes_free: int = 0
    bytes_free_peak: int = 0
    bytes_in_use: int = 0
    #: Times every free block went back to the OS because no shuffle ran.
    idle_releases: int = 0
    #: Times malloc was let reuse freed memory (:class:`MallocReuse`), and
    #: whether it is now (1) or has the Nanny's settings back (0).
    malloc_reuses: int = 0
    malloc_reusing: int = 0
    #: Times free blocks and malloc's heaps went back because distributed
    #: had paused a worker of this process for its memory use, or the
    #: process had passed a worker's spill fraction.
    pause_releases: int = 0
    #: Times pyarrow's freed memory went back right after a large Arrow
    #: column was pickled and freed (:meth:`HostBufferPool.watch_arrow_frees`).
    arrow_spill_releases: int = 0
    #: Whether fresh blocks are advised to use transparent huge pages (1).
    huge_pages: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def free_pages_reported(sys_root: str = "/sys") -> bool:
    """Whether this machine hands free blocks of huge-page size back to its
    hypervisor: a virtio balloon with free page reporting
    (``VIRTIO_BALLOON_F_REPORTING``) reporting blocks no larger than a huge page.

    There huge pages cost more than they save.  A block the pool unmaps is
    a free huge page, reported at once (``page_reporting_order`` is the huge
    page order by default), and a fresh huge page is then faulted in by the
    host as well as the guest.  Measured on such a VM (Firecracker, 2 cores):
    the task thread's kernel time per 12M-row shuffle was 0.42 to 0.45 s per
    worker with huge pages, 0.22 to 0.25 s without, in a tenth of the faults.
    """
    root = Path(sys_root)
    try:
        order = int((root / "module/page_reporting/parameters/page_reporting_order").read_text())
        huge = int((root / "kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return False
    if order > (huge // mmap.PAGESIZE).bit_length() - 1:
        return False
    for device in root.glob("bus/virtio/devices/*"):
        try:
            if int((device / "device").read_text(), 16) != _VIRTIO_ID_BALLOON:
                continue
            features = (device / "features").read_text().strip()
        except (OSError, ValueError):
            continue
        if len(features) > _VIRTIO_BALLOON_F_REPORTING and (
            features[_VIRTIO_BALLOON_F_REPORTING] == "1"
        ):
            return True
    return False


_VIRTIO_ID_BALLOON = 5
#: The feature's bit; sysfs lists feature bits as '0'/'1', lowest first.
_VIRTIO_BALLOON_F_REPORTING = 5


def huge_pages_setting(value: Any) -> bool:
    """``gpushuffle.memory.host-pool.huge-pages`` as a bool ("auto" decided here)."""
    if isinstance(value, str):
        word = value.strip().lower()
        value = {"true": True, "false": False}.get(word, word)
    if value == "auto":
        return not free_pages_reported()
    if isinstance(value, bool):
        return value
    raise ValueError(
        f"gpushuffle.memory.host-pool.huge-pages must be true, false or 'auto', not {value!r}"
    )


def _map(nbytes: int, huge_pages: bool = True) -> mmap.mmap:
    block = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        # Where transparent huge pages are "madvise" (the usual default),
        # only advised mappings get them.
        with contextlib.suppress(OSError):
            block.madvise(mmap.MADV_HUGEPAGE)
    return block


def _unmap(block: mmap.mmap) -> bool:
    try:
        block.close()
    except BufferError:  # pragma: no cover - a view escaped; the GC unmaps it later
        return False
    return True


def trim_allocators(arrow: bool = True) -> None:
    """Return what the allocators keep of freed memory to the OS: glibc's
    (``malloc_trim``) and, with ``arrow``, pyarrow's (:func:`release_arrow_unused`)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    if arrow:
        release_arrow_unused()


def release_arrow_unused() -> None:
    """Return what pyarrow's memory pool keeps of freed memory to the OS.

    pyarrow's wheels allocate with mimalloc, which keeps every freed page
    for the next allocation until asked: on the 2-core VM 330 MiB of string
    arrays freed left RSS where it was (402 MiB anonymous) until
    ``release_unused()`` (56 MiB).  A worker that shuffled strings held 300
    to 380 MiB after making room for its outputs, 190 to 250 MiB with this
    (:func:`gpushuffle.engine.budget.make_room`).  mimalloc gives back
    another thread's freed memory only when asked on the main thread: asked
    on another, this asks again on the main thread's event loop, if a
    watched worker runs it.  Only where pyarrow is imported already.
    """
    _release_arrow_here()
    if threading.current_thread() is not threading.main_thread() and _POOL is not None:
        # Asked elsewhere, mimalloc gives back only the asking thread's
        # pages (from a thread of its own: nothing of 321 MiB the main
        # thread freed; from the main thread: every thread's).  A worker's
        # main thread runs its event loop: it asks too.
        _POOL.release_arrow_on_main_loop()


def _release_arrow_here() -> None:
    pyarrow = sys.modules.get("pyarrow")
    if pyarrow is not None:
        with contextlib.suppress(Exception):  # a pool without it: nothing to give
            pyarrow.default_memory_pool().release_unused()


def arrow_allocated() -> int:
    """Bytes pyarrow's memory pool has allocated now (0 without pyarrow imported)."""
    pyarrow = sys.modules.get("pyarrow")
    try:
        return int(pyarrow.total_allocated_bytes()) if pyarrow is not None else 0
    except Exception:  # pyarrow half imported (in another thread): nothing known yet
        return 0


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: While shuffles run: allocations up to this size come from malloc's heaps
#: (glibc's largest mmap threshold on 64-bit systems) ...
_REUSE_MMAP_THRESHOLD = 32 << 20
#: ... and a heap keeps this much free memory at its top instead of trimming it.
_REUSE_TRIM_THRESHOLD = 64 << 20
#: glibc's mmap threshold when the adaptive one is off.
_DEFAULT_MMAP_THRESHOLD = 128 << 10
#: A request no free chunk of a thread's arena is likely to serve, under the
#: raised mmap threshold: it comes from the arena's top (see _trim_arena).
_ARENA_POKE = _REUSE_MMAP_THRESHOLD - (1 << 20)
#: How long each thread of an executor waits for the others to take a poke.
_POKE_WAIT = 0.1


def _trim_arena(barrier: threading.Barrier) -> None:
    """Give the free top of this thread's malloc arena back to the OS.

    ``malloc_trim`` releases the free chunks of every arena but trims the top
    of the main arena only; a thread arena's top shrinks only when a free
    in that thread merges into it and the top exceeds ``M_TRIM_THRESHOLD``.
    A task thread that went idle after a shuffle, while the threshold was
    raised, would keep up to that much for good.  Allocating from the top
    and freeing it again, once the Nanny's threshold is back, is such a free.
    ``barrier`` makes each thread of an executor take one poke.
    """
    with contextlib.suppress(threading.BrokenBarrierError):
        barrier.wait()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(_ARENA_POKE))


class MallocReuse:
    """Let glibc reuse freed memory while shuffles run, and restore it after.

    A Nanny starts workers with ``MALLOC_TRIM_THRESHOLD_`` set (distributed's
    ``nanny.pre-spawn-environ``) so that freed memory goes back to the OS.
    Setting it also turns off glibc's adaptive mmap threshold: every
    allocation over 128 KiB is then a new mapping whose pages the kernel
    faults in and zeroes, which on these machines costs about twenty times
    writing to reused memory (received messages, hashes, pickles, pandas'
    temporaries: a shuffle allocates all of them at its data rate).  While
    shuffles run, the thresholds are raised; :meth:`restore` puts the
    Nanny's back and trims, so memory still leaves once shuffles stop.
    Workers without that variable keep glibc's adaptive thresholds and are
    left alone.  The threads of executors given to :meth:`watch` (task threads,
    which allocate in malloc arenas of their own) trim their arenas then.
    """

    def __init__(self, enabled: bool) -> None:
        import os

        trim = os.environ.get("MALLOC_TRIM_THRESHOLD_")
        mmap_threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
        self._restore_to: tuple[int, int] | None = None
        self._mallopt: Any = None
        if enabled and trim is not None and trim.isdigit():
            with contextlib.suppress(OSError, AttributeError):
                self._mallopt = ctypes.CDLL("libc.so.6").mallopt
            self._restore_to = (
                int(trim),
                int(mmap_threshold)
                if mmap_threshold and mmap_threshold.isdigit()
                else _DEFAULT_MMAP_THRESHOLD,
            )
        self.reusing = False
        self._lock = threading.Lock()
        # Added to on the event loop, read by the pool's trimmer thread.
        self._executors_lock = threading.Lock()
        self._executors: weakref.WeakSet[concurrent.futures.Executor] = weakref.WeakSet()

    def watch(self, executor: concurrent.futures.Executor) -> None:
        """Have ``executor``'s threads trim their malloc arenas at :meth:`restore`."""
        if self._mallopt is not None:
            with self._executors_lock:
                self._executors.add(executor)

    def reuse(self) -> bool:
        """Raise the thresholds; True if this changed them."""
        with self._lock:
            if self._mallopt is None or self.reusing:
                return False
            self._mallopt(_M_MMAP_THRESHOLD, _REUSE_MMAP_THRESHOLD)
            self._mallopt(_M_TRIM_THRESHOLD, _REUSE_TRIM_THRESHOLD)
            self.reusing = True
            return True

    def restore(self) -> bool:
        """Put the Nanny's thresholds back; True if this changed them (the
        caller then trims what the heaps kept).

        Takes up to a few tenths of a second (the watched threads' pokes):
        call it outside locks that shuffles' threads take.
        """
        with self._lock:
            if self._mallopt is None or not self.reusing or self._restore_to is None:
                return False
            trim, mmap_threshold = self._restore_to
            self._mallopt(_M_TRIM_THRESHOLD, trim)
            # Before the mmap threshold comes down: the pokes' requests must
            # come from the arenas.  A thread busy with a task past the wait
            # frees memory of its own under the lowered trim threshold.
            self._trim_thread_arenas()
            self._mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
            self.reusing = False
            return True

    def _trim_thread_arenas(self) -> None:
        futures: list[concurrent.futures.Future[None]] = []
        with self._executors_lock:
            executors = list(self._executors)
        for executor in executors:
            # Threads are started on demand: only started ones have arenas
            # (an executor that does not say how many it started gets one poke).
            nthreads = len(getattr(executor, "_threads", (None,)))
            if not nthreads:
                continue
            barrier = threading.Barrier(nthreads, timeout=_POKE_WAIT)
            try:
                futures.extend(executor.submit(_trim_arena, barrier) for _ in range(nthreads))
            except RuntimeError:  # shut down
                continue
        concurrent.futures.wait(futures, timeout=3 * _POKE_WAIT)


@dataclass
class _Activity:
    """Shuffles running on this process, and when the last one stopped."""

    active: int = 0
    #: Of those, the ones that started their unpack.
    unpacking: int = 0
    since: float = field(default_factory=time.monotonic)


class HostBufferPool:
    """Hands out 1-d numpy arrays backed by reusable blocks.

    Parameters
    ----------
    limit
        Most bytes of free blocks kept; 0 disables pooling.
    idle_release
        Seconds a free block may stay unused, and seconds after the last
        shuffle on the worker stopped (see :meth:`hold`) before every free
        block is unmapped and malloc is trimmed; 0 leaves that to explicit
        :meth:`release_idle` calls.
    malloc_reuse
        Let malloc reuse freed memory while shuffles run (:class:`MallocReuse`).
    huge_pages
        Advise fresh blocks to use transparent huge pages.
    """

    def __init__(
        self,
        limit: int,
        idle_release: float,
        malloc_reuse: bool = False,
        huge_pages: bool = True,
        configured_limit: int | None = None,
    ) -> None:
        self.limit = int(limit)
        #: The most :meth:`bound_by` may give (the configured limit).
        self.configured_limit = self.limit if configured_limit is None else int(configured_limit)
        self.huge_pages = bool(huge_pages)
        self.malloc = MallocReuse(malloc_reuse)
        self.idle_release = float(idle_release)
        self._lock = threading.Lock()
        # Free blocks sorted by size, with the time each was returned.
        self._sizes: list[int] = []
        self._blocks: list[tuple[mmap.mmap, float]] = []
        # Finalizers may run in any thread, even inside a pool call of the
        # same thread (a garbage collection): they only append here.
        self._returned: deque[tuple[mmap.mmap, str]] = deque()
        self._in_use = dict.fromkeys(TAGS, 0)
        self._activity = _Activity()
        self._idle_released = True  # nothing to release yet
        self.statistics = PoolStatistics(huge_pages=int(self.huge_pages))
        self._trimmer: threading.Thread | None = None
        self._workers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._workers_lock = threading.Lock()  # added to on the loop, read by the trimmer
        self._watched_workers = False
        #: The most pyarrow held since its memory last went back: a paused
        #: worker gives back what was freed since (an output distributed spilled).
        self._arrow_at_trim = 0
        #: Until when what pyarrow frees goes back at once
        #: (:meth:`watch_arrow_frees`), the most pyarrow held since that watch
        #: began or last gave memory back, the arrays watched, and the main
        #: thread's event loop (where pyarrow gives back every thread's).
        self._arrow_watch_until = 0.0
        self._arrow_watch_peak = 0
        self._arrow_polling: asyncio.AbstractEventLoop | None = None  # the loop polled
        self._main_pending = False  # a release queued on the main loop
        # Arrays are unhashable: by id, each entry removed as its array goes.
        self._arrow_watched: dict[int, weakref.finalize] = {}
        self._main_loop: asyncio.AbstractEventLoop | None = None

    # -- handing out ----------------------------------------------------------

    def empty(self, n: int, dtype: Any, tag: str = "other") -> np.ndarray:
        """An uninitialized array of ``n`` items of ``dtype``.

        ``tag`` says what the buffer is for (one of :data:`TAGS`), for
        :meth:`usage`.
        """
        dtype = np.dtype(dtype)
        nbytes = n * dtype.itemsize
        if (
            self.limit <= 0
            or nbytes < MIN_POOLED_BYTES
            or nbytes * HEADROOM > self.limit
            or dtype.hasobject
        ):
            # A block larger than the pool may keep (a hot output partition)
            # would be unmapped when given back anyway, but only once the
            # pool next looks at what came back: until then the worker holds
            # it twice over if distributed spills the output and reads it
            # back (seen as a restart on 1 GiB workers).  malloc's own
            # mapping goes the moment the array does.
            return np.empty(n, dtype=dtype)
        stats = self.statistics
        with self._lock:
            self._absorb_returned()
            stats.requests += 1
            block = self._take(nbytes)
            if block is not None:
                stats.reused += 1
                stats.bytes_reused += len(block)
        if block is None:
            # Mapped with headroom: pages never touched cost no memory, and
            # the next request a little larger (the next output partition,
            # the next shard) can still take this block instead of a fresh one.
            size = int(nbytes * HEADROOM)
            rounding = _HUGE if self.huge_pages and size >= _HUGE_ROUND_FROM else _PAGE
            block = _map(-(-size // rounding) * rounding, self.huge_pages)
            with self._lock:
                # What was asked for: the headroom is address space only.
                stats.bytes_fresh += nbytes
        with self._lock:
            self._in_use[tag] += len(block)
            stats.bytes_in_use += len(block)
            self._idle_released = False
        # Lifetime is tracked on a ctypes owner that every view keeps alive
        # (views of views collapse their base onto it).
        owner = (ctypes.c_char * len(block)).from_buffer(block)
        weakref.finalize(owner, self._returned.append, (block, tag))
        self._ensure_trimmer()
        return np.frombuffer(owner, dtype=dtype, count=n)  # type: ignore[call-overload]

    def empty_buffers(self, sizes: Sequence[int], tag: str = "other") -> list[np.ndarray]:
        """Uninitialized uint8 buffers of ``sizes`` bytes, consecutive ones
        sharing a block.

        Where no free block holds them all, runs of them go into the free
        blocks the pool has (the largest first), and only what none of those
        holds into a fresh one: a transfer's split buffers, given back once
        sent, then serve the unpack's outputs (and those, given back, the
        next transfer's splits) instead of fresh pages, which cost far more
        than the copies into them.  A buffer is never cut across blocks.
        """
        sizes = [int(s) for s in sizes]
        total = sum(sizes)
        if self.limit <= 0 or total < MIN_POOLED_BYTES:
            return self._cut(self.empty(total, np.uint8, tag=tag), sizes)
        with self._lock:
            self._absorb_returned()
            free = list(self._sizes)
        runs: list[list[int]] = []
        rest = sizes
        # Only when no single free block serves the whole request.
        while rest and free and not self._serves_any(free, sum(rest)):
            largest = free.pop()
            run, used = [], 0
            for size in rest:
                if used + size > largest:
                    break
                run.append(size)
                used += size
            if not run or not self._serves(largest, used):
                break
            runs.append(run)
            rest = rest[len(run) :]
        if rest:
            runs.append(rest)
        buffers: list[np.ndarray] = []
        for run in runs:
            buffers.extend(self._cut(self.empty(sum(run), np.uint8, tag=tag), run))
        return buffers

    @staticmethod
    def _cut(block: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
        out, start = [], 0
        for size in sizes:
            out.append(block[start : start + size])
            start += size
        return out

    @staticmethod
    def _serves(block_size: int, nbytes: int) -> bool:
        """Whether a free block of ``block_size`` bytes serves a request of ``nbytes``."""
        return nbytes <= block_size <= nbytes * SLACK * HEADROOM + _HUGE

    def _serves_any(self, free: Sequence[int], nbytes: int) -> bool:
        i = bisect.bisect_left(free, nbytes)
        return i < len(free) and self._serves(free[i], nbytes)

    def _take(self, nbytes: int) -> mmap.mmap | None:
        i = bisect.bisect_left(self._sizes, nbytes)
        if i == len(self._sizes) or not self._serves(self._sizes[i], nbytes):
            return None
        del self._sizes[i]
        block, _ = self._blocks.pop(i)
        self.statistics.bytes_free -= len(block)
        return block

    def _absorb_returned(self) -> None:
        stats = self.statistics
        now = time.monotonic()
        while self._returned:
            block, tag = self._returned.popleft()
            size = len(block)
            self._in_use[tag] -= size
            stats.bytes_in_use -= size
            if stats.bytes_free + size > self.limit and _unmap(block):
                stats.bytes_released += size
                continue
            i = bisect.bisect_left(self._sizes, size)
            self._sizes.insert(i, size)
            self._blocks.insert(i, (block, now))
            stats.bytes_free += size
            stats.bytes_free_peak = max(stats.bytes_free_peak, stats.bytes_free)

    # -- giving back ----------------------------------------------------------

    def release_idle(self, older_than: float | None = None, arrow: bool = True) -> int:
        """Unmap free blocks unused for ``older_than`` seconds (an eighth of
        that while every shuffle running unpacks, none while one still
        transfers); all of them once no shuffle has run on the worker for
        that long.

        ``older_than`` defaults to ``idle_release``; 0 releases every free
        block now.  ``arrow``: pyarrow's memory may go too (where the worker
        is idle or paused; :func:`release_arrow_unused`).  Returns the bytes
        unmapped.
        """
        older_than = self.idle_release if older_than is None else older_than
        # A worker distributed paused for its memory runs no task until that
        # drops, and nothing a shuffle keeps for speed is worth that: free
        # blocks go, and so does what malloc kept, as when no shuffle runs.
        # So they do once it passes its spill fraction, before the pause.
        paused = self.worker_paused() or self.worker_spilling()
        gone = self.workers_gone()
        with self._lock:
            self._absorb_returned()
            now = time.monotonic()
            active, since = self._activity.active, self._activity.since
            # Once every worker of this process closed, nothing will reuse
            # the blocks: no grace period.
            quiet = (not active and (now - since >= older_than or gone)) or paused
            # While shuffles transfer, free blocks wait for their unpacks,
            # whose outputs take them up (HostBufferPool.empty_buffers).
            # Once every one unpacks, a block nobody took for an eighth of
            # the grace period is one more than the outputs need: it would
            # only add to the peak.
            transferring = active and self._activity.unpacking < active and older_than > 0
            unused = older_than / 8 if active else older_than
            released = 0
            keep_sizes, keep_blocks = [], []
            for size, (block, returned) in zip(self._sizes, self._blocks, strict=True):
                stale = not transferring and now - max(returned, since) >= unused
                if (quiet or stale) and _unmap(block):
                    released += size
                else:
                    keep_sizes.append(size)
                    keep_blocks.append((block, returned))
            self._sizes, self._blocks = keep_sizes, keep_blocks
            self.statistics.bytes_free -= released
            self.statistics.bytes_released += released
            trim = released > 0 or (quiet and not self._idle_released)
            if quiet:
                self._idle_released = True
            arrow = arrow and quiet
            arrow_now = arrow_allocated()
            if arrow and paused and self._arrow_at_trim - arrow_now >= ARROW_FREED_BYTES:
                trim = True
            self._arrow_at_trim = max(self._arrow_at_trim, arrow_now)
        # The heaps kept what was freed while shuffles ran, pooled or not.
        # (Outside the lock: restoring waits for other threads.)
        if quiet and self._restore_malloc():
            trim = True
        if trim:
            # Memory the C allocator holds (received messages, pickles,
            # pandas internals) goes back too; pyarrow's only once idle or
            # paused (release_arrow_unused says why).
            trim_allocators(arrow=arrow)
            if arrow:
                with self._lock:
                    self._arrow_at_trim = arrow_allocated()
            if paused:
                self.statistics.pause_releases += 1
            else:
                self.statistics.idle_releases += 1
        return released

    def watch_arrow_frees(self, values: Any = None) -> None:
        """``values``, a large Arrow-backed pandas array, is being pickled:
        give back what pyarrow frees when it goes, and for the next
        :data:`ARROW_WATCH_SECONDS` (looked at every
        :data:`ARROW_WATCH_INTERVAL` on the worker's event loop), while a
        worker of this process is over distributed's target fraction.

        Distributed spills an output by pickling it and dropping it, and
        reads it back into fresh memory when a task needs it, often in the
        same step of its event loop (the next task's inputs are gathered
        right after a new result made it spill).  pyarrow's allocator
        (mimalloc) keeps the freed strings until asked, and gives back
        another thread's only when asked on the main thread (from the pool's
        trimmer thread: nothing of 321 MiB the main thread freed): measured
        on a 1 GiB worker, 195 MiB kept beside the 535 MiB read back, a peak
        of 93% of the limit where the same runs peaked at 74-80% without
        them.  So the array's Arrow memory goes when the array does (a
        finalizer drops its columns and asks), in the thread that drops it
        (distributed's event loop).  Only in a worker's process
        (:meth:`watch_worker`).
        """
        if not self._watched_workers or self.workers_gone():
            return
        with self._lock:
            if time.monotonic() >= self._arrow_watch_until:
                self._arrow_watch_peak = 0
            self._arrow_watch_until = time.monotonic() + ARROW_WATCH_SECONDS
            self._arrow_watch_peak = max(self._arrow_watch_peak, arrow_allocated())
        # Only pandas' own state: anything else in it could refer back to
        # the array, which the finalizer (holding the state) would then keep.
        if (
            values is not None
            and id(values) not in self._arrow_watched
            and set(values.__dict__) <= _ARROW_ARRAY_STATE
        ):
            dropped = weakref.finalize(values, self._arrow_dropped, id(values), values.__dict__)
            dropped.atexit = False  # at exit the array may still be in use
            self._arrow_watched[id(values)] = dropped
        if threading.current_thread() is threading.main_thread():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            polled = self._arrow_polling
            if polled is None or polled is not loop or polled.is_closed():
                self._arrow_polling = loop
                loop.call_soon(self._poll_watched_arrow, loop)

    def _arrow_dropped(self, key: int, state: dict[str, Any]) -> None:
        """A watched array is being deallocated: its columns go now (they
        would after this call), and what pyarrow freed goes back."""
        self._arrow_watched.pop(key, None)
        state.clear()
        with contextlib.suppress(Exception):  # a finalizer must not raise
            self.release_watched_arrow(wait=False)

    def release_arrow_on_main_loop(self) -> None:
        """Give back pyarrow's freed memory on the event loop of the main
        thread, if a watched worker runs its loop there (a Nanny's worker
        does); one such call queued at a time."""
        loop = self._main_loop
        if loop is None or loop.is_closed() or self._main_pending:
            return
        self._main_pending = True
        try:
            loop.call_soon_threadsafe(self._release_arrow_on_main)
        except RuntimeError:  # closed meanwhile
            self._main_pending = False

    def _release_arrow_on_main(self) -> None:
        self._main_pending = False
        _release_arrow_here()

    def _poll_watched_arrow(self, loop: Any) -> None:
        """On the main thread's event loop (a worker's), every
        :data:`ARROW_WATCH_INTERVAL` while a watch lasts."""
        again = False
        try:
            self.release_watched_arrow()
            again = time.monotonic() < self._arrow_watch_until and not loop.is_closed()
            if again:
                loop.call_later(ARROW_WATCH_INTERVAL, self._poll_watched_arrow, loop)
        except Exception:  # pragma: no cover - a poll must not break the loop
            logger.exception("gpushuffle: giving back pyarrow's freed memory failed")
            again = False
        finally:
            if not again and self._arrow_polling is loop:
                self._arrow_polling = None

    def release_watched_arrow(self, wait: bool = True) -> bool:
        """Within a watch, give back what pyarrow freed since the watch began
        or last gave memory back (at least :data:`ARROW_FREED_BYTES`) if a
        watched worker is over its
        target fraction; True if it did.  Without ``wait``, takes no lock it
        would wait for (in a finalizer, which may run inside a pool call of
        the same thread)."""
        if time.monotonic() >= self._arrow_watch_until:
            return False
        if not self._lock.acquire(blocking=wait):
            return False
        try:
            now = arrow_allocated()
            freed = self._arrow_watch_peak - now >= ARROW_FREED_BYTES
            self._arrow_watch_peak = max(self._arrow_watch_peak, now)
        finally:
            self._lock.release()
        if not freed or not self._over_fraction("memory_target_fraction", "memory_spill_fraction"):
            return False
        release_arrow_unused()
        if self._lock.acquire(blocking=wait):
            try:
                self._arrow_watch_peak = self._arrow_at_trim = arrow_allocated()
            finally:
                self._lock.release()
        self.statistics.arrow_spill_releases += 1
        return True

    def watch_worker(self, worker: Any) -> None:
        """Give back free blocks and malloc's heaps while ``worker`` is paused
        (distributed's ``worker.memory.pause``), shuffles running or not."""
        with self._workers_lock:
            self._workers.add(worker)
            self._watched_workers = True
        if threading.current_thread() is threading.main_thread():
            with contextlib.suppress(RuntimeError):  # no loop running here
                self._main_loop = asyncio.get_running_loop()
        self._ensure_trimmer()

    def workers_gone(self) -> bool:
        """Whether every worker given to :meth:`watch_worker` has closed."""
        with self._workers_lock:
            return self._watched_workers and not any(_running(w) for w in self._workers)

    def worker_paused(self) -> bool:
        from distributed.core import Status

        with self._workers_lock:
            workers = list(self._workers)
        return any(getattr(w, "status", None) == Status.paused for w in workers)

    def worker_spilling(self) -> bool:
        """Whether this process holds more than distributed's ``spill``
        fraction of a watched worker's memory limit (where distributed starts
        moving the worker's data to disk).

        Free blocks kept for a shuffle's unpack are memory too: on 550 MiB
        workers with both cores busy they were 54 to 164 MiB of peaks at
        80-87% of the limit, and once the Nanny's 95% came before the pause
        at 80% was acted on.
        """
        return self._over_fraction("memory_spill_fraction")

    def _over_fraction(self, *names: str) -> bool:
        """Whether RSS exceeds a watched worker's limit times the first of
        its memory manager's fractions ``names`` that is set."""
        # No lock: called in finalizers too.  Workers are added once per
        # shuffle; a set changed while copied is read again.
        for _ in range(3):
            with contextlib.suppress(RuntimeError):
                workers = list(self._workers)
                break
        else:
            return False
        lines = []
        for worker in workers:
            manager = getattr(worker, "memory_manager", None)
            limit = getattr(manager, "memory_limit", None)
            fraction = next((f for n in names if (f := getattr(manager, n, None))), None)
            if limit and fraction:
                lines.append(limit * fraction)
        if not lines:
            return False
        import psutil

        return psutil.Process().memory_info().rss > min(lines)

    def _restore_malloc(self) -> bool:
        restored = self.malloc.restore()
        self.statistics.malloc_reusing = int(self.malloc.reusing)
        return restored

    def count_unpack(self) -> bool:
        """Count one more shuffle on this worker unpacking; True if every
        holder now unpacks.

        Free blocks then serve the outputs (:meth:`empty_buffers`); from now
        on one unused for an eighth of ``idle_release`` is more than they
        need and goes.  Its caller then trims malloc: what the transfer left
        in malloc's heaps is not needed either.  A shuffle still
        transferring keeps both.
        """
        with self._lock:
            self._activity.unpacking += 1
            every = self._activity.unpacking >= self._activity.active
            if every:
                # Unused since now, not since they were given back: the
                # outputs have not asked yet.
                self._activity.since = time.monotonic()
            return every

    def uncount_unpack(self) -> None:
        """A shuffle counted by :meth:`count_unpack` transfers again (a run
        that adopted its store after a worker's loss)."""
        with self._lock:
            self._activity.unpacking = max(0, self._activity.unpacking - 1)

    # -- shuffles running -----------------------------------------------------

    def hold(self) -> None:
        """A shuffle started on this worker: keep free blocks for it."""
        with self._lock:
            self._activity.active += 1
            self._activity.since = time.monotonic()
            if self.malloc.reuse():
                self.statistics.malloc_reuses += 1
                self.statistics.malloc_reusing = 1
        self._ensure_trimmer()

    def unhold(self, unpacked: bool = False) -> None:
        """A shuffle ended (``unpacked``: after :meth:`count_unpack`); after
        ``idle_release`` without one, free blocks go."""
        with self._lock:
            self._activity.active = max(0, self._activity.active - 1)
            if unpacked:
                self._activity.unpacking = max(0, self._activity.unpacking - 1)
            self._activity.since = time.monotonic()
            restore = self.idle_release <= 0 and not self._activity.active
        if restore and self._restore_malloc():
            # Without a grace period nothing would put malloc's settings back.
            trim_allocators()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        self.hold()
        try:
            yield
        finally:
            self.unhold()

    def bound_by(self, host_budget: int) -> None:
        """Keep at most twice the store's host budget in free blocks (its own,
        and as much for the outputs built from it), within the configured limit."""
        self.limit = min(self.configured_limit, 2 * max(0, int(host_budget)))

    def in_use(self, tag: str) -> int:
        """Bytes of blocks in use for ``tag`` (one of :data:`TAGS`)."""
        with self._lock:
            self._absorb_returned()
            return self._in_use[tag]

    def usage(self) -> dict[str, int]:
        """Bytes of free blocks (``free``) and of blocks in use, by tag."""
        with self._lock:
            self._absorb_returned()
            return {"free": self.statistics.bytes_free, **self._in_use}

    # -- background release -------------------------------------------------

    def _ensure_trimmer(self) -> None:
        if self._trimmer is not None or self.idle_release <= 0:
            return
        with self._lock:
            if self._trimmer is not None:
                return
            self._trimmer = threading.Thread(
                target=self._trim_while_needed, daemon=True, name="gpushuffle-host-pool-trimmer"
            )
            self._trimmer.start()

    def _trim_while_needed(self) -> None:
        """Release idle memory until the pool holds none and no shuffle runs.

        The thread then ends: a process that shuffled once keeps no thread
        (distributed's test harness counts threads left behind) and no
        memory; the next :meth:`empty`, :meth:`hold` or :meth:`watch_worker`
        starts another.
        """
        while True:
            time.sleep(min(max(self.idle_release / 16, 0.02), 0.1))
            try:
                self.release_idle()
            except Exception:  # pragma: no cover - nothing would give memory back
                # A trimmer that died would leave every free block mapped.
                logger.exception("gpushuffle: releasing idle host memory failed")
            with self._lock:
                self._absorb_returned()
                if self._idle():
                    self._trimmer = None
                    return

    def _idle(self) -> bool:
        """Whether nothing is left to release: no shuffle, no block free or
        in use, malloc's settings restored.  Under the lock."""
        return (
            not self._activity.active
            and not self._sizes
            and not self._returned
            and not any(self._in_use.values())
            and self._idle_released
            and not self.malloc.reusing
        )


def _running(worker: Any) -> bool:
    """Whether ``worker`` has not closed (it may still run shuffles)."""
    from distributed.core import Status

    return getattr(worker, "status", None) not in (Status.closing, Status.closed, Status.failed)


_POOL: HostBufferPool | None = None
_POOL_LOCK = threading.Lock()


def watch_arrow_frees(values: Any = None) -> None:
    """:meth:`HostBufferPool.watch_arrow_frees` on this process's pool, if
    it has one (a process that never shuffled has no worker to watch)."""
    if _POOL is not None:
        _POOL.watch_arrow_frees(values)


def host_pool() -> HostBufferPool:
    """This process's pool, sized from ``gpushuffle.memory.host-pool``."""
    global _POOL
    if _POOL is None:
        with _POOL_LOCK:
            if _POOL is None:
                _POOL = _make_pool()
    return _POOL


def _make_pool() -> HostBufferPool:
    from dask.utils import parse_timedelta

    from gpushuffle import config
    from gpushuffle.engine.memory import auto_host_limit

    total = config.worker_memory_limit()
    limit = config.parse_budget(
        config.get("memory.host-pool.limit"), total, "memory.host-pool.limit"
    )
    # Free blocks are memory too: never keep more than what the store may
    # hold plus as much again, for the outputs built from it (the blocks a
    # run had in use at its unpack, which the next run takes up again).
    host_limit = config.get("memory.host-limit")
    budget = (
        auto_host_limit(bool(config.get("storage.disk")))
        if host_limit == "auto"
        else config.parse_budget(host_limit, total, "memory.host-limit")
    )
    configured = limit
    limit = min(limit, 2 * budget)
    idle = parse_timedelta(config.get("memory.host-pool.idle-release"), default="s")
    return HostBufferPool(
        limit=limit,
        configured_limit=configured,
        idle_release=idle or 0,
        malloc_reuse=bool(config.get("memory.host-pool.malloc-reuse")),
        huge_pages=huge_pages_setting(config.get("memory.host-pool.huge-pages")),
    )
