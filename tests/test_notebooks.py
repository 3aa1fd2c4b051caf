"""Every notebook in notebooks/ runs top to bottom, in quick mode, without an error.

Each is executed from an in-memory copy (the committed file and its outputs stay as
they are) by a fresh "python3" kernel that is this virtual environment's Python, with
``LABSERVER_QUICK=1`` so that it finishes in about a minute on two cores. The kernel's
own warnings do not matter here; a cell that raises does.
"""

from __future__ import annotations

import doctest
import os
import re
import sys
import time
from pathlib import Path

import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # quick cells take seconds; this only stops a hung one
DEF = re.compile(r"^\s*(async\s+)?def\s", re.MULTILINE)
QUICK_BUDGET_S = 90  # what a notebook should take in quick mode on 2 cores (reported, not enforced)


def kernel_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # "python" = this venv's
    env["LABSERVER_QUICK"] = "1"
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"  # inline PNGs, never a GUI window
    env.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads at run time; make sure of it
    return env


def test_there_are_notebooks() -> None:
    assert len(NOTEBOOKS) >= 6, f"expected the six walkthroughs in {ROOT / 'notebooks'}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path) -> None:
    before = path.read_bytes()
    nb = nbformat.reads(before.decode("utf-8"), as_version=4)
    params = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1, f"{path.name}: expected one cell tagged 'parameters'"
    assert not any(c.cell_type == "code" and DEF.search(c.source) for c in nb.cells), \
        f"{path.name}: notebooks import reusable code from labserver, they do not define it"
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", allow_errors=False, record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},  # run from notebooks/, as Jupyter would
    )
    started = time.perf_counter()
    client.execute(env=kernel_env())  # raises CellExecutionError naming the cell on any error
    took_s = time.perf_counter() - started
    print(f"{path.name}: {took_s:.1f} s in quick mode (budget {QUICK_BUDGET_S} s on 2 cores)")
    assert path.read_bytes() == before, "executing must not touch the committed notebook"


def test_lab_doctests() -> None:
    """labserver.lab serves the notebooks (with what it re-exports); their docstring examples are checked here."""
    from labserver import lab
    from labserver.experiments import modeltime, simulated
    from labserver.lab import claims
    from labserver.load import prompts

    for module in (lab, claims, modeltime, simulated, prompts):
        assert doctest.testmod(module).failed == 0, module.__name__


