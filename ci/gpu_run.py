"""Helpers of ci/gpu_run.sh; standard library only (they run before anything is installed).

python ci/gpu_run.py env OUT.json SITE        versions, import origins, pip check, nvidia-smi
python ci/gpu_run.py probe-gpu                print the device's name, or exit 1 with the reason
python ci/gpu_run.py probe-cudf               import cudf and dask_cudf, sum a Series on the device
python ci/gpu_run.py probe-ucx                import distributed_ucxx and ucxx
python ci/gpu_run.py report WORK RESULTS BUDGET MODE
                                              write RESULTS/gpu-<device>-<date>.json from the
                                              steps ci/gpu_run.sh recorded in WORK
"""

from __future__ import annotations

import filecmp
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEPS = ("kit", "env", "rapids", "test_gpu", "bench", "device_check", "ucx")
EXTRA_NAMES = ("gpushuffle", "torch", "pytest", "pytest-timeout", "hypothesis", "cudf-cu12")


def _lock_names() -> list[str]:
    names = []
    for line in (REPO / "ci" / "gpu_kit.lock").read_text().splitlines():
        if line.startswith(("wheel ", "device ")):
            names.append(line.split()[2 if line.startswith("wheel") else 1].split("==")[0])
    return names


def env(out: str, site: str) -> int:
    names = _lock_names() + list(EXTRA_NAMES)
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    origins: dict[str, str | None] = {}
    for module in ("cudf", "pylibcudf", "rmm", "dask", "distributed", "dask_cuda", "pandas"):
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError) as error:
            origins[module] = f"{type(error).__name__}: {error}"
            continue
        origins[module] = spec.origin if spec else None
    spec = importlib.util.find_spec("gpushuffle")
    origins["gpushuffle"] = str(Path(spec.origin).parent) if spec and spec.origin else None
    report: dict = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "pythonpath": os.environ.get("PYTHONPATH", ""),
        "versions": versions,
        "import_origins": origins,
    }
    # gpushuffle runs from the tree that travelled (first on PYTHONPATH); say
    # whether the kit's wheel, built earlier, holds the same sources.
    installed = Path(site) / "gpushuffle"
    if installed.is_dir():
        differ = [
            str(p.relative_to(REPO))
            for p in sorted((REPO / "gpushuffle").rglob("*"))
            if p.suffix in (".py", ".yaml")
            and not (
                (installed / p.relative_to(REPO / "gpushuffle")).exists()
                and filecmp.cmp(p, installed / p.relative_to(REPO / "gpushuffle"), shallow=False)
            )
        ]
        report["gpushuffle_kit_wheel"] = differ or "same sources as the tree"
    try:
        check = subprocess.run(
            [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=90
        )
        lines = [line for line in check.stdout.splitlines() if line.strip()]
        ours = {n.lower().replace("_", "-") for n in names}
        report["pip_check"] = {
            "problems": len(lines),
            "about_kit_packages": [
                line for line in lines if line.split()[0].lower().replace("_", "-") in ours
            ],
        }
    except (OSError, subprocess.TimeoutExpired) as error:
        report["pip_check"] = f"{type(error).__name__}: {error}"
    smi = shutil.which("nvidia-smi")
    if smi:
        query = subprocess.run(
            [
                smi,
                "--query-gpu=name,driver_version,memory.total,compute_cap",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        report["nvidia_smi"] = (query.stdout or query.stderr).strip()
        full = subprocess.run([smi], capture_output=True, text=True, timeout=60).stdout
        match = re.search(r"CUDA Version:\s*([0-9.]+)", full)
        report["driver_cuda_version"] = match.group(1) if match else None
    else:
        report["nvidia_smi"] = None
    Path(out).write_text(json.dumps(report, indent=1) + "\n")
    for key in ("python", "pythonpath", "nvidia_smi", "driver_cuda_version"):
        print(f"{key}: {report.get(key)}")
    shown = (
        "gpushuffle",
        "cudf-cu13",
        "pylibcudf-cu13",
        "rmm-cu13",
        "dask",
        "distributed",
        "dask-cuda",
        "dask-cudf-cu13",
        "distributed-ucxx-cu13",
        "pandas",
        "numpy",
        "pyarrow",
        "cupy-cuda13x",
        "numba",
        "numba-cuda",
        "cuda-bindings",
        "cuda-core",
        "torch",
    )
    print("versions: " + ", ".join(f"{n} {versions.get(n) or '-'}" for n in shown))
    print("imported from: " + ", ".join(f"{k} {v}" for k, v in origins.items()))
    print(f"pip check: {report['pip_check']}")
    if "gpushuffle_kit_wheel" in report:
        print(f"gpushuffle kit wheel vs tree: {report['gpushuffle_kit_wheel']}")
    return 0


def probe_gpu() -> int:
    try:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
        if int(cupy.arange(4).sum()) != 6:
            raise RuntimeError("cupy computed a wrong sum")
    except Exception as error:
        hint = "" if shutil.which("nvidia-smi") else "; nvidia-smi not found (no NVIDIA driver)"
        print(f"no usable CUDA device: {type(error).__name__}: {error}{hint}".replace("\n", " "))
        return 1
    print(name)
    return 0


def probe_cudf() -> int:
    try:
        import cudf
        import dask_cudf  # noqa: F401

        if int(cudf.Series([1, 2]).sum()) != 3:
            raise RuntimeError("cudf computed a wrong sum")
    except Exception as error:
        print(f"cuDF not usable: {type(error).__name__}: {error}".replace("\n", " "))
        return 1
    print(f"cudf {cudf.__version__}")
    return 0


def probe_ucx() -> int:
    try:
        import distributed_ucxx  # noqa: F401
        import ucxx  # noqa: F401
    except Exception as error:
        print(f"UCX not importable: {type(error).__name__}: {error}".replace("\n", " "))
        return 1
    print("distributed_ucxx and ucxx import")
    return 0


def _junit(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as error:
        return {"error": f"unreadable junit xml: {error}"}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    cases = []
    for case in suite.iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                outcome, message = kind, (element.get("message") or "")[:500]
        cases.append({"test": case.get("name"), "outcome": outcome, "message": message})
    return {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")} | {
        "time_s": float(suite.get("time", 0)),
        "cases": cases,
    }


def report(work: str, results: str, budget: str, mode: str) -> int:
    workdir, resultdir = Path(work), Path(results)
    steps: dict[str, dict] = {}
    for line in (workdir / "steps.tsv").read_text().splitlines():
        name, status, seconds, rc, reason = line.split("\t", 4)
        steps[name] = {
            "status": status,
            "reason": reason,
            "seconds": int(seconds),
            "rc": int(rc) if rc else None,
        }
    for name in STEPS:
        steps.setdefault(name, {"status": "skipped", "reason": "not reached", "seconds": 0})
    probes: dict[str, dict] = {}
    for line in (workdir / "probes.tsv").read_text().splitlines():
        name, ok, detail = line.split("\t", 2)
        probes[name] = {"ok": ok == "1", "detail": detail}
    for step, file in (
        ("env", "env.json"),
        ("bench", "bench.json"),
        ("device_check", "device_check.json"),
        ("ucx", "ucx.json"),
    ):
        path = workdir / file
        if path.exists():
            try:
                steps[step]["result"] = json.loads(path.read_text())
            except json.JSONDecodeError as error:
                steps[step]["result"] = f"unreadable: {error}"
    junit = _junit(resultdir / "test_gpu.xml")
    if junit is not None:
        steps["test_gpu"]["junit"] = junit
    gpu = probes.get("gpu", {})
    device: str | None = gpu.get("detail") if gpu.get("ok") else None
    slug = "none"
    if device:
        slug = re.sub(r"[^a-z0-9]+", "-", device.lower().replace("nvidia", "")).strip("-") or "gpu"
    date = time.strftime("%Y-%m-%d")
    ordered = {name: steps[name] for name in STEPS}
    ordered |= {k: v for k, v in steps.items() if k not in STEPS}
    out = {
        "schema": "gpushuffle-gpu-run/1",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "device": device,
        "mode": mode,
        "budget_s": int(budget),
        "probes": probes,
        "steps": ordered,
    }
    path = resultdir / f"gpu-{slug}-{date}.json"
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"\n{'step':<13} {'status':<8} {'s':>4}  reason")
    for name, entry in ordered.items():
        print(f"{name:<13} {entry['status']:<8} {entry['seconds']:>4}  {entry['reason']}")
    print(f"\nresults: {path}")
    return 0


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit(__doc__)
    command, *args = argv
    if command == "env":
        return env(*args)
    if command == "probe-gpu":
        return probe_gpu()
    if command == "probe-cudf":
        return probe_cudf()
    if command == "probe-ucx":
        return probe_ucx()
    if command == "report":
        return report(*args)
    raise SystemExit(__doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
