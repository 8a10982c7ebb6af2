"""Shards between workers on one machine: the receiver reads the sender's memory.

Workers on one machine (a ``LocalCluster``, several workers per node) send
each other shards over TCP through the loopback device: the sender's kernel
copies every byte into socket buffers, the receiver's copies it out, and
both event loops spend their time in ``send`` and ``recv``.  With Linux's
cross-memory attach (``process_vm_readv(2)``, what UCX's ``cma`` transport
uses for host memory) the sender *lends* a shard's large buffers instead: the
message carries where they are in the sender's memory, and the receiver
copies them, once, straight into buffers of its own.  The sender keeps the
buffers alive and unchanged until the receiver has answered, which it does
anyway (a send returns once the receiver has stored the shards); a send that
ends any other way leaves them alive until the run closes.

A sender lets go of what it lent only once the receiver answered, or when
its run closes; a receiver still reading then (its own run not yet told
that the shuffle failed) would read memory the sender's next split may be
writing, and store rows that were never sent: harmless where every failed
run's store is dropped, but a recovering run adopts what the run before it
stored (:mod:`gpushuffle.engine.recovery`).  So every lent message carries a
*lease*: a cell in the sender's memory that holds a random value until the
sender withdraws the lease (zeroes it) as its run closes, before it frees
anything.  The receiver reads the cell in the same call, after the frames:
a value that came back unchanged proves the frames were read before the
sender let go of them; any other raises :class:`LendWithdrawn` and the
shard is not stored.

The receiver reads only a process it has proved to be the sender, in the
same system call that reads the data.  Each process keeps a random token
(:mod:`secrets`, 32 bytes, made anew in a forked child) in its own memory;
a message carries the token's address and value, and every
``process_vm_readv`` call that reads lent frames reads the token too.  One
call reads one process, so a token that comes back equal proves that every
byte of that call came from the sender; anything else (another process
under a recycled process id, a worker in another container whose process
id and memory layout are the same, as with address-space randomization
off) is discarded, never used.  Cheap first tests give the common refusals
a clear reason: the same kernel (``/proc/sys/kernel/random/boot_id``) and
the same PID namespace (``/proc/self/ns/pid``: workers in separate
containers see each other's process ids as someone else's).

Every refusal (another kernel or namespace, a token that does not match,
``EPERM`` from another user or a seccomp profile such as Docker's default,
``ESRCH``, ``EFAULT``, a short read) raises :class:`LendRefused`: the
receiver answers so, and the sender sends that message, and every later one
to that worker, as bytes.  Where Yama's ``ptrace_scope`` is above 0
(Ubuntu's default is 1: a process may read only its descendants, and
workers are siblings) nothing is lent at all.
``gpushuffle.comm.same-host-reads: false`` turns lending off.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

#: Frames smaller than this travel in the message: lending them would cost
#: more in bookkeeping than the copies it saves.
LEND_MIN_BYTES = 64 << 10

#: Lent frames start this far apart in the receiver's buffer (cache lines).
_ALIGN = 64

#: iovecs per process_vm_readv or writev call (IOV_MAX on Linux).
IOV_MAX = 1024


class LendRefused(Exception):
    """The receiver cannot read the sender's memory; send the bytes instead."""


class LendWithdrawn(Exception):
    """The sender let go of lent frames while they were read (its run closed)."""


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _process_vm_readv() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_ssize_t
    function.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return function


_readv = _process_vm_readv()

_lock = threading.Lock()
_identity: dict[str, Any] | None = None
#: Peers (addresses) that could not read this process's memory, and why.
_refused: dict[str, str] = {}

#: Bytes of the token that proves a process's identity to a reader.
TOKEN_BYTES = 32

#: This process's token, at one address for the life of the process.
_token = np.frombuffer(secrets.token_bytes(TOKEN_BYTES), dtype=np.uint8).copy()


#: Lease cells (:class:`Lease`), at one address for the life of the process:
#: one per run that lends at once, so a few are ever in use.
_LEASE_CELLS = 4096
_leases = np.zeros(_LEASE_CELLS, dtype=np.uint64)
_free_cells = list(range(_LEASE_CELLS))
# Reentrant: a run's finalizer (its lease's safety net) may withdraw from
# the cycle collector, which can run on a thread inside a lease call.
_lease_lock = threading.RLock()


