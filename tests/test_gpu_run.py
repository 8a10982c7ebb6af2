"""The GPU run's tooling on CPU: ci/gpu_run.sh without a GPU, the kit's parts, the bench harness.

No network, no kit download: the kit tests build small fake wheels, cut them
into tiny parts and put them back together with the script the GPU machine
runs (ci/gpu_kit_assemble.sh).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GPU_STEPS = ("test_gpu", "bench", "device_check", "ucx")

pytestmark = pytest.mark.timeout(180)


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "PYTHON": sys.executable, **env},
    )


# -- ci/gpu_run.sh --------------------------------------------------------------------------


@pytest.fixture
def no_gpu() -> None:
    if shutil.which("nvidia-smi"):
        pytest.skip("a GPU machine: ci/gpu_run.sh runs the steps there, not skips them")


def _results(directory: Path) -> dict:
    (path,) = directory.glob("gpu-*.json")
    assert path.name.startswith("gpu-none-")  # named after the device; none here
    return json.loads(path.read_text())


def test_gpu_run_without_a_gpu_skips_every_step_and_fails_saying_so(tmp_path, no_gpu):
    done = _run(["bash", "ci/gpu_run.sh", str(tmp_path / "results"), "--no-kit"])
    assert done.returncode == 3, done.stdout + done.stderr
    assert "gpu_run: no GPU: no usable CUDA device" in done.stdout, done.stdout
    results = tmp_path / "results"
    # At most 8 files come back from the device machine.
    assert sorted(p.name for p in results.iterdir()) == [
        next(results.glob("gpu-*.json")).name,
        "gpu_run.log",
    ]
    report = _results(results)
    assert report["device"] is None
    assert report["mode"] == "no-kit"
    steps = report["steps"]
    assert list(steps) == ["kit", "env", "rapids", *GPU_STEPS]
    assert steps["kit"]["status"] == "skipped"
    assert "--no-kit" in steps["kit"]["reason"]
    assert steps["env"]["status"] == "passed"
    assert steps["env"]["result"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert not report["probes"]["gpu"]["ok"]
    # The RAPIDS checks need no device, only cuDF installed (ci/test_rapids.sh).
    if importlib.util.find_spec("cudf") is None:
        assert steps["rapids"]["status"] == "skipped", steps["rapids"]
        assert steps["rapids"]["reason"].startswith("cuDF is not installed"), steps["rapids"]
    else:
        assert steps["rapids"]["status"] == "passed", steps["rapids"]
    for name in GPU_STEPS:
        assert steps[name]["status"] == "skipped", (name, steps[name])
        assert steps[name]["reason"].startswith("no usable CUDA device"), steps[name]
        assert steps[name]["reason"] == report["probes"]["gpu"]["detail"]
    log = (results / "gpu_run.log").read_text()
    assert "=== report" in log and "gpu_run: done" in log


def test_gpu_run_without_kit_parts_fails_the_kit_step_and_goes_on(tmp_path, no_gpu):
    empty = tmp_path / "no-parts"
    empty.mkdir()
    done = _run(
        ["bash", "ci/gpu_run.sh", str(tmp_path), "--steps", "bench"], GPUKIT_PARTS=str(empty)
    )
    assert done.returncode == 1  # the kit step failed
    steps = _results(tmp_path)["steps"]
    assert steps["kit"]["status"] == "failed"
    assert "ci/gpu_kit.sh" in steps["kit"]["reason"] and "--no-kit" in steps["kit"]["reason"]
    assert steps["bench"]["status"] == "skipped"
    for name in ("rapids", "test_gpu", "device_check", "ucx"):
        assert steps[name] == {
            "status": "skipped",
            "reason": "not selected (--steps bench)",
            "seconds": 0,
            "rc": None,
        }


@pytest.mark.parametrize(
    "args", [[], ["out", "--steps", "bench,nope"], ["out", "--frobnicate"], ["a", "b"]]
)
def test_gpu_run_usage_errors_exit_2(args):
    done = _run(["bash", "ci/gpu_run.sh", *args])
    assert done.returncode == 2
    assert "gpu_run.sh RESULTS_DIR" in done.stderr


# -- the kit: parts, sums, reassembly -------------------------------------------------------


def _wheel(directory: Path, name: str, version: str, requires: list[str], payload: int) -> Path:
    path = directory / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{name.replace('-', '_')}/data.bin", os.urandom(payload))
        zf.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", "\n".join(meta))
    return path


def _lock(path: Path, wheels: list[tuple[str, Path]], extra: str = "") -> None:
    lines = []
    for group, wheel in wheels:
        name, version = wheel.name.split("-")[:2]
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        lines.append(f"wheel {group} {name.replace('_', '-')}=={version} {wheel.name} {digest}")
    path.write_text("# a test kit\n" + "\n".join(lines) + "\ndevice numpy 2.5.2\n" + extra)


@pytest.fixture
def kit(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    wheels = [
        ("core", _wheel(cache, "big-lib", "1.0", ["small-lib>=2", "numpy<3"], 40_000)),
        ("core", _wheel(cache, "small-lib", "2.1", ["numpy; python_version >= '3.12'"], 3_000)),
        ("ucx", _wheel(cache, "ucx-lib", "0.5", ["big-lib==1.*"], 9_000)),
    ]
    lock = tmp_path / "gpu_kit.lock"
    _lock(lock, wheels)
    return tmp_path, cache, lock, wheels


def _assemble(*args: str, parts: Path) -> subprocess.CompletedProcess[str]:
    return _run(["bash", "ci/gpu_kit_assemble.sh", *args], GPUKIT_PARTS=str(parts))


def test_kit_closure_finds_what_no_wheel_or_device_provides(kit):
    _, cache, lock, wheels = kit
    ok = _run([sys.executable, "ci/gpu_kit.py", "closure", str(lock), str(cache)])
    assert ok.returncode == 0, ok.stderr
    assert "from the device's image: numpy" in ok.stdout
    # Without small-lib's line, big-lib's requirement is unmet.
    _lock(lock, [w for w in wheels if "small" not in w[1].name])
    missing = _run([sys.executable, "ci/gpu_kit.py", "closure", str(lock), str(cache)])
    assert missing.returncode == 1
    assert "big-lib needs small-lib>=2: neither in the kit nor on the device" in missing.stderr
    # An omit line accepts it, and says so.
    _lock(lock, [w for w in wheels if "small" not in w[1].name], "omit small-lib not needed\n")
    omitted = _run([sys.executable, "ci/gpu_kit.py", "closure", str(lock), str(cache)])
    assert omitted.returncode == 0 and "left out on purpose: small-lib" in omitted.stdout


def test_kit_parts_reassemble_to_the_same_wheels(kit):
    tmp, cache, lock, wheels = kit
    part_bytes = 16_384
    packed = _run(
        [sys.executable, "ci/gpu_kit.py", "pack", str(lock), str(cache), str(tmp / "kit"), "k1"],
        GPUKIT_PART_BYTES=str(part_bytes),
    )
    assert packed.returncode == 0, packed.stderr
    parts = tmp / "kit" / "parts"
    names = sorted(p.name for p in parts.iterdir())
    assert names == ["core1", "core2", "core3", "core4", "ucx1"]
    for part in parts.iterdir():
        assert sum(f.stat().st_size for f in part.iterdir()) <= part_bytes
    manifest = json.loads((tmp / "kit" / "MANIFEST.json").read_text())
    assert {w["file"]: w["pieces"] for w in manifest["wheels"]}[wheels[0][1].name] > 1

    checked = _assemble("check", parts=parts)
    assert checked.returncode == 0, checked.stderr
    assert "5 of 5 parts here" in checked.stdout and "missing: none" in checked.stdout
    done = _assemble("assemble", str(tmp / "out"), parts=parts)
    assert done.returncode == 0, done.stderr
    for _, wheel in wheels:
        assert (tmp / "out" / wheel.name).read_bytes() == wheel.read_bytes()


def test_kit_damaged_or_missing_parts_are_named(kit):
    tmp, cache, lock, wheels = kit
    _run(
        [sys.executable, "ci/gpu_kit.py", "pack", str(lock), str(cache), str(tmp / "kit"), "k1"],
        GPUKIT_PART_BYTES="16384",
    )
    parts = tmp / "kit" / "parts"
    # The optional group not sent: the core group still assembles, without it.
    shutil.move(parts / "ucx1", tmp / "ucx1")
    partial = _assemble("assemble", str(tmp / "core-only"), parts=parts)
    assert partial.returncode == 0, partial.stderr
    assert "missing: ucx1" in _assemble("check", parts=parts).stdout
    assert sorted(p.name for p in (tmp / "core-only").iterdir()) == sorted(
        w.name for g, w in wheels if g == "core"
    )
    # A core part missing: nothing to install, and it says which.
    shutil.move(parts / "core2", tmp / "core2")
    incomplete = _assemble("assemble", str(tmp / "none"), parts=parts)
    assert incomplete.returncode == 1
    assert "core group is incomplete: missing parts core2 ucx1" in incomplete.stderr
    shutil.move(tmp / "core2", parts / "core2")
    # One flipped byte: check fails and names the piece.
    piece = next(p for p in (parts / "core2").iterdir() if p.name.endswith(".001"))
    data = bytearray(piece.read_bytes())
    data[100] ^= 0xFF
    piece.write_bytes(bytes(data))
    damaged = _assemble("check", parts=parts)
    assert damaged.returncode == 1
    assert piece.name in damaged.stdout + damaged.stderr
    assert "MISMATCH" in damaged.stderr


def test_kit_parts_of_two_builds_are_refused(kit):
    tmp, cache, lock, _ = kit
    for stamp in ("k1", "k2"):
        _run(
            [
                sys.executable,
                "ci/gpu_kit.py",
                "pack",
                str(lock),
                str(cache),
                str(tmp / stamp),
                stamp,
            ],
            GPUKIT_PART_BYTES="16384",
        )
    shutil.rmtree(tmp / "k1" / "parts" / "core3")
    shutil.copytree(tmp / "k2" / "parts" / "core3", tmp / "k1" / "parts" / "core3")
    mixed = _assemble("check", parts=tmp / "k1" / "parts")
    assert mixed.returncode == 1
    assert "2 kit builds" in mixed.stderr


# -- the benchmark's harness, on pandas -----------------------------------------------------


def test_gpu_bench_harness_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    done = _run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_bench",
            "--backend",
            "pandas",
            "--rows",
            "40000",
            "--partitions",
            "4",
            "--repeat",
            "2",
            "--json",
            str(out),
        ]
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["ok"] and report["input_bytes"] > 40000 * 8
    for method in ("gpushuffle", "p2p", "tasks"):
        result = report["methods"][method]
        assert len(result["runs_s"]) == 2 and result["rows_out"] == 40000
        assert result["check"].startswith("ok: 4 partitions match")


def test_gpu_bench_check_names_what_differs():
    import pandas as pd

    from benchmarks.gpu_bench import check

    def frame(ns, row_sums):
        n = len(ns)
        return pd.DataFrame(
            {
                "n": ns,
                "row_sum": row_sums,
                "row_min": [0] * n,
                "row_max": [0] * n,
                "key_sum": [0] * n,
                "s_len": [0] * n,
                "flags": [0] * n,
                "f1_sum": [0.0] * n,
                "dtypes": ["key:int64"] * n,
            }
        )

    truth = frame([2, 2], [1, 5])  # rows 0..3
    assert check({"tasks": truth, "gpushuffle": frame([2, 2], [1, 5])}, 4)["gpushuffle"].startswith(
        "ok"
    )
    swapped = check({"tasks": truth, "gpushuffle": frame([2, 2], [5, 1])}, 4)["gpushuffle"]
    assert swapped == "MISMATCH: row_sum differs in partitions [0, 1]"
    lost = check({"tasks": truth, "gpushuffle": frame([2, 1], [1, 2])}, 4)["gpushuffle"]
    assert "3 rows, not 4" in lost and "row ids lost or repeated" in lost
