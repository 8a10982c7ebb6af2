"""The real RAPIDS stack without a GPU: names, dtypes and cast rules.

cudf, pylibcudf, rmm, dask_cudf and dask_cuda install and import on a
machine without a GPU (``RAPIDS_NO_INITIALIZE=1``: nothing touches a device
until the first allocation).  The cuDF path has never run on a GPU; what
needs no device is checked here against the real libraries, so that upstream
drift fails CI rather than the first GPU run.  ``ci/test_rapids.sh`` runs
this module in the GPU-extra environment (with ``GPUSHUFFLE_REQUIRE_RAPIDS``,
so that a missing stack fails instead of skipping); elsewhere the tests that
need RAPIDS skip.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.rapids

CI = Path(__file__).resolve().parent.parent / "ci"


def _rapids_names():
    """ci/rapids_names.py, imported by path (ci/ is not a package)."""
    spec = importlib.util.spec_from_file_location("rapids_names", CI / "rapids_names.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["rapids_names"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def rapids(monkeypatch):
    """The RAPIDS stack, imported without initialising a device."""
    monkeypatch.setenv("RAPIDS_NO_INITIALIZE", "1")
    if importlib.util.find_spec("cudf") is None or importlib.util.find_spec("pylibcudf") is None:
        message = (
            "the RAPIDS stack is not installed (pip install -e '.[gpu]'; CI runs this "
            "module in it: ci/test_rapids.sh)"
        )
        if os.environ.get("GPUSHUFFLE_REQUIRE_RAPIDS"):
            pytest.fail(f"GPUSHUFFLE_REQUIRE_RAPIDS is set, but {message}")
        pytest.skip(message)
    import cudf
    import pylibcudf

    return cudf, pylibcudf


def _plant(tmp_path: Path, source: str) -> Path:
    package = tmp_path / "planted"
    package.mkdir()
    (package / "mod.py").write_text(source)
    return package


# -- the finder, on any machine -----------------------------------------------


def test_the_finder_sees_imports_chains_and_importlib_names(tmp_path):
    """With the standard library standing in for RAPIDS: every kind of
    reference is found, a wrong one is reported with its file and line."""
    names = _rapids_names()
    package = _plant(
        tmp_path,
        "import importlib.util\n"
        "import json as j\n"
        "from json.decoder import JSONDecoder, NoSuchDecoder\n"
        "x = j.decoder.JSONDecodeError\n"
        "y = j.decoder.NoSuchError.args\n"
        "z = JSONDecoder.decode\n"
        "importlib.util.find_spec('json.tool')\n"
        "importlib.util.find_spec('json.no_such_module')\n",
    )
    found = {(r.line, r.name) for r in names.references(package, ("json",))}
    assert found == {
        (2, "json"),
        (3, "json.decoder.JSONDecoder"),
        (3, "json.decoder.NoSuchDecoder"),
        (4, "json.decoder.JSONDecodeError"),
        (5, "json.decoder.NoSuchError.args"),
        (6, "json.decoder.JSONDecoder.decode"),
        (7, "json.tool"),
        (8, "json.no_such_module"),
    }
    failures = names.failures(package, ("json",))
    assert [f.split(": ")[0:2] for f in failures] == [
        ["planted/mod.py:3", "json.decoder.NoSuchDecoder"],
        ["planted/mod.py:5", "json.decoder.NoSuchError.args"],
        ["planted/mod.py:8", "json.no_such_module"],
    ]


def test_the_finder_sees_the_packages_rapids_names():
    """The package's cuDF backend is where most names are: the finder must see them."""
    names = _rapids_names()
    found = {r.name for r in names.references()}
    assert "pylibcudf.copying.OutOfBoundsPolicy.DONT_CHECK" in found
    assert "cudf.core.column.ColumnBase.create" in found
    assert "distributed.diagnostics.nvml.device_get_count" in found
    assert "distributed_ucxx" in found  # find_spec("distributed_ucxx")
    assert len(found) > 50


# -- against the real stack ---------------------------------------------------


def test_every_rapids_name_the_package_uses_resolves(rapids):
    names = _rapids_names()
    assert len(names.references()) > 100
    assert names.failures() == []


def test_a_planted_wrong_rapids_name_fails(rapids, tmp_path):
    names = _rapids_names()
    package = _plant(
        tmp_path,
        "import pylibcudf as plc\n"
        "from cudf.core.column import ColumnBase, NoSuchColumn\n"
        "ok = plc.copying.OutOfBoundsPolicy.DONT_CHECK\n"
        "typo = plc.copying.OutOfBoundsPolicy.DONT_CHEK\n"
        "moved = plc.contiguous_split.no_such_pack\n",
    )
    failures = names.failures(package)
    assert [f.split(": ")[0:2] for f in failures] == [
        ["planted/mod.py:2", "cudf.core.column.NoSuchColumn"],
        ["planted/mod.py:4", "pylibcudf.copying.OutOfBoundsPolicy.DONT_CHEK"],
        ["planted/mod.py:5", "pylibcudf.contiguous_split.no_such_pack"],
    ]


NUMPY_TYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float32",
    "float64",
    "datetime64[s]",
    "datetime64[ms]",
    "datetime64[us]",
    "datetime64[ns]",
    "timedelta64[s]",
    "timedelta64[ns]",
]


