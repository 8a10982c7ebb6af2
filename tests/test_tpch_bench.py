"""The TPC-H benchmark end to end on tiny data (needs the ``bench`` extra; skipped without)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("duckdb", reason="the bench extra (duckdb, tpchgen-cli) is not installed")

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _has_tpchgen() -> bool:
    import os
    import shutil

    beside = os.path.join(os.path.dirname(sys.executable), "tpchgen-cli")
    return bool(shutil.which("tpchgen-cli")) or os.path.exists(beside)


@pytest.fixture(autouse=True)
def _needs_tpchgen():
    if not _has_tpchgen():
        pytest.skip("the bench extra (tpchgen-cli) is not installed")


def test_tpch_benchmark_checks_every_method_against_duckdb(tmp_path):
    from benchmarks.tpch import generate

    data = tmp_path / "tpch"
    generate(str(data), 0.01, 2)
    out = tmp_path / "result.json"
    picture = tmp_path / "tpch.png"
    # Every result is compared with DuckDB's inside the run: a wrong answer
    # from any method fails the command.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.tpch",
            "--data",
            str(data),
            "--queries",
            "join,q5,q18,q21,sort_values",
            "--repeat",
            "1",
            "--json",
            str(out),
            "--plot",
            str(picture),
        ],
        check=True,
        capture_output=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    saved = json.loads(out.read_text())
    runs = saved["runs"]
    assert {(r["query"], r["method"]) for r in runs} == {
        (q, m)
        for q in ("join", "q5", "q18", "q21", "sort_values")
        for m in ("gpushuffle", "p2p", "tasks")
    }
    assert all(r["checked_against_duckdb"] for r in runs)
    # One untimed warm-up per query and method, left out of the medians.
    warmups = [(r["query"], r["method"]) for r in runs if r["warmup"]]
    assert sorted(warmups) == sorted({(r["query"], r["method"]) for r in runs})
    for row in saved["summary"]:
        for m in ("gpushuffle", "p2p", "tasks"):
            timed = [
                r["wall_s"]
                for r in runs
                if r["query"] == row["query"] and r["method"] == m and not r["warmup"]
            ]
            assert timed == [row[f"{m}_s"]]
    assert saved["context"]["dtypes_as_read"]["lineitem"]["l_extendedprice"].startswith("decimal")
    assert picture.stat().st_size > 10_000