def outputs_text(nb: nbformat.NotebookNode) -> list[str]:
    """Every line a committed notebook printed (streams and plain-text results)."""
    lines = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text = out.get("text") or out.get("data", {}).get("text/plain", "")
            lines += ("".join(text) if isinstance(text, list) else text).splitlines()
    return lines


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_states_its_claims_against_its_numbers(path: Path) -> None:
    """Each lesson checks its words with lab.claim, and the committed run shows every verdict with its reason.

    A claim that did not hold in the committed (full-mode) run must say why it may not; a
    committed notebook is never a quick-mode run.
    """
    nb = nbformat.reads(path.read_text(), as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "lab.claim(" in code, f"{path.name} checks none of its statements with lab.claim"
    lines = outputs_text(nb)
    assert any(line.startswith(("✔ holds here", "✘ DOES NOT HOLD here")) for line in lines), \
        f"{path.name} is committed without its claims' output: execute it in full mode"
    assert not any("[quick mode: small samples]" in line for line in lines), \
        f"{path.name} was committed from a quick-mode run"
    unexplained = [line for line in lines if line.startswith("✘ DOES NOT HOLD here")
                   and not re.search(r"(why it may not|read from this run): \S", line)]
    assert not unexplained, f"{path.name}: claims that failed with no reason given: {unexplained}"


# ---------------------------------------------------------------- the reading of a run is printed by the run
#
# What can be checked mechanically of "a lesson says only what its output shows":
# 1. after the first code cell, a markdown sentence carries no measured-looking figure (a
#    number with a unit of time, rate, ratio, share or memory) and no verdict or comparative
#    word (faster, keeps up, higher, more than, saturated ...), unless it is a question, says
#    what to look for ("Look for ..."), or cites its source (a link). Parameters are written
#    as code (`MAX_BATCH = 32`, `20 ms`), which this rule leaves alone;
# 2. every code cell that measures (serves and loads, simulates, times the model) is read by
#    code before the next markdown cell: a lab.claim, lab.compare or lab.say;
# 3. ratios are claimed with lab.compare (effect size and margin against the run's noise), and
#    no committed claim was flagged for a margin inside its noise;
# 4. every notebook names its kernel.

FIGURE = re.compile(r"(?<![\w.`])\d+(?:[.,]\d+)?\s?(?:ms|s|/s|x|×|%|tokens/s|req/s|items/s|texts/s|requests/s"
                    r"|answers/s|GiB|MiB|MB|GB)(?!\w)")
VERDICT = re.compile(r"\b(faster|slower|sooner|quicker|outperform\w*|beats?|wins?|loses|kept up|keeps up|alike|"
                     r"higher|lower|better|worse|more than|less than|fewer than|twice|half as|saturat\w*|fills?|full)\b",
                     re.IGNORECASE)
MEASURES = re.compile(r"\b(serve_and_load|run_load_sync|run_load|load_rates|simulate|simulate_gen|simulated_serving|"
                      r"time_batches|capacity|simulate_cluster)\(")
READS = re.compile(r"\blab\.(claim|compare|say)\(")


def sentences(markdown: str) -> list[str]:
    text = re.sub(r"`[^`]*`", "`code`", markdown)  # parameters and names, written as code
    text = re.sub(r"\$[^$]*\$", "$math$", text)
    return [s.strip() for s in re.split(r"(?<=[.!?:;])\s+|\n\s*[-*]\s|\n\n", text) if s.strip()]


def static_readings(nb: nbformat.NotebookNode) -> list[str]:
    """Markdown sentences after the first code cell that state a result the run could contradict."""
    found, ran = [], False
    for n, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            ran = True
            continue
        if not ran:
            continue
        for sentence in sentences(cell.source):
            if sentence.endswith("?") or sentence.lower().startswith("look for") or "](" in sentence:
                continue
            if FIGURE.search(sentence) or VERDICT.search(sentence):
                found.append(f"[{n}] {sentence[:120]}")
    return found


def unread_runs(nb: nbformat.NotebookNode) -> list[int]:
    """Code cells that measure with no lab.claim / compare / say before the next markdown cell."""
    unread, pending = [], None
    for n, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            unread += [] if pending is None else [pending]
            pending = None
            continue
        if MEASURES.search(cell.source) and pending is None:
            pending = n
        if READS.search(cell.source):
            pending = None
    return unread + ([] if pending is None else [pending])


READ_FROM_RUN = re.compile(r" — read from this run: .*\d")


def unread_failures(lines: list[str]) -> list[str]:
    """Printed claims that do not hold and say why only in general, with no figure of their run."""
    return [line for line in lines if line.startswith("✘ DOES NOT HOLD") and not READ_FROM_RUN.search(line)]


def test_a_failing_claim_reads_its_run_and_a_moved_baseline_is_no_finding(capsys: pytest.CaptureFixture) -> None:
    from labserver import lab
    from labserver.lab import claims

    claims._REFERENCES.clear()
    stock = lab.compare("a / b", 1.0, 1.0, at_least=1.5, why_it_may_not="a busy machine")
    read = lab.compare("a / b", 1.0, 1.0, at_least=1.5, why_it_may_not="a busy machine",
                       reading="both batched 1.0 on average: neither rule had anything to batch")
    assert unread_failures([str(stock), str(read)]) == [str(stock)]
    quiet = lab.baseline("server's p50", 60.0)
    assert not quiet.moved and lab.compare("a / b", 3.0, 1.0, at_least=1.5, baseline=quiet).holds
    busy = lab.baseline("server's p50", 3524.0)
    finding = lab.compare("a / b", 3.0, 1.0, at_least=1.5, baseline=busy)
    assert busy.moved and not finding.holds and not unread_failures([str(finding)])
    assert "3.52e+03 here against 60 earlier in this notebook" in str(finding)
    committed = lab.baseline("tokens/s", 30.0, reference=35.9, where="in results/crosscheck/cpu.txt")
    assert not committed.moved and "in results/crosscheck/cpu.txt" in capsys.readouterr().out


def test_the_rules_catch_what_they_are_for() -> None:
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("runs = lab.serve_and_load(...)"),
        nbformat.v4.new_markdown_cell("Continuous keeps up and finishes sooner: 114.9 vs 115.3 s."),
        nbformat.v4.new_markdown_cell("Look for which finishes sooner. Is p99 higher? With `MAX_BATCH = 32`, "
                                      "the window is `1 ms` ([the guide](https://example.org) says 1 ms)."),
        nbformat.v4.new_code_cell("lab.compare('a / b', a, b, at_least=1.3)"),
    ])
    assert static_readings(nb) == ["[1] Continuous keeps up and finishes sooner:", "[1] 114.9 vs 115.3 s."]
    assert unread_runs(nb) == [0]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_reading_of_each_run_is_printed_by_the_run(path: Path) -> None:
    nb = nbformat.reads(path.read_text(), as_version=4)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", f"{path.name} names no python3 kernel"
    assert not static_readings(nb), (f"{path.name}: markdown after a run states results the run could contradict; "
                                     f"print them from the numbers (lab.say / lab.claim): {static_readings(nb)}")
    assert not unread_runs(nb), f"{path.name}: runs in cells {unread_runs(nb)} are not read by lab.claim/compare/say"
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "lab.compare(" in code, f"{path.name} claims no ratio with its margin (lab.compare)"
    flagged = [line for line in outputs_text(nb) if "below this run's noise" in line]
    assert not flagged, f"{path.name}: committed claims whose margin is inside their noise: {flagged}"
    unread = unread_failures(outputs_text(nb))
    assert not unread, f"{path.name}: committed claims that fail with no reading of their own run: {unread}"


