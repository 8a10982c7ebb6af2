"""Hosts on one machine, for tests and benchmarks across a network.

Each *host* is a network namespace of its own with one address on a bridge
the rig creates, and a PID namespace with its own ``/proc``: its workers
(one ``dask worker --nworkers N`` process tree) see each other, not the
other hosts' processes, so same-host reads (:mod:`gpushuffle.samehost`)
carry the bytes inside a host and the link carries the bytes across.  The
scheduler and the client run in the calling process's namespace, on the
bridge's own address.  Each host's link can be shaped with a ``tc`` token
bucket (both directions), cut (every packet dropped), or its host killed
(every process in it, SIGKILL).

Everything the rig makes is named ``gsr<pid>...`` and torn down by
:meth:`Rig.close` (also at interpreter exit, and at the next rig's start if
its maker died).  Needs root and iproute2 (``ip``, ``tc``); :func:`unusable`
says why not otherwise.  This kernel has no ``netem``: no added delay.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

#: Prefix of every namespace and interface a rig makes.
PREFIX = "gsr"
#: Seconds to wait for the scheduler and for each host's workers.
START_TIMEOUT = 90
#: Rigs this process has made.
_made = 0


def unusable() -> str | None:
    """Why no rig can be made here, or None."""
    if sys.platform != "linux":
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"needs {tool} (Debian: apt-get install iproute2 util-linux)"
    return None


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def link_bits(rate: str) -> int:
    """``tc``'s rate ('200mbit', '1gbit', '10gbit') in bits per second."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)bit", rate.strip().lower())
    if not match:
        raise ValueError(f"link rate {rate!r}: write it as tc does, e.g. 200mbit or 1gbit")
    return int(float(match[1]) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[match[2]])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die_with_parent() -> None:
    """In a child before exec: SIGKILL it when the process that made it ends
    (a rig's maker killed by a signal runs no clean-up of its own)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def sweep_stale() -> None:
    """Remove what rigs of processes that no longer run left behind."""
    for directory in glob.glob(os.path.join(tempfile.gettempdir(), f"{PREFIX}-*-*")):
        match = re.search(rf"{PREFIX}-(\d+)-", directory)
        if match and not _pid_alive(int(match[1])):
            shutil.rmtree(directory, ignore_errors=True)
    names = _run("ip", "netns", "list", check=False).stdout.split()
    links = re.findall(rf"^\d+: ({PREFIX}\d+[a-z0-9]*)[@:]", _run("ip", "-o", "link").stdout, re.M)
    for name in {*names, *links}:
        match = re.match(rf"{PREFIX}(\d+)", name)
        if match and not _pid_alive(int(match[1])):
            _kill_namespace(name)
            _run("ip", "netns", "del", name, check=False)
            _run("ip", "link", "del", name, check=False)


def _kill_namespace(namespace: str) -> None:
    pids = _run("ip", "netns", "pids", namespace, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


@dataclass
class Host:
    index: int
    workers: int
    namespace: str
    #: The host's end of its link is ``eth0`` in its namespace; this is the
    #: bridge's end, in the rig's namespace.
    port: str
    address: str
    rate: str | None = None
    process: subprocess.Popen[bytes] | None = None


@dataclass
class Rig:
    """``hosts[i]`` workers on host ``i``; each host's link at ``rate`` (None: unshaped).

    Use as a context manager; :attr:`scheduler_address` is what a
    :class:`distributed.Client` connects to.
    """

    hosts: Sequence[int]
    rate: str | None = None
    threads: int = 1
    memory_limit: str = "2GiB"
    #: Dask configuration for the scheduler and workers, as ``DASK_`` variables.
    env: Mapping[str, str] = field(default_factory=dict)
    scheduler_address: str = ""
    _hosts: list[Host] = field(default_factory=list)
    _scheduler: subprocess.Popen[bytes] | None = None
    _directory: str = ""
    _bridge: str = ""
    _closed: bool = False

    def __enter__(self) -> Rig:
        why = unusable()
        if why:
            raise RuntimeError(f"cannot make a rig of hosts: {why}")
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- set-up ------------------------------------------------------------

    def _start(self) -> None:
        sweep_stale()
        atexit.register(self.close)
        global _made
        pid, _made = os.getpid(), _made + 1
        self._directory = tempfile.mkdtemp(prefix=f"{PREFIX}-{pid}-")
        # Names carry the maker's pid (for sweep_stale) and a letter per rig
        # of this process; so does the /24, so that rigs alive at once (two
        # in a test run, two test runs) do not share one.
        name = f"{PREFIX}{pid}{chr(ord('a') + _made % 26)}"
        subnet = f"10.{100 + _made % 100}.{pid % 256}"
        self._bridge = f"{name}b"
        _run("ip", "link", "add", self._bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{subnet}.1/24", "dev", self._bridge)
        _run("ip", "link", "set", self._bridge, "up")
        for i, workers in enumerate(self.hosts):
            host = Host(i, workers, f"{name}h{i}", f"{name}p{i}", f"{subnet}.{10 + i}")
            self._hosts.append(host)
            self._plug(host)
            self.shape(i, self.rate)
        self._start_scheduler(f"{subnet}.1")
        for host in self._hosts:
            self.start_host(host.index, wait=False)
        self._wait_for_workers(sum(self.hosts))

    def _plug(self, host: Host) -> None:
        ns = host.namespace
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", host.port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "link", "set", host.port, "master", self._bridge, "up")
        _run("ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _environment(self) -> dict[str, str]:
        return {
            **os.environ,
            "DASK_DISTRIBUTED__WORKER__DAEMON": "False",
            "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "30s",
            **self.env,
        }

    def _start_scheduler(self, address: str) -> None:
        file = os.path.join(self._directory, "scheduler.json")
        log = open(os.path.join(self._directory, "scheduler.log"), "wb")  # noqa: SIM115
        self._scheduler = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distributed.cli.dask_scheduler",
                "--host",
                address,
                "--port",
                "0",
                "--dashboard-address",
                ":0",
                "--scheduler-file",
                file,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self._environment(),
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while not os.path.exists(file) or not os.path.getsize(file):
            if self._scheduler.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the rig's scheduler did not start: {self.log('scheduler')}")
            time.sleep(0.1)
        time.sleep(0.1)  # the file is written in one go, but let it close
        with open(file) as f:
            self.scheduler_address = json.load(f)["address"]

    def start_host(self, index: int, wait: bool = True) -> None:
        """Start host ``index``'s workers (again, after :meth:`kill_host`)."""
        host = self._hosts[index]
        log = open(os.path.join(self._directory, f"host{index}.log"), "ab")  # noqa: SIM115
        host.process = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                host.namespace,
                "unshare",
                "--pid",
                "--fork",
                "--mount-proc",
                # If unshare dies (its maker did: _die_with_parent), the
                # host's first process does, and with it every process of
                # its PID namespace.
                "--kill-child",
                sys.executable,
                "-m",
                "distributed.cli.dask_worker",
                self.scheduler_address,
                "--host",
                host.address,
                "--nworkers",
                str(host.workers),
                "--nthreads",
                str(self.threads),
                "--memory-limit",
                self.memory_limit,
                "--no-dashboard",
                "--name",
                f"host{index}",
                "--local-directory",
                os.path.join(self._directory, f"host{index}"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self._environment(),
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        if wait:
            self._wait_for_workers(sum(self.hosts))

    def _wait_for_workers(self, n: int) -> None:
        from distributed import Client

        with Client(self.scheduler_address, timeout=START_TIMEOUT) as client:
            try:
                client.wait_for_workers(n, timeout=START_TIMEOUT)
            except TimeoutError:
                logs = "; ".join(self.log(f"host{h.index}")[-400:] for h in self._hosts)
                raise RuntimeError(f"the rig's workers did not all start: {logs}") from None

    # -- the links -----------------------------------------------------------

    def _qdisc(self, host: Host, verb: str, *spec: str, check: bool = True) -> None:
        # Egress on both ends: the host's sends (eth0 in its namespace) and
        # what the bridge sends it (its port here).
        inside = ("ip", "netns", "exec", host.namespace)
        _run(*inside, "tc", "qdisc", verb, "dev", "eth0", "root", *spec, check=check)
        _run("tc", "qdisc", verb, "dev", host.port, "root", *spec, check=check)

    def shape(self, index: int, rate: str | None) -> None:
        """Host ``index``'s link at ``rate`` each way (None: unshaped)."""
        host = self._hosts[index]
        host.rate = rate
        if rate is None:
            self._qdisc(host, "del", check=False)
            return
        bits = link_bits(rate)
        # A bucket of 4 ms of the rate (at least 64 KiB: one TSO segment),
        # and a queue of 20 ms behind it: enough for TCP to keep the link full.
        burst = max(64 << 10, bits // 8 // 250)
        self._qdisc(host, "replace", "tbf", "rate", rate, "burst", str(burst), "latency", "20ms")

    @contextlib.contextmanager
    def cut(self, index: int) -> Iterator[None]:
        """Drop every packet on host ``index``'s link while inside."""
        host = self._hosts[index]
        self._qdisc(host, "replace", "pfifo", "limit", "0")
        try:
            yield
        finally:
            self.shape(index, host.rate)

    def link_bytes(self, index: int) -> tuple[int, int]:
        """Bytes host ``index`` has sent and received over its link."""
        base = f"/sys/class/net/{self._hosts[index].port}/statistics"
        with open(f"{base}/rx_bytes") as sent, open(f"{base}/tx_bytes") as received:
            return int(sent.read()), int(received.read())

    # -- hosts ---------------------------------------------------------------

    def host_of(self, worker_address: str) -> int:
        """The host a worker (``tcp://ip:port``) runs on."""
        ip = worker_address.split("://")[-1].rsplit(":", 1)[0]
        for host in self._hosts:
            if host.address == ip:
                return host.index
        raise KeyError(f"{worker_address} is on none of the rig's hosts")

    def kill_host(self, index: int) -> None:
        """SIGKILL every process of host ``index`` (its nannies too: nothing restarts)."""
        host = self._hosts[index]
        _kill_namespace(host.namespace)
        if host.process is not None:
            host.process.wait(timeout=30)

    def log(self, name: str) -> str:
        path = os.path.join(self._directory, f"{name}.log")
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for host in self._hosts:
            _kill_namespace(host.namespace)
        if self._scheduler is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._scheduler.pid, signal.SIGKILL)
        for process in [self._scheduler, *(h.process for h in self._hosts)]:
            if process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=30)
        for host in self._hosts:
            _run("ip", "netns", "del", host.namespace, check=False)
            _run("ip", "link", "del", host.port, check=False)
        if self._bridge:
            _run("ip", "link", "del", self._bridge, check=False)
        if self._directory:
            shutil.rmtree(self._directory, ignore_errors=True)
        atexit.unregister(self.close)
