"""Every RAPIDS name gpushuffle/ uses must exist in the installed RAPIDS stack.

The cuDF path has never run on a GPU, and cudf ships no type information: a
misspelt or moved ``cudf.*`` name, a ``from cudf... import`` that no longer
exists or a pylibcudf enum member renamed upstream would fail first on a
user's GPU.  RAPIDS imports without a GPU (with ``RAPIDS_NO_INITIALIZE=1``
nothing touches the device), so this finds, in the package's syntax trees:

- each import of a RAPIDS module (``import pylibcudf as plc``,
  ``from cudf.core.column import ColumnBase``), and each module named to
  ``importlib``'s ``import_module``/``find_spec`` as a string;
- each attribute chain rooted at a name such an import binds, called or
  not (``plc.copying.OutOfBoundsPolicy.DONT_CHECK``,
  ``cudf.core.dtypes.DecimalDtype``, ``ColumnBase.create``);

and resolves each against the real modules.  Methods of objects they return
(``column.type()``) are not visible here; the GPU type check holds those
against pylibcudf's stubs (ci/typecheck_gpu.sh).

    RAPIDS_NO_INITIALIZE=1 python ci/rapids_names.py   # exits 1 naming file:line
                                                        # and each name that fails
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpushuffle"

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_calls import RAPIDS as CALLED  # noqa: E402  (ci/ is not a package)
from gpu_calls import _dotted  # noqa: E402

#: The packages whose names are checked: those whose calls need evidence
#: (ci/gpu_calls.py), and NVML's and UCX's other bindings.
RAPIDS = (*CALLED, "pynvml", "ucxx", "distributed_ucxx")

_IMPORTERS = {"import_module", "find_spec"}


def is_rapids(module: str, packages: tuple[str, ...] = RAPIDS) -> bool:
    return any(module == m or module.startswith(m + ".") for m in packages)


@dataclass(frozen=True)
class Reference:
    """A name as the code uses it: ``module`` imported, then ``attrs`` looked up."""

    path: str
    line: int
    module: str
    attrs: tuple[str, ...]

    @property
    def name(self) -> str:
        return ".".join((self.module, *self.attrs))


def _bindings(tree: ast.AST, packages: tuple[str, ...]) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Names bound by RAPIDS imports -> (module, attributes of it)."""
    bound: dict[str, tuple[str, tuple[str, ...]]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not is_rapids(alias.name, packages):
                    continue
                if alias.asname:
                    bound[alias.asname] = (alias.name, ())
                else:  # ``import cudf.core.dtypes`` binds ``cudf``
                    top = alias.name.split(".")[0]
                    bound.setdefault(top, (top, ()))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if is_rapids(node.module, packages) or is_rapids(
                    f"{node.module}.{alias.name}", packages
                ):
                    bound[alias.asname or alias.name] = (node.module, (alias.name,))
    return bound


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]`` (gpu_calls.py's dotted name, split)."""
    dotted = _dotted(node)
    return dotted.split(".") if dotted else None


def references(package: Path = PACKAGE, packages: tuple[str, ...] = RAPIDS) -> list[Reference]:
    """Every RAPIDS name the modules under ``package`` use, where they use it."""
    found: list[Reference] = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        where = str(path.relative_to(package.parent))
        bound = _bindings(tree, packages)
        # Only the outermost node of a chain: ``a.b.c``, not also ``a.b``.
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [
                    Reference(where, node.lineno, alias.name, ())
                    for alias in node.names
                    if is_rapids(alias.name, packages)
                ]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found += [
                    Reference(where, node.lineno, node.module, (alias.name,))
                    for alias in node.names
                    if alias.name != "*"
                    and (
                        is_rapids(node.module, packages)
                        or is_rapids(f"{node.module}.{alias.name}", packages)
                    )
                ]
            elif isinstance(node, ast.Call) and node.args:
                func = _chain(node.func)
                arg = node.args[0]
                if (
                    func
                    and func[-1] in _IMPORTERS
                    and isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str)
                    and is_rapids(arg.value, packages)
                ):
                    found.append(Reference(where, node.lineno, arg.value, ()))
            if isinstance(node, ast.Attribute) and id(node) not in inner:
                parts = _chain(node)
                if parts and parts[0] in bound:
                    module, attrs = bound[parts[0]]
                    found.append(Reference(where, node.lineno, module, (*attrs, *parts[1:])))
    return found


def resolve(ref: Reference) -> str | None:
    """None if ``ref`` resolves; else why not."""
    try:
        obj = importlib.import_module(ref.module)
    except ImportError as e:
        return f"cannot import {ref.module}: {e}"
    prefix = ref.module
    for attr in ref.attrs:
        prefix = f"{prefix}.{attr}"
        try:
            obj = getattr(obj, attr)
            continue
        except AttributeError:
            pass
        try:  # a submodule not imported by its package
            obj = importlib.import_module(prefix)
        except ImportError:
            return f"{prefix} does not exist"
    return None


def failures(package: Path = PACKAGE, packages: tuple[str, ...] = RAPIDS) -> list[str]:
    """``path:line: name: why`` for each reference that does not resolve."""
    out = []
    for ref in references(package, packages):
        why = resolve(ref)
        if why is not None:
            out.append(f"{ref.path}:{ref.line}: {ref.name}: {why}")
    return out


def main() -> int:
    if not os.environ.get("RAPIDS_NO_INITIALIZE"):
        print(
            "set RAPIDS_NO_INITIALIZE=1: importing RAPIDS must not touch a device", file=sys.stderr
        )
        return 2
    refs = references()
    bad = failures()
    for line in bad:
        print(line)
    print(f"{len(refs)} RAPIDS names used in gpushuffle/, {len(bad)} do not resolve")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