def _new_token() -> None:
    """A forked child is another process: it must not prove to be its parent,
    nor hold its leases."""
    global _identity
    _token[:] = np.frombuffer(secrets.token_bytes(TOKEN_BYTES), dtype=np.uint8)
    _identity = None
    _leases[:] = 0
    _free_cells[:] = range(_LEASE_CELLS)


class Lease:
    """What makes a lend good: a cell of this process's memory that holds
    :attr:`value` until :meth:`withdraw` (before anything lent under it is
    freed).  A reader reads the cell after the frames, in the same call."""

    def __init__(self, cell: int) -> None:
        self._cell: int | None = cell
        # A forked child inherits this object, not the cell (reset there).
        self._pid = os.getpid()
        # Never zero: zero is a withdrawn lease.
        self.value = secrets.randbits(63) + 1
        _leases[cell] = self.value
        self.address = int(_leases.ctypes.data) + cell * _leases.itemsize

    def as_message(self) -> list[int]:
        return [self.address, self.value]

    @property
    def withdrawn(self) -> bool:
        return self._cell is None

    def withdraw(self) -> None:
        """Void the lease (a reader from now on is refused); idempotent."""
        with _lease_lock:
            cell, self._cell = self._cell, None
            if cell is not None and self._pid == os.getpid():
                _leases[cell] = 0
                _free_cells.append(cell)


def new_lease() -> Lease | None:
    """A lease for a run's lends; None when every cell is taken (send bytes)."""
    with _lease_lock:
        if not _free_cells:
            return None
        cell = _free_cells.pop()
    return Lease(cell)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_token)


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def identity() -> dict[str, Any] | None:
    """Who this process is, for a receiver to check; None where lending is impossible."""
    global _identity
    pid = os.getpid()
    if _identity is not None and _identity["pid"] == pid:
        return _identity
    if _readv is None or _ptrace_restricted():
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return None
    _identity = {
        "boot": boot,
        "pid_namespace": _pid_namespace(),
        "pid": pid,
        "token_address": int(_token.ctypes.data),
        "token": _token.tobytes().hex(),
    }
    return _identity


def _ptrace_restricted(path: str = "/proc/sys/kernel/yama/ptrace_scope") -> bool:
    """Whether Yama lets a process read only its descendants (or none): sibling
    workers could not read each other (Ubuntu's default is 1)."""
    try:
        with open(path) as f:
            return int(f.read().strip()) > 0
    except (OSError, ValueError):
        return False  # no Yama: the classic rule, same user


def may_lend_to(address: str) -> bool:
    """Whether shards for ``address`` are lent (it has not refused)."""
    return address not in _refused and identity() is not None


def refused(address: str, reason: str) -> bool:
    """Record that ``address`` cannot read this process; True the first time."""
    with _lock:
        first = address not in _refused
        _refused[address] = reason
    return first


def lend(
    frames: Sequence[Any], own: Iterable[int] = ()
) -> tuple[list[list[int]], list[Any], list[Any]]:
    """Split ``frames`` into lent ones and those sent in the message.

    Returns the lent frames' ``[position, address, nbytes, own]``, the frames
    the message carries, and the objects to keep alive until the receiver
    answers.  ``own``: positions of frames the receiver reads into memory of
    their own (:data:`~gpushuffle.engine.tables.OWN_FRAMES`).
    """
    own = frozenset(own)
    lent: list[list[int]] = []
    carried: list[Any] = []
    kept: list[Any] = []
    for position, frame in enumerate(frames):
        view = _host_view(frame)
        if view is None or view.nbytes < LEND_MIN_BYTES:
            carried.append(frame)
            continue
        array = np.frombuffer(view, dtype=np.uint8)
        lent.append([position, int(array.ctypes.data), int(view.nbytes), int(position in own)])
        kept.append(frame)
    return lent, carried, kept


def _host_view(frame: Any) -> memoryview | None:
    if hasattr(frame, "__cuda_array_interface__"):
        return None
    try:
        view = memoryview(frame)
    except TypeError:
        return None
    if not view.c_contiguous:
        return None
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


