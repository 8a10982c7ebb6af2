"""The ``gpushuffle`` command line: ``bench --plot``."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from click.testing import CliRunner, Result

from gpushuffle.cli import main

pytestmark = pytest.mark.timeout(180)


def gpushuffle(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


# -- bench --plot -------------------------------------------------------------------


def test_bench_plot_writes_a_png(tmp_path):
    png, results = tmp_path / "bench.png", tmp_path / "bench.json"
    r = gpushuffle(
        "bench", "--rows", 20_000, "--columns", 4, "--partitions", 4, "--workers", 2,
        "--methods", "gpushuffle,tasks", "--json", results, "--plot", png,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert f"wrote {png}" in r.stdout
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 30_000
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(png).shape
    assert width > 1000 and height > 700
    # The JSON records keep their keys (no memory timelines in them).
    records = json.loads(results.read_text())
    assert {tuple(sorted(r)) for r in records} == {
        (
            "gib_per_s",
            "input_bytes",
            "machine",
            "method",
            "peak_worker_rss_bytes",
            "repeat",
            "rows_out",
            "wall_s",
        )
    }


def test_plot_from_results(tmp_path):
    from gpushuffle.bench import Result
    from gpushuffle.plot import median_run, plot_benchmark

    def result(method, repeat, wall, peak):
        timeline = {
            f"tcp://w{i}": [(t / 10, int((1 + i + np.sin(t)) * 2**28)) for t in range(30)]
            for i in range(2)
        }
        return Result(method, repeat, wall, 2**30, 10, peak, rss_timelines=timeline)

    results = [
        result("gpushuffle", 0, 2.0, 3 * 2**30),
        result("gpushuffle", 1, 1.0, 3 * 2**30),
        result("gpushuffle", 2, 1.5, 3 * 2**30),
        result("p2p", 0, 4.0, 2 * 2**30),
    ]
    assert median_run(results[:3]).repeat == 2
    context = {
        "rows": 10, "columns": 2, "partitions": 1, "workers": 2, "threads_per_worker": 1,
        "protocol": "tcp", "input_bytes": 2**30, "machine": "test machine",
        "versions": {"gpushuffle": "0"},
    }  # fmt: skip
    path = tmp_path / "plot.png"
    plot_benchmark(results, context, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_plot_needs_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    r = gpushuffle("bench", "--rows", 10, "--plot", tmp_path / "x.png")
    assert r.exit_code == 2
    assert r.stderr == "Error: plotting needs matplotlib: pip install 'gpushuffle[plot]'\n"


def test_bench_plot_into_a_missing_directory_fails_before_running(tmp_path):
    r = gpushuffle("bench", "--plot", tmp_path / "nowhere" / "x.png")
    assert r.exit_code == 2
    assert r.stderr == f"Error: --plot {tmp_path}/nowhere/x.png: no directory {tmp_path}/nowhere\n"
