"""benchmarks/results/ holds what the docs cite, and no more than 30 files.

Every result file the README or the docs name (`NAME.json`, a glob such as
`tight-*.json`, or `{a,b}` alternatives) exists in benchmarks/results/ or is
listed in INDEX.md's "In git history" table; every file there is named in
INDEX.md; there are at most 30 of them.  Exits 1 naming what is wrong.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MOST_FILES = 30
# A result file's name as the docs cite it; names that begin with "-" are
# suffixes of the name before them ("`-even-inputs-2.json`") and are skipped.
CITED = re.compile(r"`(?:benchmarks/results/)?([A-Za-z0-9][A-Za-z0-9_.{},*-]*\.json)`")


def _expand(name: str) -> list[str]:
    """`cpu-{a,b}.json` -> [`cpu-a.json`, `cpu-b.json`]."""
    match = re.search(r"\{([^}]*)\}", name)
    if match is None:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    return [n for alt in match.group(1).split(",") for n in _expand(head + alt + tail)]


def problems() -> list[str]:
    files = sorted(p.name for p in RESULTS.iterdir() if p.is_file())
    index = (RESULTS / "INDEX.md").read_text()
    listed, _, history_part = index.partition("## In git history")
    # The first cell of each row of the history table names the files.
    first_cells = [row.split("|")[1] for row in history_part.splitlines() if row.startswith("| `")]
    in_history = {
        n for cell in first_cells for cited in CITED.findall(cell) for n in _expand(cited)
    }
    named = {n for cited in CITED.findall(listed) for n in _expand(cited)}
    suffixes = re.findall(r"`(-[A-Za-z0-9_.-]+\.json)`", listed)
    found = []
    if len(files) > MOST_FILES:
        found.append(
            f"benchmarks/results/ has {len(files)} files, at most {MOST_FILES}:"
            " move superseded runs to INDEX.md's 'In git history'"
        )
    for name in files:
        if name == "INDEX.md":
            continue
        if not any(fnmatch.fnmatch(name, pattern) for pattern in named) and not any(
            name.endswith(suffix) for suffix in suffixes
        ):
            found.append(
                f"benchmarks/results/{name} is not in INDEX.md:"
                " add a row saying what it is and where it is cited"
            )
    for name in sorted(in_history & set(files)):
        found.append(
            f"{name} is in benchmarks/results/ and in INDEX.md's 'In git history': one or the other"
        )
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for doc in docs:
        for cited in CITED.findall(doc.read_text()):
            for name in _expand(cited):
                if name in in_history or any(fnmatch.fnmatch(f, name) for f in files):
                    continue
                if "/" not in cited and not _looks_like_a_result(name):
                    continue
                found.append(
                    f"{doc.relative_to(ROOT)} cites {name}, which is neither in"
                    " benchmarks/results/ nor in INDEX.md's 'In git history'"
                )
    return found


def _looks_like_a_result(name: str) -> bool:
    """The docs' result files begin with the benchmark's kind."""
    kinds = (
        "cpu-",
        "hosts-",
        "tpch-",
        "tight-",
        "skew",
        "hotkey-",
        "larger-",
        "reorder-",
        "samehost-",
    )
    return name.startswith(kinds)


def main() -> int:
    found = problems()
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
