"""A seeded soak with random losses: ``gpushuffle soak``.

Round after round, on one cluster of Nanny workers: a random input (rows,
input and output partitions, numeric or mixed columns), a shuffle or a
merge of two frames, run once without a fault and once while 0-2 worker
processes are SIGKILLed at random moments (a fraction of the round's
no-fault time: before the first shard, mid-transfer, at the barrier, in the
unpack, sometimes two at once).  Every output partition of both runs is
checked against dask's ``tasks`` method on the same input: its rows and the
sum of its rows' hashes (every column, strings too; independent of the
rows' order).  After each round the workers must hold nothing of the
shuffle: no active run, nothing kept for a next run, no store bytes, no
spill files.  A round is drawn from ``random.Random(f"{seed}-{round}")``:
one that went wrong is rerun alone with ``--seed S --first R --rounds 1``.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from dask import delayed as dask_delayed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Round:
    """What one round runs: drawn from its seed."""

    number: int
    operation: str  # "shuffle" or "merge"
    rows: int
    partitions: int
    npartitions: int
    dtypes: str
    #: Kill times, as fractions of the no-fault run's time.
    kills: tuple[float, ...]
    recovery: str

    @classmethod
    def draw(cls, seed: int, number: int, recovery: str) -> Round:
        rng = random.Random(f"{seed}-{number}")
        operation = "merge" if rng.random() < 0.3 else "shuffle"
        kills: list[float] = []
        for _ in range(rng.choice((0, 1, 1, 1, 2, 2))):
            # Two at once now and then: a host's workers, or a correlated fault.
            at = kills[-1] if kills and rng.random() < 0.3 else rng.uniform(0.02, 0.95)
            kills.append(round(at, 3))
        return cls(
            number=number,
            operation=operation,
            rows=rng.randrange(100_000, 1_500_001, 50_000),
            partitions=rng.randrange(4, 25),
            npartitions=rng.randrange(2, 33),
            dtypes=rng.choice(("numeric", "mixed")),
            kills=tuple(sorted(kills)),
            recovery=recovery,
        )


@dataclass
class RoundResult:
    round: Round
    no_fault_s: float
    fault_s: float | None
    #: Workers actually killed (one may be restarting at its moment).
    killed: int
    right: bool
    #: What went wrong, in words (None when the round was right and clean).
    problem: str | None = None
    recovery: dict[str, int] = field(default_factory=dict)


def output_digest(part: pd.DataFrame) -> pd.DataFrame:
    """One row per output partition: its rows and the sum of its rows'
    hashes over every column (wraps exactly, independent of row order)."""
    return _digest_of(pd.util.hash_pandas_object(part, index=False).to_numpy())


def _digest_of(hashes: np.ndarray) -> pd.DataFrame:
    # As int64 (the same bits): a uint64 column above 2**63 concatenated with
    # an empty partition's would become float64 and lose its low bits.
    total = np.array([hashes.sum(dtype=np.uint64)], dtype=np.uint64).view(np.int64)
    return pd.DataFrame({"rows": [len(hashes)], "hash_sum": total})


def differences(got: pd.DataFrame, truth: pd.DataFrame) -> list[int]:
    """Output partitions whose digest differs from the truth's (all of
    them, as ``[-1]``, when the numbers of partitions differ)."""
    got, truth = got.reset_index(drop=True), truth.reset_index(drop=True)
    got, truth = got[["rows", "hash_sum"]], truth[["rows", "hash_sum"]]
    if len(got) != len(truth):
        return [-1]
    return [int(i) for i in np.flatnonzero((got != truth).any(axis=1).to_numpy())]


def _described(wrong: list[int], got: pd.DataFrame, truth: pd.DataFrame) -> str:
    """Which output partitions differ from the truth, with their rows."""
    if wrong == [-1]:
        return f"{len(got)} output partitions, tasks has {len(truth)}"
    rows = [f"{p} ({got['rows'].iloc[p]} rows, tasks {truth['rows'].iloc[p]})" for p in wrong[:10]]
    return f"output partitions differ from tasks: {', '.join(rows)}"


def _leftovers(dask_worker: Any) -> dict[str, Any]:
    """What shuffles left on a worker (nothing, once a round is over)."""
    from gpushuffle.engine import recovery
    from gpushuffle.engine.memory import TIERS, worker_memory

    runs = dask_worker.plugins["shuffle"].shuffle_runs
    memory = worker_memory()
    left: dict[str, Any] = {
        "active runs": list(runs._active_runs),
        "kept for a next run": [k for k in recovery.holdings.held if k[0] == dask_worker.address],
        "store bytes": {t: memory.tier(t).bytes for t in TIERS if memory.tier(t).bytes},
        "spill files": [
            name
            for name in os.listdir(dask_worker.local_directory)
            if name.startswith(("gpushuffle", "shuffle"))
        ],
    }
    return {k: v for k, v in left.items() if v}


def run_soak(
    *,
    rounds: int = 20,
    seed: int = 0,
    first: int = 0,
    workers: int = 4,
    recovery: str | None = None,
    repeat: int = 1,
    give_up_after: float = 20.0,
    on_result: Callable[[RoundResult], None] | None = None,
) -> list[RoundResult]:
    """Rounds ``first`` to ``first + rounds - 1`` of the soak drawn from
    ``seed``, each ``repeat`` times; ``recovery`` None: as configured."""
    import dask
    from distributed import Client

    from gpushuffle import config
    from gpushuffle.bench import benchmark_cluster

    recovery = recovery or str(config.get("recovery"))
    results = []
    settings = {
        "distributed.worker.memory.terminate": False,
        # Replacements slow to come back are waited for (bench_loss says why).
        "distributed.deploy.lost-worker-timeout": "120s",
        # Two kills in a round may hit a task's worker twice: that is not
        # what the soak is after (KilledWorker, the same for every method).
        "distributed.scheduler.allowed-failures": 10,
        "gpushuffle.recovery": recovery,
    }
    with (
        dask.config.set(settings),
        benchmark_cluster(workers, 1, quiet=True) as cluster,
        Client(cluster) as client,
    ):
        for number in range(first, first + rounds):
            spec = Round.draw(seed, number, recovery)
            for _ in range(repeat):
                result = _run_round(client, cluster, spec, workers, give_up_after)
                results.append(result)
                if on_result is not None:
                    on_result(result)
    return results


def _inputs(client: Any, spec: Round) -> list[Any]:
    from distributed import wait

    from gpushuffle.bench import persisted_evenly

    frames = [persisted_evenly(client, spec.rows, spec.partitions, 6, spec.dtypes)]
    if spec.operation == "merge":
        # A quarter as many rows on the right, keys drawn from as many: about
        # one match for a quarter of the left rows.
        right = persisted_evenly(client, spec.rows // 4, max(2, spec.partitions // 2), 3, "numeric")
        frames.append(right)
    wait(frames)
    return frames


def _output(frames: list[Any], spec: Round, method: str) -> Any:
    if spec.operation == "merge":
        left, right = frames
        return left.merge(right, on="key", npartitions=spec.npartitions, shuffle_method=method)
    return frames[0].shuffle(on="key", npartitions=spec.npartitions, shuffle_method=method)


def fingerprint(part: pd.DataFrame) -> pd.DataFrame:
    """:func:`output_digest`, with each row's hash and key (one array
    each, in object columns): a wrong partition's rows can be named."""
    hashes = pd.util.hash_pandas_object(part, index=False).to_numpy()
    digest = _digest_of(hashes)
    digest["hashes"] = pd.Series([hashes], dtype=object)
    digest["keys"] = pd.Series([part["key"].to_numpy()], dtype=object)
    return digest


