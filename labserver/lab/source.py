"""The code a lesson teaches, shown as the code has it: ``show_source`` and the check that keeps it so.

A notebook about a strategy prints that strategy's rule (its ``collect`` or ``admit``: the
lines that are the lesson), not only its results. A committed notebook keeps what it printed
when it last ran, and the code goes on changing, so the printed source can go stale. Two
halves keep them together:

- ``show_source(obj)`` prints ``obj``'s source as plain text (a stream output), the one way a
  notebook shows project code;
- ``stale_blocks(text, sources)`` finds, in a notebook's output text, each block that starts
  with ``def``, ``async def`` or ``class`` and runs three lines or more (its body indented
  under it), and returns those that no file under ``labserver/`` holds verbatim (allowing the
  whole block one uniform indent). ``tests/test_notebooks.py`` runs it over every committed
  notebook: a block it returns is a cell to re-execute.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["package_sources", "show_source", "stale_blocks"]

_HEAD = re.compile(r"^(\s*)(async def |def |class )\w")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def show_source(obj: Any, start: str | None = None, lines: int | None = None) -> None:
    """Print ``obj``'s source (a function, method, class or property getter) as the file has it, under a line that
    says where it lives (which also keeps two printed sources apart); ``start``: only from its first line that holds
    this text, ``lines`` of them (the part of a long function a lesson is about)."""
    code = getattr(obj, "fget", obj)  # (a property: its getter)
    print(f"# {getattr(code, '__module__', '?')}.{getattr(code, '__qualname__', getattr(code, '__name__', '?'))}")
    text = inspect.getsource(obj)
    if start is not None:
        source = text.splitlines()
        at = next((k for k, line in enumerate(source) if start in line), None)
        if at is None:
            raise ValueError(f"{start!r} is not in the source of {getattr(obj, '__qualname__', obj)}")
        text = "\n".join(source[at:at + lines if lines else None])
    print(text)


def package_sources(root: Path | None = None) -> list[str]:
    """Every ``.py`` file under the package, trailing spaces stripped from each line."""
    root = root or Path(__file__).resolve().parents[1]
    return ["\n".join(line.rstrip() for line in p.read_text().splitlines()) for p in sorted(root.rglob("*.py"))]


def stale_blocks(text: str, sources: Iterable[str]) -> list[str]:
    """The first line of each printed ``def``/``class`` block of 3+ lines that no source holds verbatim."""
    files = list(sources)
    lines = _ANSI.sub("", text).splitlines()
    stale, i = [], 0
    while i < len(lines):
        head = _HEAD.match(lines[i])
        if head is None:
            i += 1
            continue
        indent, j = len(head.group(1)), i + 1
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
            j += 1
        block = [line.rstrip() for line in lines[i:j]]
        while block and not block[-1]:
            block.pop()
        body = "\n".join(block)
        dedented = "\n".join(line[indent:] for line in block)  # (every line of it holds that indent, or none)
        if len(block) >= 3 and not any(body in f or dedented in f for f in files):
            stale.append(block[0].strip())
        i = j
    return stale
