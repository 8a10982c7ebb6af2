"""The configuration keys of ``gpushuffle.yaml`` with their defaults and the
comments above them, for the docs site's configuration page."""

from __future__ import annotations

from pathlib import Path

YAML = Path(__file__).with_name("gpushuffle.yaml")


def config_keys(path: Path = YAML) -> list[tuple[str, str, str]]:
    """``(dotted key, default, meaning)`` for every leaf key, in file order.

    The meaning is the comment block right above the key (a block above a
    section applies to it, not to its keys).
    """
    keys: list[tuple[str, str, str]] = []
    stack: list[tuple[int, str]] = []
    comment: list[str] = []
    for raw in path.read_text().splitlines():
        line = raw.rstrip()
        stripped = line.lstrip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
            continue
        indent = len(line) - len(stripped)
        name, _, value = stripped.partition(":")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if value.strip():
            dotted = ".".join([part for _, part in stack] + [name])
            keys.append((dotted, value.strip(), " ".join(comment)))
        else:
            stack.append((indent, name))
        comment = []
    return keys


def markdown_table(path: Path = YAML) -> str:
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for key, default, meaning in config_keys(path):
        rows.append(f"| `{key}` | `{default}` | {meaning.replace('|', '/')} |")
    return "\n".join(rows) + "\n"