# ---------------------------------------------------------------- printed source is the code's source

def test_stale_blocks_finds_source_the_code_no_longer_has() -> None:
    from labserver.lab.source import stale_blocks

    code = ["class A:\n    def rule(self, q):\n        return q[:3]\n"]
    shown = "    def rule(self, q):\n        return q[:3]\n\nsome output\n"
    assert stale_blocks(shown, code) == []  # (two lines: too short to judge)
    assert stale_blocks("class A:\n    def rule(self, q):\n        return q[:3]\n", code) == []
    assert stale_blocks("    class A:\n        def rule(self, q):\n            return q[:3]\n", code) == []  # indented
    assert stale_blocks("class A:\n    def rule(self, q):\n        return q[:4]\n", code) == ["class A:"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_printed_source_is_the_codes_source(path: Path) -> None:
    """Every def/class block a committed notebook printed is still in labserver/, verbatim: else re-execute it.
    Project code is shown one way, ``lab.show_source``."""
    from labserver.lab.source import package_sources, stale_blocks

    nb = nbformat.reads(path.read_text(), as_version=4)
    sources = package_sources()
    stale = [f"cell {n}: {head}" for n, cell in enumerate(nb.cells) if cell.cell_type == "code"
             for out in cell.get("outputs", [])
             for head in stale_blocks("".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", "")),
                                      sources)]
    assert not stale, f"{path.name} shows source the code no longer has (re-execute those cells): {stale}"
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "inspect.getsource" not in code, f"{path.name}: show project code with lab.show_source"
