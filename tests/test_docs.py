"""The words hold on the numbers: the README stays short, and every ratio the docs print is its numbers' ratio.

A ratio in a table is written ``**r** (a vs b ...)``: r must be a / b (to the rounding of the
three), so a figure copied from one run beside numbers from another, or a median of ratios
beside two medians, fails here. The main job's reference table in docs/measuring.md must be
the one its committed results print.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RATIO = re.compile(r"\*\*(?P<r>[0-9]*\.?[0-9]+)\*\* \((?:[a-z ]+ )?(?P<a>[0-9]*\.?[0-9]+)[^()\d]{0,20}? vs "
                   r"(?P<b>[0-9]*\.?[0-9]+)")
MAX_README_WORDS = 1700  # the prose: the results block, written from results/, comes on top


def test_the_readme_is_short() -> None:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- results -->.*<!-- /results -->", text, re.S)
    words = len((text[:block.start()] + text[block.end():] if block else text).split())
    assert words <= MAX_README_WORDS, f"README.md has {words} words besides its results block; long tables belong in docs/"


def test_the_ratio_finder_reads_the_table_format() -> None:
    found = [m.groupdict() for m in RATIO.finditer("| **1.06** (61.9 vs 58.2 tokens/s) | **0.040** (2.05 vs 50.9 s) |")]
    assert found == [{"r": "1.06", "a": "61.9", "b": "58.2"}, {"r": "0.040", "a": "2.05", "b": "50.9"}]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_ratio_is_its_numbers_ratio(path: Path) -> None:
    wrong = []
    for m in RATIO.finditer(path.read_text()):
        r, a, b = (float(m[k]) for k in ("r", "a", "b"))
        if b and abs(r - a / b) > 0.015 * max(r, a / b) + 0.006:  # each figure is rounded to what it shows
            wrong.append(f"{m.group(0)}: {a} / {b} = {a / b:.3f}")
    assert not wrong, "\n".join(wrong)


def test_the_reference_table_is_the_committed_run() -> None:
    from labserver.experiments.compare import table

    summary = pd.read_csv(ROOT / "results" / "reference" / "summary.csv")
    printed = table(summary).strip()
    assert printed in (ROOT / "docs" / "measuring.md").read_text(), \
        "docs/measuring.md must show `labserver compare --out results/reference`'s own table"


def test_the_generation_figures_are_in_the_run_they_cite() -> None:
    """Every pair of numbers in benchmarks/README.md's genperf table is in results/genperf/cpu.txt."""
    text = (ROOT / "benchmarks" / "README.md").read_text()
    section = text[text.index("## Generation: `genperf.py`"):text.index("## The load generator's ceiling")]
    printed = (ROOT / "results" / "genperf" / "cpu.txt").read_text()
    missing = [f"{m['a']} vs {m['b']}" for m in RATIO.finditer(section)
               if not re.search(rf"\b{re.escape(m['a'])}\d* vs {re.escape(m['b'])}", printed)]
    assert not missing, f"not in results/genperf/cpu.txt: {missing}"


# -- the README's figures come from results/ ------------------------------------------------------------------

README_FIGURE = re.compile(r"(?<![\w.`])(\d[\d,]*(?:\.\d+)?)\s?(?:ms|s|x|%|tokens/s|requests/s|GB/s)(?![\w/])")


def _readme_results() -> Any:
    """``benchmarks/readme_results.py``, the script that writes the block."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_results", ROOT / "benchmarks" / "readme_results.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _readme_parts() -> tuple[str, str]:
    """(the results block, the prose around it less code: fenced blocks and inline code)."""
    BEGIN, END = _readme_results().BEGIN, _readme_results().END  # noqa: N806

    text = (ROOT / "README.md").read_text()
    assert BEGIN in text and END in text, "README.md has no results block: make readme-results"
    start, end = text.index(BEGIN), text.index(END) + len(END)
    prose = text[:start] + text[end:]
    prose = re.sub(r"```.*?```", "", prose, flags=re.S)
    return text[start:end], re.sub(r"`[^`]*`", "", prose)


def test_the_readme_results_block_is_what_results_holds() -> None:
    """``make readme-results`` wrote it from results/ as they are now, FAIL rows and all."""
    script = _readme_results()
    committed, _ = _readme_parts()
    assert committed == script.block(), "README.md's results block is stale: run make readme-results"
    if any(r["result"] == "FAIL" for rows in script.all_rows().values() for r in rows):
        assert "| FAIL |" in committed and "FAIL rows of" in committed


def test_the_readme_prose_quotes_only_figures_the_block_holds() -> None:
    block, prose = _readme_parts()
    numbers = set(re.findall(r"\d[\d,]*(?:\.\d+)?", block))
    stray = [m.group(0) for m in README_FIGURE.finditer(prose) if m.group(1) not in numbers]
    assert not stray, f"README.md quotes figures outside its results block (put them there, or leave them out): {stray}"
