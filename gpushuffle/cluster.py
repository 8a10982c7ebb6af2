"""Where a shuffle job runs: finding a usable GPU, planning and starting a
cluster (an embedded ``LocalCluster`` or ``LocalCUDACluster``, or an existing
scheduler), and the worker preload and logging that go with it.

Used by ``gpushuffle shuffle`` and ``gpushuffle demo`` (:mod:`gpushuffle.job`,
:mod:`gpushuffle.cli`) and by the benchmarks (:mod:`gpushuffle.bench`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from gpushuffle.errors import JobError

GIB = 2**30


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


#: Frame backends a job can read with; "auto" picks cuDF where it works.
BACKENDS = ("auto", "pandas", "cudf")
#: How an embedded LocalCUDACluster allocates device memory (``--rmm``).
RMM_MODES = ("pool", "async", "none")


@dataclass(frozen=True)
class ClusterOptions:
    """Where the job runs: an existing scheduler, or an embedded cluster."""

    scheduler: str | None = None
    workers: int | None = None
    protocol: str = "tcp"
    memory_limit: str | None = None
    #: "pool": an RMM pool of half the device, growing as needed (UCX needs a
    #: pool: device memory sent through CUDA IPC from the default allocator
    #: is never freed); "async": CUDA's stream-ordered allocator; "none".
    rmm: str = "pool"


@dataclass(frozen=True)
class ClusterPlan:
    """The embedded cluster to start and the frame backend to read with."""

    kind: str
    backend: str
    note: str | None = None
    #: GPUs a LocalCUDACluster can use (one worker each).
    gpus: int = 0


@dataclass(frozen=True)
class GpuInfo:
    """A CUDA device on which cuDF works, and how many devices are visible."""

    name: str
    count: int = 1

    def __str__(self) -> str:
        return self.name


_GPU_PROBE = """
import cudf, dask_cudf, cupy
# A device allocation and a kernel: cuDF imports fine where it cannot run.
assert int(cudf.Series([1, 2]).sum()) == 3
print(cupy.cuda.runtime.getDeviceCount())
print(cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
"""


def usable_gpu(timeout: float = 120) -> GpuInfo | None:
    """A CUDA device on which cuDF computes, or None.

    A child process imports cuDF and dask_cudf and runs a reduction on the
    device: they import fine on machines without a GPU (or with one too old
    for cuDF, which needs compute capability 7.0), and a CUDA context in this
    process would hold device memory for the whole job.
    """
    if not all(importlib.util.find_spec(m) for m in ("cudf", "dask_cudf", "cupy")):
        return None
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _GPU_PROBE],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = proc.stdout.split("\n")
    if proc.returncode != 0 or len(lines) < 2 or not lines[0].strip().isdigit():
        return None
    return GpuInfo(name=lines[1].strip() or "a CUDA device", count=int(lines[0]))


def cudf_backend_registered() -> bool:
    from gpushuffle.backends import available

    return available("cudf")


def plan_cluster(
    *, dask_cuda: bool, gpu: GpuInfo | None, cudf_backend: bool, backend: str = "auto"
) -> ClusterPlan:
    """``LocalCUDACluster`` with cuDF partitions when a GPU can be used, else ``LocalCluster``.

    A GPU is used only if dask-cuda is installed, cuDF computes on a device
    (``gpu``) and gpushuffle's cuDF backend loads; when the first two hold but
    not the last, the note says so.  ``backend="pandas"`` always plans CPU
    workers; ``backend="cudf"`` raises :class:`JobError` naming what is
    missing instead of falling back.
    """
    if backend not in BACKENDS:
        raise JobError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if backend == "pandas":
        return ClusterPlan("LocalCluster", "pandas")
    missing = None
    if not dask_cuda:
        missing = "dask-cuda is not installed (install gpushuffle's GPU extra)"
    elif not gpu:
        missing = "no GPU on which cuDF can compute (a cuDF reduction failed in a probe)"
    elif not cudf_backend:
        missing = f"{gpu} is usable, but gpushuffle's cuDF backend does not load"
    if missing is not None:
        if backend == "cudf":
            raise JobError(f"--backend cudf: {missing}; or pass --backend pandas")
        note = f"{missing}: shuffling pandas partitions on CPU workers" if gpu else None
        return ClusterPlan("LocalCluster", "pandas", note)
    assert gpu is not None
    return ClusterPlan(
        "LocalCUDACluster",
        "cudf",
        f"{gpu.name} ({gpu.count} visible): cuDF partitions on GPU workers",
        gpus=gpu.count,
    )


def detect_cluster_plan(backend: str = "auto") -> ClusterPlan:
    """:func:`plan_cluster` for this machine.

    The GPU probe starts a process, so it runs only where dask-cuda is
    installed and the backend may be cuDF.
    """
    if backend == "pandas":
        return plan_cluster(dask_cuda=False, gpu=None, cudf_backend=False, backend=backend)
    dask_cuda = importlib.util.find_spec("dask_cuda") is not None
    return plan_cluster(
        dask_cuda=dask_cuda,
        gpu=usable_gpu() if dask_cuda else None,
        cudf_backend=cudf_backend_registered() if dask_cuda else False,
        backend=backend,
    )


def _is_dask_cuda_worker(dask_worker: Any) -> bool:
    """Whether a worker was started by dask-cuda (its data spills from the device)."""
    return type(dask_worker.data).__module__.startswith("dask_cuda") and (
        importlib.util.find_spec("cudf") is not None
    )


def cluster_backend(client: Any, backend: str) -> str:
    """The frame backend for an existing cluster: cuDF if every worker is a dask-cuda one.

    Asking opens no CUDA context on the workers: a CPU worker on a GPU host
    stays off the GPU.
    """
    if backend != "auto":
        return backend
    gpu_workers = client.run(_is_dask_cuda_worker)
    return "cudf" if gpu_workers and all(gpu_workers.values()) else "pandas"


def _worker_version() -> str:
    import gpushuffle

    return gpushuffle.__version__


def _check_memory_limit(value: str | None) -> None:
    if value is None:
        return
    from distributed.worker_memory import parse_memory_limit

    try:
        parse_memory_limit(value, 1, logger=logging.getLogger(__name__))
    except (ValueError, TypeError) as e:
        raise JobError(f"invalid --memory-limit {value!r}: {_first_line(e)}") from e


_WORKER_PRELOAD = "gpushuffle._embedded_worker"


def embedded_worker_preloads() -> list[str]:
    """Worker preloads for a cluster gpushuffle starts and closes itself
    (``gpushuffle shuffle``, ``demo``, ``bench``): the configured ones plus
    :mod:`gpushuffle._embedded_worker` (passing preloads replaces the
    configured ones, so those are kept)."""
    import dask

    return [*dask.config.get("distributed.worker.preload", []), _WORKER_PRELOAD]


@contextlib.contextmanager
def _quiet_shuffle_log(debug: bool) -> Iterator[None]:
    # distributed's scheduler plugin logs a WARNING when each shuffle starts
    # and ends; in an embedded cluster (scheduler in this process) they read
    # like problems.  Kept with --debug.
    logger = logging.getLogger("distributed.shuffle._scheduler_plugin")
    level = logger.level
    if not debug:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def connect(
    options: ClusterOptions,
    plan: ClusterPlan | None,
    note: Callable[[str], None],
    debug: bool = False,
) -> Iterator[Any]:
    """A client of the cluster the job runs on, closed (with the cluster) on exit.

    An embedded cluster's scheduler runs in this process; its shuffle plugin
    logs a warning when each shuffle starts and ends, shown only with
    ``debug``.  Workers' warnings (pausing for lack of memory, say) show.
    """
    from distributed import Client

    if options.scheduler:
        try:
            client = Client(options.scheduler, set_as_default=False)
        except (OSError, TimeoutError, ValueError) as e:
            raise JobError(f"cannot reach scheduler {options.scheduler}: {_first_line(e)}") from e
        with client:
            nworkers = len(client.nthreads())
            if not nworkers:
                raise JobError(f"the cluster at {options.scheduler} has no workers")
            try:
                client.run(_worker_version)
            except Exception as e:
                raise JobError(
                    f"workers at {options.scheduler} cannot run gpushuffle "
                    f"(install it where they run): {_first_line(e)}"
                ) from e
            note(
                f"cluster: {options.scheduler}, {nworkers} workers; "
                f"dashboard {client.dashboard_link}"
            )
            yield client
        return

    assert plan is not None
    kwargs: dict[str, Any] = {
        "protocol": options.protocol,
        "dashboard_address": ":8787",
        # Ctrl-C is this process's to handle: see gpushuffle._embedded_worker.
        "preload": embedded_worker_preloads(),
    }
    if options.workers is not None:
        kwargs["n_workers"] = options.workers
    if options.memory_limit is not None:
        kwargs["memory_limit"] = options.memory_limit
    if options.protocol == "ucx" and importlib.util.find_spec("distributed_ucxx") is None:
        raise JobError("--protocol ucx needs distributed-ucxx: pip install 'gpushuffle[ucx]'")
    with warnings.catch_warnings():
        # distributed picks a free port for the dashboard when 8787 is taken.
        warnings.filterwarnings("ignore", message="Port .* is already in use")
        if plan.kind == "LocalCUDACluster":
            from dask_cuda import LocalCUDACluster

            kwargs.update(rmm_options(options.rmm))
            cluster = LocalCUDACluster(**kwargs)
        else:
            from distributed import LocalCluster

            cluster = LocalCluster(**kwargs)
    with cluster, _quiet_shuffle_log(debug), Client(cluster, set_as_default=False) as client:
        # The scheduler asked directly: scheduler_info() returns the client's
        # cached identity, which its periodic refresh (asking for no workers)
        # can empty between the call's fetch and its return.
        workers = client.sync(client.scheduler.identity, n_workers=-1)["workers"].values()
        threads = sorted({w["nthreads"] for w in workers})
        limit = min((w["memory_limit"] for w in workers), default=0)
        if plan.note:
            note(plan.note)
        note(
            f"cluster: embedded {plan.kind}, {len(workers)} workers x "
            f"{'/'.join(map(str, threads))} thread{'s' if threads != [1] else ''}, "
            f"{limit / GIB:.1f} GiB memory limit each, "
            f"{options.protocol}; dashboard {client.dashboard_link}"
        )
        yield client


def rmm_options(mode: str) -> dict[str, Any]:
    """``LocalCUDACluster`` arguments for ``--rmm``."""
    if mode not in RMM_MODES:
        raise JobError(f"--rmm {mode!r}: choose one of {', '.join(RMM_MODES)}")
    if mode == "pool":
        return {"rmm_pool_size": 0.5}
    if mode == "async":
        return {"rmm_async": True}
    return {}


def check_gpu_workers(plan: ClusterPlan, workers: int | None) -> None:
    """dask-cuda runs one worker per visible GPU: more is a usage error, not a failure."""
    if plan.kind == "LocalCUDACluster" and workers is not None and workers > plan.gpus:
        raise JobError(
            f"--workers {workers}: dask-cuda runs one worker per GPU and {plan.gpus} "
            f"GPU{'s are' if plan.gpus != 1 else ' is'} visible; pass --workers "
            f"{plan.gpus} or fewer, or --backend pandas for CPU workers"
        )


# -- worker-side measurements -------------------------------------------------
