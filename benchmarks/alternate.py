"""``python -m benchmarks.alternate``: versions of gpushuffle timed in alternation.

On the 2-core VMs this project runs on, two invocations of the same benchmark
an hour apart differ by 5-10%, more than most changes are worth: a claim that
one version is faster holds only when their runs alternate, within minutes.
Each variant is ``NAME=WHERE``: a directory holding a ``gpushuffle`` package
(a checkout, ``.``) or a git revision, checked out into a temporary worktree
that is removed afterwards.  Each round runs ``gpushuffle bench ARGS --methods
gpushuffle --repeat N`` once per variant, the variant's package first on
``PYTHONPATH`` (the workers inherit it), in order A B C, then C B A, and so
on; reported per variant are each round's median, the median of those, its
ratio to the first variant's, and how far the first run of each round peaked
above its start (later runs start with the pool's blocks: not comparable)::

    python -m benchmarks.alternate -v before=4b8fbea -v now=. --rounds 3 -- \\
        --rows 8000000 --dtypes mixed

Within one cluster, flipping a module attribute on the workers between runs
(``run_benchmark(on_result=...)`` and ``client.run``) is more precise still
(about 2%), but only where the change can be switched at run time.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

_REPOSITORY = Path(__file__).resolve().parent.parent
#: Set by this tool for every run: passing them too would be ambiguous.
_OWN_OPTIONS = ("--methods", "--repeat", "--json")


@dataclass
class Variant:
    """One version of gpushuffle: where its package is, and its results."""

    name: str
    path: Path
    medians: list[float] = field(default_factory=list)
    first_peaks: list[int] = field(default_factory=list)


def parse_variant(spec: str) -> tuple[str, str]:
    """``NAME=WHERE`` -> (name, where), with a clear error otherwise."""
    name, sep, where = spec.partition("=")
    if not sep or not name or not where:
        raise click.BadParameter(
            f"{spec!r} is not NAME=WHERE (a directory holding gpushuffle, or a git revision), "
            "e.g. before=4b8fbea or now=."
        )
    return name, where


def _package_dir(where: str) -> Path | None:
    path = Path(where).expanduser().resolve()
    return path if (path / "gpushuffle" / "__init__.py").is_file() else None


@contextlib.contextmanager
def checked_out(where: str, scratch: Path) -> Iterator[Path]:
    """A directory holding ``where``'s gpushuffle: ``where`` itself, or a
    temporary git worktree of the revision ``where``, removed on exit."""
    path = _package_dir(where)
    if path is not None:
        yield path
        return
    tree = scratch / f"worktree-{len(list(scratch.iterdir()))}"
    git = ["git", "-C", str(_REPOSITORY)]
    added = subprocess.run(
        [*git, "worktree", "add", "--detach", str(tree), where], capture_output=True, text=True
    )
    if added.returncode:
        raise click.ClickException(
            f"{where!r} is neither a directory holding gpushuffle nor a git revision of "
            f"{_REPOSITORY}: {added.stderr.strip()}"
        )
    try:
        yield tree
    finally:
        subprocess.run([*git, "worktree", "remove", "--force", str(tree)], capture_output=True)
        subprocess.run([*git, "worktree", "prune"], capture_output=True)


def _environment(path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH")) if p)
    return env


def check_imports_from(path: Path, cwd: Path) -> None:
    """Fail unless a process given ``path`` imports gpushuffle from there (an
    install that shadows it would time the wrong version)."""
    found = subprocess.run(
        [sys.executable, "-c", "import gpushuffle; print(gpushuffle.__file__)"],
        env=_environment(path),
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    location = Path(found.stdout.strip() or "?").resolve()
    if found.returncode or path not in location.parents:
        raise click.ClickException(
            f"with PYTHONPATH={path} gpushuffle was imported from {location} "
            f"{found.stderr.strip()[-500:]}".rstrip()
        )


def run_round(variant: Variant, bench_args: list[str], repeat: int, scratch: Path) -> None:
    """One ``gpushuffle bench`` of ``variant``: its median and first peak."""
    out = scratch / f"{variant.name}-{len(variant.medians)}.json"
    command = [
        sys.executable,
        "-c",
        "from gpushuffle.cli import main; main()",
        "bench",
        *bench_args,
        "--methods",
        "gpushuffle",
        "--repeat",
        str(repeat),
        "--json",
        str(out),
    ]
    done = subprocess.run(
        command, env=_environment(variant.path), cwd=scratch, capture_output=True, text=True
    )
    if done.returncode:
        raise click.ClickException(
            f"{variant.name}: gpushuffle bench failed ({done.returncode}):\n{done.stderr[-3000:]}"
        )
    runs: list[dict] = json.loads(out.read_text())
    failed = [r["error"] for r in runs if r.get("error")]
    if failed:
        raise click.ClickException(f"{variant.name}: a run failed: {failed[0]}")
    walls = [r["wall_s"] for r in runs]
    variant.medians.append(statistics.median(walls))
    first = runs[0]
    variant.first_peaks.append(
        first["peak_worker_rss_bytes"] - first["peak_breakdown"]["rss_before"]
    )


def summary(variants: list[Variant]) -> list[dict[str, Any]]:
    """A row per variant: rounds' medians, their median, ratio to the first."""
    base = statistics.median(variants[0].medians)
    rows = []
    for v in variants:
        median = statistics.median(v.medians)
        rows.append(
            {
                "variant": v.name,
                "path": str(v.path),
                "round_medians_s": [round(m, 4) for m in v.medians],
                "median_s": round(median, 4),
                "ratio": round(median / base, 3),
                "first_run_peak_above_start_mib": [p >> 20 for p in v.first_peaks],
            }
        )
    return rows