def test_numpy_types_map_to_pylibcudf_and_back(rapids):
    """The backend reads a column's numpy type from its pylibcudf type
    (PYLIBCUDF_TO_SUPPORTED_NUMPY_TYPES) and makes pylibcudf types from
    cuDF dtypes (dtype_to_pylibcudf_type): both ways, every fixed-width type."""
    from cudf.utils.dtypes import PYLIBCUDF_TO_SUPPORTED_NUMPY_TYPES, dtype_to_pylibcudf_type

    for name in NUMPY_TYPES:
        dtype = np.dtype(name)
        plc_type = dtype_to_pylibcudf_type(dtype)
        assert np.dtype(PYLIBCUDF_TO_SUPPORTED_NUMPY_TYPES[plc_type.id()]) == dtype, name


def test_lossless_casts_agree_with_numpy_as_the_stand_in_assumes(rapids):
    """The cuDF backend's cast rule (_keeps_values, on real pylibcudf types)
    is numpy's safe casting, which the pandas backend and the CPU stand-in of
    the device tier apply: a rule that drifted from it would pass CI and
    lose values (or refuse good data) on the first GPU."""
    from cudf.utils.dtypes import dtype_to_pylibcudf_type

    from gpushuffle.backends.cudf import _keeps_values

    numeric = [n for n in NUMPY_TYPES if not n.startswith(("datetime", "timedelta"))]
    for a in numeric:
        for b in numeric:
            source, target = (
                dtype_to_pylibcudf_type(np.dtype(a)),
                dtype_to_pylibcudf_type(np.dtype(b)),
            )
            assert _keeps_values(source, target) == np.can_cast(a, b, "safe"), (a, b)


def test_decimal_casts_keep_the_scale_and_only_widen(rapids):
    """Decimals of every width and scale, as real cuDF dtypes make them."""
    cudf, _ = rapids
    from cudf.utils.dtypes import dtype_to_pylibcudf_type

    from gpushuffle.backends.cudf import _keeps_values, _type_name

    widths = {32: cudf.Decimal32Dtype, 64: cudf.Decimal64Dtype, 128: cudf.Decimal128Dtype}
    types = {}
    for bits, make in widths.items():
        for scale in (0, 2, 5):
            dtype = make(int(make.MAX_PRECISION), scale)
            plc_type = dtype_to_pylibcudf_type(dtype)
            # libcudf keeps the scale negated: 2 decimal places is scale -2.
            assert plc_type.scale() == -scale, (bits, scale)
            types[bits, scale] = plc_type
    for (bits, scale), source in types.items():
        for (bits2, scale2), target in types.items():
            expected = scale == scale2 and bits2 >= bits
            assert _keeps_values(source, target) == expected, (bits, scale, bits2, scale2)
        assert "scale" in _type_name(source)
        int64 = dtype_to_pylibcudf_type(np.dtype("int64"))
        assert not _keeps_values(source, int64) and not _keeps_values(int64, source)


def test_dtype_families_of_real_cudf_dtypes(rapids):
    """Which dtypes may meet in a shuffle: categoricals, decimals, nested
    types (only exactly), and numpy types as the pandas backend has them."""
    cudf, _ = rapids
    from gpushuffle.backends.cudf import _family
    from gpushuffle.backends.dtypes import dtype_family

    # Categories are a device column: a categorical dtype without them.
    assert _family(cudf.CategoricalDtype(ordered=True)) == "category"
    assert _family(cudf.Decimal64Dtype(10, 2)) == _family(cudf.Decimal128Dtype(20, 2)) == "decimal"
    nested = cudf.ListDtype(np.int64)
    assert _family(nested) == f"exactly {nested}"
    struct = cudf.StructDtype({"a": np.int64})
    assert _family(struct) == f"exactly {struct}"
    for name in NUMPY_TYPES:
        assert _family(np.dtype(name)) == dtype_family(np.dtype(name)), name


def test_dask_cudas_device_limit_is_read_where_dask_cuda_keeps_it(rapids, tmp_path):
    """The device budget is a share of dask-cuda's device memory limit, read
    from its real DeviceHostFile (the threshold of its device buffer); a
    worker without a limit has none."""
    from dask_cuda.device_host_file import DeviceHostFile

    from gpushuffle.config import _device_buffer_limit

    limited = DeviceHostFile(
        worker_local_directory=str(tmp_path / "a"),
        device_memory_limit=3 << 30,
        memory_limit=8 << 30,
    )
    assert _device_buffer_limit(limited) == 3 << 30
    unlimited = DeviceHostFile(worker_local_directory=str(tmp_path / "b"))
    assert _device_buffer_limit(unlimited) is None


def test_category_dtypes_in_shard_headers_round_trip(rapids):
    """A cuDF shard's header carries its categorical columns' category
    dtypes pickled (CudfBackend.serialize): those that need no device memory
    to make (decimals, lists, structs) come back equal, precision, scale and
    field names included."""
    import pickle

    cudf, _ = rapids
    dtypes = (
        cudf.Decimal32Dtype(9, 3),
        cudf.Decimal64Dtype(10, 2),
        cudf.Decimal128Dtype(30, 7),
        cudf.ListDtype(np.int64),
        cudf.ListDtype(cudf.ListDtype(np.float32)),
        cudf.StructDtype({"a": np.int64, "b": cudf.Decimal64Dtype(12, 4)}),
    )
    back = pickle.loads(pickle.dumps(dtypes, protocol=5))
    assert back == dtypes
    assert [str(d) for d in back] == [str(d) for d in dtypes]
    assert back[1].precision == 10 and back[1].scale == 2
    assert list(back[5].fields) == ["a", "b"]