def _computation(frames: list[Any], spec: Round, method: str) -> Any:
    out = _output(frames, spec, method)
    # Fused with the output tasks by dask: what comes back is small.
    return out.map_partitions(fingerprint, meta=fingerprint(out._meta))


def unmatched(got: np.ndarray, truth: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions in ``truth`` of the row hashes ``got`` lacks, and in ``got``
    of those beyond ``truth`` (multisets: a row held twice counts twice)."""

    def numbered(hashes: np.ndarray) -> pd.MultiIndex:
        h = pd.Series(hashes)
        return pd.MultiIndex.from_arrays([h, h.groupby(h).cumcount()])

    g, t = numbered(got), numbered(truth)
    return np.flatnonzero(~t.isin(g)), np.flatnonzero(~g.isin(t))


def _rows_with_keys(part: pd.DataFrame, keys: Any) -> list[int]:
    return np.flatnonzero(part["key"].isin(keys).to_numpy()).tolist()


def explain(
    client: Any, frames: list[Any], got: pd.DataFrame, truth: pd.DataFrame, wrong: list[int]
) -> list[str]:
    """For each wrong output partition (the first three): how many rows it
    lacks or has beyond ``tasks``' and which input rows share their keys
    (frame 0 the left side of a merge)."""
    lines = []
    for partition in [p for p in wrong if p >= 0][:3]:
        mine, theirs = got.iloc[partition], truth.iloc[partition]
        missing, extra = unmatched(mine["hashes"], theirs["hashes"])
        for what, keys in (
            ("missing", theirs["keys"][missing]),
            ("extra", mine["keys"][extra]),
        ):
            if not (count := len(keys)):
                continue
            keys = sorted(set(keys[:10].tolist()))
            where = []
            for side, frame in enumerate(frames):
                found = client.gather(
                    client.compute(
                        [dask_delayed(_rows_with_keys)(d, keys) for d in frame.to_delayed()]
                    )
                )
                where += [f"frame {side} input {i} rows {r}" for i, r in enumerate(found) if r]
            lines.append(
                f"output {partition}: {count} rows {what}, keys {keys}; "
                f"rows with them: {'; '.join(where)}"
            )
    return lines


def _run_round(
    client: Any, cluster: Any, spec: Round, workers: int, give_up_after: float
) -> RoundResult:
    from gpushuffle.bench_loss import Killer, all_workers_back, recovered, recovery_counters

    all_workers_back(client, cluster, workers)
    frames = _inputs(client, spec)
    truth = _computation(frames, spec, "tasks").compute()
    start = time.perf_counter()
    clean = _computation(frames, spec, "gpushuffle").compute()
    no_fault = time.perf_counter() - start
    problems = []
    if wrong := differences(clean, truth):
        problems.append(f"no-fault run: {_described(wrong, clean, truth)}")
    before = recovery_counters(client)
    killer = Killer(client, random.Random(f"kills-{spec.number}"))
    future = client.compute(_computation(frames, spec, "gpushuffle"))
    start = time.perf_counter()
    killer.start([at * no_fault for at in spec.kills])
    fault_s = None
    try:
        got = future.result(timeout=give_up_after * no_fault + 30)
        fault_s = time.perf_counter() - start
        if wrong := differences(got, truth):
            problems.append(f"run with losses: {_described(wrong, got, truth)}")
            killer.stop()
            problems.append(f"killed: {killer.killed}")
            try:
                problems.extend(explain(client, frames, got, truth, wrong))
            except Exception as e:  # a diagnosis only: the verdict stands
                problems.append(f"rows not explained: {e!r}"[:200])
    except TimeoutError:
        problems.append(f"run with losses: not finished in {give_up_after:g}x + 30 s")
    except Exception as e:
        problems.append(f"run with losses: {type(e).__name__}: {e}"[:400])
    finally:
        killer.stop()
        future.cancel()
    del future, frames
    all_workers_back(client, cluster, workers)
    after = recovery_counters(client)
    if left := _left_behind(client):
        problems.append(f"left on workers: {left}")
    return RoundResult(
        round=spec,
        no_fault_s=no_fault,
        fault_s=fault_s,
        killed=killer.kills,
        right=not problems,
        problem="; ".join(problems) or None,
        recovery=recovered(before, after),
    )


def _left_behind(client: Any, wait_s: float = 20.0) -> dict[str, Any]:
    """What workers still hold of past rounds once ``wait_s`` has passed
    (runs close and kept stores go asynchronously)."""
    deadline = time.monotonic() + wait_s
    while True:
        # A worker that cannot answer (an OSError: leaving) is not counted.
        answers = client.run(_leftovers, on_error="return").items()
        left = {w: v for w, v in answers if not isinstance(v, OSError) and v}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def format_round(result: RoundResult) -> str:
    r = result.round
    fault = "-" if result.fault_s is None else f"{result.fault_s:.2f} s"
    what = f"{r.operation} {r.rows:,} rows {r.dtypes} {r.partitions}->{r.npartitions}"
    kills = ",".join(f"{k:g}" for k in r.kills) or "none"
    moved = result.recovery.get("recovery_partitions_taken", 0)
    verdict = "right" if result.right else f"WRONG: {result.problem}"
    return (
        f"round {r.number:>3}: {what:<40} kills at {kills:<13} ({result.killed} done) "
        f"{result.no_fault_s:.2f} s / {fault:>8}, {moved} partitions moved: {verdict}"
    )