@click.command(context_settings={"ignore_unknown_options": True})
@click.option(
    "-v",
    "--variant",
    "specs",
    multiple=True,
    required=True,
    help="NAME=WHERE: a directory holding gpushuffle (e.g. now=.) or a git revision "
    "(e.g. before=4b8fbea). Two or more; ratios are to the first.",
)
@click.option("--rounds", default=3, show_default=True, help="Rounds of one run per variant.")
@click.option("--repeat", default=3, show_default=True, help="Runs per bench (the median counts).")
@click.option("--json", "json_path", default=None, help="Write the summary here.")
@click.argument("bench_args", nargs=-1, type=click.UNPROCESSED)
def main(
    specs: tuple[str, ...], rounds: int, repeat: int, json_path: str | None, bench_args: tuple
) -> None:
    """Time versions of gpushuffle in alternation: BENCH_ARGS go to `gpushuffle bench`."""
    parsed = [parse_variant(s) for s in specs]
    names = [name for name, _ in parsed]
    if len(parsed) < 2 or len(set(names)) < len(names):
        raise click.UsageError("give two or more variants, each with a name of its own")
    own = [a for a in bench_args if a.split("=")[0] in _OWN_OPTIONS]
    if own:
        raise click.UsageError(f"{own[0]} is set by this tool (--repeat is its own option)")
    if rounds < 1 or repeat < 1:
        raise click.UsageError("--rounds and --repeat must be at least 1")
    with (
        tempfile.TemporaryDirectory(prefix="gpushuffle-alternate-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        # Resolved: the import check compares it with a resolved module path
        # (a temporary directory can be a symlink, as on macOS).
        scratch = Path(tmp).resolve()
        trees = scratch / "trees"
        trees.mkdir()
        variants = [
            Variant(name, stack.enter_context(checked_out(where, trees))) for name, where in parsed
        ]
        for v in variants:
            check_imports_from(v.path, scratch)
        order = []
        for r in range(rounds):
            for v in variants if r % 2 == 0 else variants[::-1]:
                run_round(v, list(bench_args), repeat, scratch)
                order.append(v.name)
                click.echo(
                    f"round {r}: {v.name:12s} median {v.medians[-1]:.3f} s, first run "
                    f"{v.first_peaks[-1] >> 20} MiB above its start"
                )
        rows = summary(variants)
    click.echo(f"\n{'variant':12s} {'median s':>9s} {'ratio':>6s}  rounds' medians")
    for row in rows:
        name, median, ratio = row["variant"], row["median_s"], row["ratio"]
        click.echo(f"{name:12s} {median:9.3f} {ratio:6.3f}  {row['round_medians_s']}")
    if json_path:
        Path(json_path).write_text(
            json.dumps({"bench_args": list(bench_args), "order": order, "variants": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
