"""Every RAPIDS call in gpushuffle/ must have a row of evidence in docs/gpu-calls.md.

The cuDF path cannot run on CI's machines, so each call it makes into
RAPIDS (pylibcudf, cudf, cupy, rmm, dask_cudf, dask_cuda, NVML) is backed by
upstream code or a test in the 26.10 sources that makes the same call with
the same argument types.  This finds the calls: every call whose function is
a name imported from one of those packages, or an attribute chain rooted at
one (``plc.copying.gather``, ``ColumnBase.create``, ``nvml.one_time``), as
written in the code.  Methods of the objects they return (``column.type()``)
are not visible here; the table lists them too, and the GPU type check
(ci/typecheck_gpu.sh) holds them against pylibcudf's stubs.

    python ci/gpu_calls.py          # exits 1 naming each call without a row
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpushuffle"
TABLE = ROOT / "docs" / "gpu-calls.md"

RAPIDS = (
    "pylibcudf",
    "cudf",
    "cupy",
    "rmm",
    "dask_cudf",
    "dask_cuda",
    "distributed.diagnostics.nvml",
)


def _is_rapids(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in RAPIDS)


def _imported_names(tree: ast.AST) -> set[str]:
    """Names bound (anywhere in the module) by imports from RAPIDS packages."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_rapids(alias.name):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if _is_rapids(f"{node.module}.{alias.name}") or _is_rapids(node.module):
                    names.add(alias.asname or alias.name)
    return names


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def rapids_calls(package: Path = PACKAGE) -> dict[str, list[str]]:
    """Each RAPIDS call as written (``plc.copying.gather``) -> where (path:line)."""
    calls: dict[str, list[str]] = defaultdict(list)
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        roots = _imported_names(tree)
        if not roots:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = _dotted(node.func)
                if name and name.split(".")[0] in roots:
                    calls[name].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return dict(calls)


def documented(table: Path = TABLE) -> set[str]:
    """The calls the evidence table has a row for (first cell, in backticks)."""
    rows = set()
    for line in table.read_text().splitlines():
        if line.startswith("|"):
            first = line.split("|")[1]
            rows.update(re.findall(r"`([^`]+)`", first))
    return {re.sub(r"\(.*\)$", "", row) for row in rows}


def missing(package: Path = PACKAGE, table: Path = TABLE) -> dict[str, list[str]]:
    rows = documented(table)
    return {name: where for name, where in rapids_calls(package).items() if name not in rows}


def main() -> int:
    gaps = missing()
    for name, where in sorted(gaps.items()):
        print(f"no row in {TABLE.relative_to(ROOT)} for `{name}` (called at {', '.join(where)})")
    return 1 if gaps else 0


if __name__ == "__main__":
    sys.exit(main())
