"""What the GPU path reads from RAPIDS objects, checked where it can be on a CPU.

Each test builds the object the GPU path meets from the real class where it
installs here, or from the same pieces the real class is made of (labelled
as such), following the RAPIDS 26.10 source it names.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import zict

from gpushuffle import config
from gpushuffle.engine.join import PARTITION_COLUMN, join_transfer


class _DeviceHostFileLike:
    """TEST DOUBLE: the attributes dask-cuda 26.10's ``DeviceHostFile`` sets
    (dask_cuda/device_host_file.py, ``__init__``): ``device_buffer`` is a
    ``zict.Buffer`` over a dict with the device limit as its threshold, or
    the plain dict where no limit was given.  The real class needs dask-cuda,
    which CI's environment does not install."""

    def __init__(self, device_memory_limit: int | None) -> None:
        self.device_func: dict = {}
        if device_memory_limit is None:
            self.device_buffer = self.device_func
        else:
            self.device_buffer = zict.Buffer(self.device_func, {}, device_memory_limit)


def test_the_device_limit_is_read_where_dask_cuda_keeps_it():
    assert config._device_buffer_limit(_DeviceHostFileLike(3 << 30)) == 3 << 30
    assert config._device_buffer_limit(_DeviceHostFileLike(None)) is None
    assert config._device_buffer_limit({}) is None  # distributed's own data


def test_join_ids_are_assigned_by_index_as_dask_does(monkeypatch):
    """The ids of non-plain keys come back as a Series (cuDF's stays on the
    device); they are assigned as dask's p2p join assigns them, which keeps
    rows with repeated index labels in place."""
    import gpushuffle.engine.join as join

    seen = {}
    monkeypatch.setattr(join, "transfer", lambda frame, id, i: seen.setdefault("frame", frame))
    frame = pd.DataFrame({"k": [5, 1, 5, 2], "v": [1, 2, 3, 4]}, index=[7, 7, 3, 3])
    join_transfer(frame, "k", 8, "id", 0, index_merge=True)
    ids = seen["frame"][PARTITION_COLUMN]
    expected = join.partition_ids(frame, "k", 8, True)
    np.testing.assert_array_equal(ids.to_numpy(), np.asarray(expected))
    assert ids.dtype == np.uint8


class _DeviceSeries(pd.Series):
    """TEST DOUBLE: a Series that, like a cudf Series, refuses to become a host
    array implicitly (cudf 26.10's ``Series.__array__`` raises TypeError:
    "Implicit conversion to a host NumPy array via __array__ is not
    allowed").  numpy's stubs take any object, so the type checker cannot
    catch ``np.asarray`` of a cudf Series; this test does."""

    @property
    def _constructor(self):
        return _DeviceSeries

    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a host NumPy array via __array__ is not allowed")


def test_join_ids_of_a_device_frame_never_pass_through_host_memory(monkeypatch):
    import gpushuffle.engine.join as join

    seen = {}
    monkeypatch.setattr(join, "transfer", lambda frame, id, i: seen.setdefault("frame", frame))
    frame = pd.DataFrame({"k": [5, 1, 5, 2], "v": [1, 2, 3, 4]})
    ids = _DeviceSeries([3, 0, 3, 1], index=frame.index)
    monkeypatch.setattr(join, "partition_ids", lambda *args: ids)
    join_transfer(frame, "k", 8, "id", 0, index_merge=False)
    assigned = seen["frame"][PARTITION_COLUMN]
    assert assigned.dtype == np.uint8 and assigned.tolist() == [3, 0, 3, 1]


def _gpu_calls():
    """ci/gpu_calls.py, imported by path (ci/ is not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "ci" / "gpu_calls.py"
    spec = importlib.util.spec_from_file_location("gpu_calls", path)
    assert spec is not None and spec.loader is not None
    gpu_calls = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_calls)
    return gpu_calls


def test_every_rapids_call_has_a_row_of_upstream_evidence():
    """docs/gpu-calls.md holds, per RAPIDS call in the package, the upstream
    code or test that makes the same call with the same types
    (ci/gpu_calls.py finds the calls), and says where the package makes it."""
    gpu_calls = _gpu_calls()
    calls = gpu_calls.rapids_calls()
    assert "plc.copying.gather" in calls and "ColumnBase.create" in calls  # it finds them
    assert gpu_calls.missing() == {}, "add a row to docs/gpu-calls.md for each"
    assert gpu_calls.stale() == {}, "run python ci/gpu_calls.py --update"


def test_a_stale_location_in_the_table_is_caught(tmp_path):
    """One line number off in a row's second cell (a later line of the same
    file, in the shorthand): the check names the row with the code's lines,
    and --update's rewrite puts them back."""
    gpu_calls = _gpu_calls()
    text = gpu_calls.TABLE.read_text()
    line = next(row for row in text.splitlines() if row.startswith("| `ColumnBase.create` |"))
    cells = line.split("|")
    first, *rest = cells[2].split(",")
    wrong = f"{first}, {int(rest[0]) + 1},{','.join(rest[1:])}"
    table = tmp_path / "gpu-calls.md"
    table.write_text(text.replace(line, "|".join([*cells[:2], wrong, *cells[3:]])))
    assert gpu_calls.stale(table=table) == {
        "`ColumnBase.create`": (wrong.strip(), cells[2].strip())
    }
    gpu_calls.update(table=table)
    assert table.read_text() == text


def test_each_call_without_upstream_evidence_names_a_gpu_test_that_exists():
    """Section 3 of docs/gpu-calls.md lists the calls no upstream code makes
    with our types; each must be tested on the GPU run, by a test that exists."""
    import ast
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    text = (root / "docs" / "gpu-calls.md").read_text()
    section = text[text.index("## 3.") : text.index("## 4.")]
    items = re.split(r"\n(?=\d+\. )", section)[1:]
    assert len(items) >= 10, "section 3 lost its items"
    tree = ast.parse((root / "tests" / "test_gpu.py").read_text())
    tests = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    for item in items:
        named = re.findall(r"`tests/test_gpu\.py::(\w+)`", item)
        assert named, f"no GPU test named for: {item[:80]}"
        for name in named:
            assert name in tests, f"{name} is not a test in tests/test_gpu.py"
