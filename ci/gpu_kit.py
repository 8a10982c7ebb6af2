"""The GPU kit's builder, called by ci/gpu_kit.sh (runs here, never on the GPU machine).

    python ci/gpu_kit.py closure LOCK WHEELDIR [EXTRA_WHEEL ...]
        Check that every requirement of every kit wheel is met by another kit
        wheel, the device's image or an ``omit`` line of LOCK (markers
        evaluated for CPython 3.12 on Linux x86-64).  Exit 1 naming what is not.
    python ci/gpu_kit.py pack LOCK WHEELDIR KITDIR STAMP [EXTRA_WHEEL ...]
        Cut the wheels into parts of at most 60 MiB under KITDIR/parts/,
        each with SHA256SUMS and PIECES (what ci/gpu_kit_assemble.sh reads on
        the device), write KITDIR/MANIFEST and KITDIR/PLAN.txt.
    python ci/gpu_kit.py plan KITDIR
        Print the device plan of a built kit.

Only the standard library and ``packaging`` (pip's vendored copy will do).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from email.parser import Parser
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # pragma: no cover - a bare interpreter
    from pip._vendor.packaging.markers import default_environment  # type: ignore
    from pip._vendor.packaging.requirements import Requirement  # type: ignore
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore
    from pip._vendor.packaging.version import Version  # type: ignore

MiB = 2**20
#: A part, its SHA256SUMS and PIECES included, never exceeds this (tests make it smaller).
PART_BYTES = int(os.environ.get("GPUKIT_PART_BYTES", 60 * MiB))
#: What its pieces may take: the rest is left for the two small text files.
PIECE_BYTES = PART_BYTES - min(256 * 1024, PART_BYTES // 4)
#: What one device call may carry: the working tree and the carried paths.
CALL_BYTES = 64 * MiB
#: The GPU machine's interpreter and platform.
TARGET: dict[str, str] = {
    **default_environment(),  # type: ignore[dict-item]
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}


@dataclass
class Wheel:
    group: str
    name: str
    version: str
    filename: str
    sha256: str | None  # None: built from the tree (gpushuffle)
    path: Path | None = None
    size: int = 0
    requires: list[str] = field(default_factory=list)
    requires_python: str | None = None


@dataclass
class Lock:
    wheels: list[Wheel]
    device: dict[str, str | None]
    omit: dict[str, str]


def parse_lock(path: Path) -> Lock:
    wheels: list[Wheel] = []
    device: dict[str, str | None] = {}
    omit: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        kind, *rest = line.split()
        if kind == "wheel" and len(rest) == 4:
            group, req, filename, sha = rest
            name, _, version = req.partition("==")
            wheels.append(Wheel(group, canonicalize_name(name), version, filename, sha))
        elif kind == "device" and 1 <= len(rest) <= 2:
            device[canonicalize_name(rest[0])] = rest[1] if len(rest) == 2 else None
        elif kind == "omit" and len(rest) >= 2:
            omit[canonicalize_name(rest[0])] = " ".join(rest[1:])
        else:
            raise SystemExit(f"{path}:{number}: cannot read {raw!r}")
    return Lock(wheels, device, omit)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(4 * MiB):
            digest.update(chunk)
    return digest.hexdigest()


def read_metadata(wheel: Wheel) -> None:
    assert wheel.path is not None
    with zipfile.ZipFile(wheel.path) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(name).decode())
    wheel.requires = meta.get_all("Requires-Dist") or []
    wheel.requires_python = meta.get("Requires-Python")
    wheel.size = wheel.path.stat().st_size
    found = canonicalize_name(meta["Name"]), meta["Version"]
    if found != (wheel.name, wheel.version):
        raise SystemExit(f"{wheel.path.name}: metadata says {found}, the lock {wheel.name}")


def load_wheels(lock: Lock, wheeldir: Path, extra: list[str]) -> list[Wheel]:
    wheels = list(lock.wheels)
    for path in map(Path, extra):
        name, version = path.name.split("-")[:2]
        wheels.append(Wheel("core", canonicalize_name(name), version, path.name, None, path))
    for wheel in wheels:
        if wheel.path is None:
            wheel.path = wheeldir / wheel.filename
        if not wheel.path.exists():
            raise SystemExit(f"{wheel.path}: missing; run `bash ci/gpu_kit.sh` to download it")
        read_metadata(wheel)
    return wheels


@dataclass
class Closure:
    report: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    from_device: set[str] = field(default_factory=set)
    omitted: set[str] = field(default_factory=set)


def closure(lock: Lock, wheels: list[Wheel]) -> Closure:
    """Each requirement of each wheel, and what meets it."""
    kit = {w.name: w for w in wheels}
    result = Closure()
    report, errors = result.report, result.errors
    for wheel in wheels:
        if wheel.requires_python and not _contains(wheel.requires_python, "3.12.3"):
            errors.append(f"{wheel.filename}: Requires-Python {wheel.requires_python}")
        todo: list[tuple[str, str, str | None]] = [(wheel.name, r, None) for r in wheel.requires]
        seen_extras: set[tuple[str, str]] = set()
        while todo:
            owner, text, extra = todo.pop(0)
            req = Requirement(text)
            env: dict[str, str] = {**TARGET, "extra": extra or ""}
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            req.marker = None
            name = canonicalize_name(req.name)
            where = f"{owner}{f'[{extra}]' if extra else ''} needs {req}"
            if name in kit:
                if not req.specifier.contains(kit[name].version, prereleases=True):
                    errors.append(f"{where}: the kit has {name} {kit[name].version}")
                    continue
                report.append(f"{where}: kit {kit[name].version}")
                # dask[dataframe] and the like: the extra's requirements count too.
                for e in sorted(req.extras):
                    if (name, e) not in seen_extras:
                        seen_extras.add((name, e))
                        todo += [(name, r, e) for r in kit[name].requires]
            elif name in lock.device:
                version = lock.device[name]
                if version and not req.specifier.contains(version, prereleases=True):
                    errors.append(f"{where}: the device was seen with {name} {version}")
                    continue
                result.from_device.add(name)
                seen = f"device {version}" if version else "device (version not seen yet)"
                extras = f"; its extras {sorted(req.extras)} not checked" if req.extras else ""
                report.append(f"{where}: {seen}{extras}")
            elif name in lock.omit:
                result.omitted.add(name)
                report.append(f"{where}: OMITTED, {lock.omit[name]}")
            else:
                errors.append(
                    f"{where}: neither in the kit nor on the device; add a `wheel` line "
                    f"(or `device`/`omit`) to ci/gpu_kit.lock"
                )
    return result


def _contains(spec: str, version: str) -> bool:
    return Requirement(f"x{spec}" if spec[0] in "<>=!~" else f"x {spec}").specifier.contains(
        Version(version)
    )


# -- parts --------------------------------------------------------------------------------


def pack(lock: Lock, wheels: list[Wheel], kitdir: Path, stamp: str) -> dict:
    """Cut each group's wheels into parts; returns the manifest."""
    parts_dir = kitdir / "parts"
    if parts_dir.exists():
        shutil.rmtree(parts_dir)
    parts_dir.mkdir(parents=True)
    groups = sorted({w.group for w in wheels}, key=lambda g: (g != "core", g))
    parts: list[dict] = []
    for group in groups:
        members = [w for w in wheels if w.group == group]
        # Largest first; gpushuffle's own wheel (built from the tree, changing
        # with every commit) last, so that a rebuild changes the last part only.
        members.sort(key=lambda w: (w.sha256 is None, -w.size, w.name))
        pieces: list[list[tuple[Wheel, int, int]]] = [[]]  # (wheel, offset, length)
        room = PIECE_BYTES
        for wheel in members:
            offset = 0
            while offset < wheel.size:
                if room == 0:
                    pieces.append([])
                    room = PIECE_BYTES
                length = min(room, wheel.size - offset)
                pieces[-1].append((wheel, offset, length))
                offset += length
                room -= length
        for number, contents in enumerate(pieces, 1):
            parts.append({"name": f"{group}{number}", "group": group, "contents": contents})
    part_names = " ".join(p["name"] for p in parts)
    wheel_info = {}
    for wheel in wheels:
        assert wheel.path is not None
        digest = sha256(wheel.path)
        if wheel.sha256 is not None and digest != wheel.sha256:
            raise SystemExit(
                f"{wheel.path}: sha256 {digest}, the lock says {wheel.sha256}; "
                f"delete it and run `bash ci/gpu_kit.sh` to download it again"
            )
        wheel.sha256 = digest
        count = sum(1 for p in parts for (w, _, _) in p["contents"] if w is wheel)
        wheel_info[wheel.filename] = {"count": count, "index": 0}
    manifest_parts = []
    for part in parts:
        directory = parts_dir / part["name"]
        directory.mkdir()
        sums, lines = [], [f"kit {stamp}", f"parts {part_names}"]
        for wheel, offset, length in part["contents"]:
            info = wheel_info[wheel.filename]
            index, count = info["index"], info["count"]
            info["index"] += 1
            piece = wheel.filename if count == 1 else f"{wheel.filename}.{index:03d}"
            _copy_range(wheel.path, directory / piece, offset, length)
            digest = sha256(directory / piece)
            sums.append(f"{digest}  {piece}")
            lines.append(
                f"piece {piece} {digest} {length} {wheel.filename} {index} {count} "
                f"{wheel.sha256} {wheel.size} {wheel.group}"
            )
        (directory / "SHA256SUMS").write_text("\n".join(sums) + "\n")
        (directory / "PIECES").write_text("\n".join(lines) + "\n")
        size = sum(f.stat().st_size for f in directory.iterdir())
        if size > PART_BYTES:
            raise SystemExit(f"{directory}: {size} bytes, over {PART_BYTES}")
        manifest_parts.append(
            {
                "name": part["name"],
                "group": part["group"],
                "path": str(directory.relative_to(kitdir.parent)),
                "bytes": size,
                "pieces": len(part["contents"]),
            }
        )
    manifest = {
        "kit": stamp,
        "target": "CPython 3.12, manylinux x86-64, CUDA 13 (RAPIDS 26.10)",
        "part_limit_bytes": PART_BYTES,
        "parts": manifest_parts,
        "wheels": [
            {
                "group": w.group,
                "name": w.name,
                "version": w.version,
                "file": w.filename,
                "bytes": w.size,
                "sha256": w.sha256,
                "pieces": wheel_info[w.filename]["count"],
            }
            for w in wheels
        ],
        "device": lock.device,
        "omit": lock.omit,
    }
    (kitdir / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _copy_range(source: Path, target: Path, offset: int, length: int) -> None:
    if offset == 0 and length == source.stat().st_size:
        try:
            os.link(source, target)
            return
        except OSError:
            pass
    with source.open("rb") as src, target.open("wb") as dst:
        src.seek(offset)
        while length:
            chunk = src.read(min(length, 8 * MiB))
            dst.write(chunk)
            length -= len(chunk)


# -- the plan -------------------------------------------------------------------------------


def tree_bytes(root: Path) -> int:
    """What travels with every device call besides the carried paths: tracked and
    untracked-not-ignored files of this checkout (the lead's, when it calls)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0  # not a git checkout: nothing else travels
    total = 0
    for name in out.decode().split("\0"):
        path = root / name
        if name and path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def plan(kitdir: Path) -> str:
    manifest = json.loads((kitdir / "MANIFEST.json").read_text())
    root = kitdir.resolve().parent
    tree = tree_bytes(root)
    core = [p for p in manifest["parts"] if p["group"] == "core"]
    optional = [p for p in manifest["parts"] if p["group"] != "core"]
    # The last core part rides with the final run: one call fewer.
    final, early = core[-1], core[:-1] + optional
    mib = lambda n: f"{n * 10 // MiB / 10:.1f} MiB"  # noqa: E731  (rounded down)
    lines = [
        f"GPU kit {manifest['kit'][:12]}: {len(manifest['wheels'])} wheels, "
        f"{len(manifest['parts'])} parts ({', '.join(p['name'] for p in manifest['parts'])}), "
        f"{mib(sum(p['bytes'] for p in manifest['parts']))} in all, largest "
        f"{mib(max(p['bytes'] for p in manifest['parts']))}; "
        f"the working tree that travels with every call: {mib(tree)}",
        "",
        "Device plan: consecutive `run` calls, each started within 30 s of the last one's "
        "end (the machine keeps earlier parts only while it is warm).  Each part run checks "
        "the sha256 of every part that has arrived and lists the missing ones; if one says a "
        "part that was sent is missing, the machine was replaced: start again at run 1.",
        "",
    ]
    over = [p for p in manifest["parts"] if p["bytes"] + tree > CALL_BYTES]
    if over:
        lines.append(
            f"WARNING: {', '.join(p['name'] for p in over)} plus the working tree exceed "
            f"{mib(CALL_BYTES)} a call: make the tree smaller (ignore or remove large files)."
        )
    for number, part in enumerate(early, 1):
        probe = " --probe" if number == 1 else ""
        note = " (optional: the UCX step needs it)" if part["group"] != "core" else ""
        lines += [
            f"run {number}{note}: {mib(part['bytes'])}",
            f"  carry: {json.dumps([part['path']])}",
            f"  command: bash ci/gpu_kit_assemble.sh check{probe}",
            "  timeout_s: 60",
        ]
    lines += [
        f"final run {len(early) + 1}: {mib(final['bytes'])}, then reassembles, installs into "
        f"/tmp/site and runs every step (results in $OUT)",
        f"  carry: {json.dumps([final['path']])}",
        '  command: bash ci/gpu_run.sh "$OUT"',
        "  timeout_s: 540  (ci/gpu_run.sh keeps to GPU_RUN_BUDGET_S, 420 s by default)",
        "",
        "A rerun of some steps while the machine is still warm (parts and /tmp/site stay):",
        '  command: bash ci/gpu_run.sh "$OUT" --steps bench,ucx   (carry nothing)',
        "",
        f"Estimated device time: start 60-120 s + {len(early)} part runs x ~30 s (transfer, "
        f"a few seconds of checks, the gap to the next call) + the final run (<= 420 s "
        f"budget + transfer) = about {(90 + 30 * len(early) + 440) / 60:.1f} min of the 15; "
        f"without the optional parts {(90 + 30 * len(core[:-1]) + 440) / 60:.1f} min.",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    command, *args = argv
    if command == "closure":
        lock_path, wheeldir, *extra = args
        lock = parse_lock(Path(lock_path))
        wheels = load_wheels(lock, Path(wheeldir), extra)
        found = closure(lock, wheels)
        out = Path(wheeldir).parent / "CLOSURE.txt"
        out.write_text("\n".join(found.report + [f"ERROR {e}" for e in found.errors]) + "\n")
        print(
            f"closure: {len(wheels)} wheels, {len(found.report)} requirements met "
            f"(CPython 3.12, Linux x86-64); from the device's image: "
            f"{', '.join(sorted(found.from_device))}; left out on purpose: "
            f"{', '.join(sorted(found.omitted)) or 'nothing'}; details in {out}"
        )
        for error in found.errors:
            print(f"closure ERROR: {error}", file=sys.stderr)
        return 1 if found.errors else 0
    if command == "pack":
        lock_path, wheeldir, kitdir, stamp, *extra = args
        lock = parse_lock(Path(lock_path))
        wheels = load_wheels(lock, Path(wheeldir), extra)
        pack(lock, wheels, Path(kitdir), stamp)
        return 0
    if command == "plan":
        (kitdir,) = args
        text = plan(Path(kitdir))
        (Path(kitdir) / "PLAN.txt").write_text(text + "\n")
        print(text)
        return 0
    raise SystemExit(__doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