def read(
    lender: dict[str, Any],
    carried: Sequence[Any],
    allocate: Callable[[int], np.ndarray] | None = None,
) -> list[Any]:
    """The frames of a message whose large frames ``lender`` lent.

    ``lender`` is what :func:`identity` and :func:`lend` gave the sender:
    its identity and the lent frames' positions, addresses and sizes.  The
    lent frames are read into one buffer from ``allocate`` (bytes -> uint8
    array; ``numpy.empty`` by default), each at a multiple of 64 bytes, but
    those marked ``own``, which get a ``numpy.empty`` each.  Raises
    :class:`LendRefused` when they cannot be read from here, or when what
    was read did not come from the sender (its token did not come back),
    and :class:`LendWithdrawn` when the sender withdrew the lease the lender
    names (``"lease"``: its cell's address and value) before the frames were
    all read.
    """
    me = identity()
    if me is None:
        raise LendRefused("this process cannot read other processes' memory")
    if lender["boot"] != me["boot"]:
        raise LendRefused("the sender runs under another kernel (another machine)")
    theirs, ours = lender.get("pid_namespace"), me["pid_namespace"]
    if theirs != ours or theirs is None:
        raise LendRefused(
            f"the sender runs in another PID namespace ({theirs}, here {ours}: another "
            "container?), where its process id names another process"
        )
    pid = int(lender["pid"])
    expected_token = bytes.fromhex(lender["token"])
    if len(expected_token) != TOKEN_BYTES:
        raise LendRefused("the sender's identity token is malformed")
    token = np.empty(TOKEN_BYTES, dtype=np.uint8)
    lent = lender["frames"]
    starts, total = [], 0
    for _, _, nbytes, own in lent:
        starts.append(total)
        if not own:
            total += -(-nbytes // _ALIGN) * _ALIGN
    block = (allocate or _empty)(total + _ALIGN)
    block = block[-block.ctypes.data % _ALIGN :][:total]
    buffers = [
        _empty(nbytes) if own else block[start : start + nbytes]
        for start, (_, _, nbytes, own) in zip(starts, lent, strict=True)
    ]
    lease = lender.get("lease")
    seen = np.zeros(1, dtype=np.uint64)
    extra = 1 + (lease is not None)
    # Each call reads the token first, then up to IOV_MAX - 2 frames, then
    # the lease: the token proves which process that very call read, the
    # lease that the sender still held every frame read before it (the
    # kernel reads the iovecs in order).
    per_call = IOV_MAX - extra
    for first in range(0, max(len(lent), 1), per_call):
        batch = range(first, min(first + per_call, len(lent)))
        local = (_Iovec * (len(batch) + extra))()
        remote = (_Iovec * (len(batch) + extra))()
        token[:] = 0
        local[0] = _Iovec(token.ctypes.data, TOKEN_BYTES)
        remote[0] = _Iovec(int(lender["token_address"]), TOKEN_BYTES)
        expected = TOKEN_BYTES
        for k, i in enumerate(batch, start=1):
            _, address, nbytes, _ = lent[i]
            local[k] = _Iovec(buffers[i].ctypes.data, nbytes)
            remote[k] = _Iovec(address, nbytes)
            expected += nbytes
        if lease is not None:
            seen[0] = 0
            local[len(batch) + 1] = _Iovec(seen.ctypes.data, seen.nbytes)
            remote[len(batch) + 1] = _Iovec(int(lease[0]), seen.nbytes)
            expected += seen.nbytes
        got = _readv(pid, local, len(batch) + extra, remote, len(batch) + extra, 0)
        if got != expected:
            error = ctypes.get_errno()
            reason = os.strerror(error) if got < 0 else f"read {got} of {expected} bytes"
            raise LendRefused(f"process_vm_readv from process {pid}: {reason}")
        if token.tobytes() != expected_token:
            raise LendRefused(
                f"process {pid} is not the sender: its identity token does not match "
                "(a process id reused, or another container's process)"
            )
        # process_vm_readv copies the remote iovecs in order, pinning each
        # under the sender's mmap lock: the lease is loaded after every frame
        # of this call (ordered on arm64 by that lock, on x86-64 by its load
        # order), and the sender zeroes it before it frees any of them.
        if lease is not None and int(seen[0]) != int(lease[1]):
            raise LendWithdrawn(
                f"process {pid} let go of the frames it lent while they were read "
                "(its run closed): not used"
            )
    frames: list[Any] = list(carried)
    for (position, *_), buffer in zip(lent, buffers, strict=True):
        frames.insert(position, buffer)
    return frames


def _empty(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)
