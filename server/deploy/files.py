"""What every renderer's command does with its files: print, write, or check them for drift.

A renderer returns {path: text}; `emit` prints the main file (no `--output`), writes them all
(`--output`), or with `check` compares them with what is committed and prints a diff (exit 1).
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

import yaml

HEADER = """\
# Generated from {config} by `{make}` (python -m server {command}).
# Do not edit by hand: change the profiles or {config} and regenerate;
# `make test` fails while this file differs from a fresh rendering.
"""


def header(config: Path, *, make: str, command: str) -> str:
    return HEADER.format(config=display_path(config), make=make, command=command)


def display_path(path: Path) -> str:
    """A path as written in a header: relative to the checkout, so renderings match anywhere."""
    root = Path(__file__).resolve().parents[2]
    try:
        return path.resolve().relative_to(root).as_posix()
    except ValueError:
        return path.as_posix()


class _Dumper(yaml.SafeDumper):
    """safe_dump, with multi-line strings as literal blocks (`|`), readable as written."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


class Quoted(str):
    """A string written in single quotes, e.g. a port mapping (dclint's require-quotes-in-ports)."""


def _quoted(dumper: yaml.SafeDumper, value: Quoted) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", str(value), style="'")


_Dumper.add_representer(Quoted, _quoted)


def dump(data: object) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)


def emit(files: dict[Path, str], *, main: Path, write: bool, check: bool, regenerate: str) -> int:
    """Print `main`'s text, or write every file, or check every file (exit 1 on drift)."""
    if check:
        return _check(files, regenerate)
    if not write:
        sys.stdout.write(files[main])
        return 0
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _check(files: dict[Path, str], regenerate: str) -> int:
    drift = False
    for path, text in files.items():
        current = path.read_text() if path.exists() else ""
        if current != text:
            drift = True
            sys.stderr.writelines(
                difflib.unified_diff(
                    current.splitlines(keepends=True),
                    text.splitlines(keepends=True),
                    fromfile=f"{path} (committed)",
                    tofile=f"{path} (fresh rendering)",
                )
            )
    if drift:
        print(f"error: out of date; run {regenerate} and commit", file=sys.stderr)
        return 1
    return 0
