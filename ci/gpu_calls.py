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

Table 1's second cell says where each call is made (``cudf.py:345, 518``);
those locations must be the code's.

    python ci/gpu_calls.py          # exits 1 naming each call without a row
                                    # and each row whose locations are stale
    python ci/gpu_calls.py --update # rewrites table 1's locations from the code
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import Counter, defaultdict
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
    "nvidia.nvcomp",
)

#: The table's shorthand for two paths; other paths are relative to gpushuffle/.
SHORT = {"gpushuffle/backends/cudf.py": "cudf.py", "gpushuffle/engine/join.py": "join.py"}


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


def _names(cell: str) -> list[str]:
    """The calls a first cell names, in backticks (``name(args)`` as ``name``)."""
    return [re.sub(r"\(.*\)$", "", name) for name in re.findall(r"`([^`]+)`", cell)]


def documented(table: Path = TABLE) -> set[str]:
    """The calls the evidence table has a row for (first cell, in backticks)."""
    rows = set()
    for line in table.read_text().splitlines():
        if line.startswith("|"):
            rows.update(_names(line.split("|")[1]))
    return rows


def missing(package: Path = PACKAGE, table: Path = TABLE) -> dict[str, list[str]]:
    rows = documented(table)
    return {name: where for name, where in rapids_calls(package).items() if name not in rows}


def _rows(text: str) -> list[tuple[int, list[str]]]:
    """Table 1's rows: (line index, cells split on ``|``)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## 1."))
    rows = []
    for i in range(start + 1, len(lines)):
        if lines[i].startswith("## "):
            break
        cells = lines[i].split("|")
        if lines[i].startswith("|") and "`" in cells[1]:  # not the header or rule
            rows.append((i, cells))
    return rows


def _locations(cell: str) -> set[str]:
    """``cudf.py:345, 518, config.py:74`` -> full path:line each (notes in brackets dropped)."""
    where, path, full = set(), "", {short: path for path, short in SHORT.items()}
    for item in re.sub(r"\([^)]*\)", "", cell).split(","):
        item = item.strip()
        if ":" in item:
            short, item = item.rsplit(":", 1)
            path = full.get(short, f"gpushuffle/{short}")
        if item:
            where.add(f"{path}:{item}")
    return where


def _cell(where: list[str]) -> str:
    """Locations in the table's shorthand: each path once, its lines after it."""
    by_path: dict[str, Counter[int]] = defaultdict(Counter)
    for location in where:
        path, number = location.rsplit(":", 1)
        by_path[path][int(number)] += 1
    items = []
    for path, lines in sorted(by_path.items()):
        short = SHORT.get(path, path.removeprefix("gpushuffle/"))
        for n, (line, times) in enumerate(sorted(lines.items())):
            note = {1: "", 2: " (twice)"}.get(times, f" ({times} times)")
            items.append(f"{short + ':' if n == 0 else ''}{line}{note}")
    return ", ".join(items)


def _called_at(cells: list[str], calls: dict[str, list[str]]) -> list[str]:
    """Where the code makes the calls a row's first cell names (path:line each)."""
    return [w for name in _names(cells[1]) for w in calls.get(name, [])]


def stale(package: Path = PACKAGE, table: Path = TABLE) -> dict[str, tuple[str, str]]:
    """Table 1's rows whose locations are not the code's: first cell -> (doc's, code's)."""
    calls = rapids_calls(package)
    wrong = {}
    for _, cells in _rows(table.read_text()):
        where = _called_at(cells, calls)
        if _locations(cells[2]) != set(where):
            wrong[cells[1].strip()] = (cells[2].strip(), _cell(where))
    return wrong


def update(package: Path = PACKAGE, table: Path = TABLE) -> None:
    """Rewrite table 1's second cells from the code."""
    calls = rapids_calls(package)
    lines = table.read_text().splitlines(keepends=True)
    for i, cells in _rows("".join(lines)):
        cells[2] = f" {_cell(_called_at(cells, calls))} "
        lines[i] = "|".join(cells) + "\n"
    table.write_text("".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check docs/gpu-calls.md against the code.")
    parser.add_argument("--update", action="store_true", help="rewrite table 1's locations")
    if parser.parse_args(argv).update:
        update()
    gaps = missing()
    for name, where in sorted(gaps.items()):
        print(f"no row in {TABLE.relative_to(ROOT)} for `{name}` (called at {', '.join(where)})")
    wrong = stale()
    for row, (doc, code) in sorted(wrong.items()):
        print(f"stale row {row} in {TABLE.relative_to(ROOT)}: says {doc!r}, the code has {code!r}")
    if wrong:
        print("python ci/gpu_calls.py --update rewrites the locations from the code")
    return 1 if gaps or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
