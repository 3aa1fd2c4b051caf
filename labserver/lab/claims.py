"""Claims: sentences a notebook states about its own numbers, checked against them and printed.

``claim`` (any check), ``compare`` (a ratio, with its effect size and margin against the run's
noise), ``saturated`` (whether a throughput can be compared at all), ``versus`` and ``say`` (a
reading of a run written by code from its numbers), ``spread`` (a run's own noise),
``baseline`` (whether the machine a comparison ran on was the machine its reference ran on).

A claim that does not hold says why in the run's own numbers (``reading=``: its line ends
``— read from this run: ...``), not only what could in general make it fail.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .mode import quick_mode

__all__ = ["NOISE", "Baseline", "Claim", "baseline", "claim", "compare", "pct", "saturated", "say", "spread",
           "versus"]




@dataclass
class Claim:
    """One sentence a notebook states about its own numbers, checked against them."""

    statement: str  # what the lesson says, in words
    holds: bool  # whether the numbers just measured bear it out
    evidence: str  # the numbers, as measured
    why_it_may_not: str = ""  # what can make it fail here (small samples, a busy machine, ...)
    reading: str = ""  # why it failed in this run, from this run's numbers

    def __str__(self) -> str:
        if self.holds:
            return f"✔ holds here: {self.statement} ({self.evidence})"
        if self.reading:
            why = f" — read from this run: {self.reading}"
        else:
            why = f" — why it may not: {self.why_it_may_not}" if self.why_it_may_not else ""
        return f"✘ DOES NOT HOLD here: {self.statement} ({self.evidence}){why}"

    def _ipython_display_(self) -> None:
        """Printed once by ``claim``; a cell that ends with it shows nothing more."""


def claim(statement: str, holds: bool, evidence: str, why_it_may_not: str = "", *,
          margin: float | None = None, noise: float | None = None, reading: str = "",
          baseline: Baseline | None = None) -> Claim:
    """State a claim, check it against numbers just measured, and print it with them.

    ``claim("continuous's p99 TTFT is under half of static's", ratio <= 0.5, f"{c:.0f} vs {s:.0f} ms")``
    prints a mark (holds / does not hold here), the statement and its evidence. A notebook's
    markdown then only repeats what such a line (or a printed table) showed, so a re-run with
    other numbers cannot leave its words behind. A claim that does not hold goes to stderr
    (shown in red in Jupyter), with ``why_it_may_not``; in quick mode every claim is marked
    as such, since tiny runs say little. Nothing is raised: the lesson goes on.

    ``margin`` (relative: 0.3 for "at least 1.3x", 0.1 for "within 10 %") and ``noise`` (the
    run's own relative spread, ``spread``) make the claim able to fail honestly: a margin
    smaller than the noise could pass or fail by chance, so such a claim is flagged as not
    holding, whatever the numbers say. ``compare`` fills both in for a ratio.

    ``reading`` is why it failed, read from this run's numbers ("thread's batches were already
    full: 63 of 64 requests rode one of 63"); a failing claim prints it in place of the general
    ``why_it_may_not``. ``baseline`` (from ``baseline``) is the reading the claim's numbers
    rest on: if it moved from its reference (a busier machine), the claim does not pass as a
    finding, and says so with both readings.
    """
    if margin is not None and noise is not None and abs(margin) < noise:
        evidence += f"; its margin {pct(margin)} is below this run's noise {pct(noise)}"
        holds, why_it_may_not = False, "a margin inside the noise cannot tell: claim a larger effect or measure more"
        reading = ""
    if baseline is not None and baseline.moved:
        holds, reading = False, f"{baseline}; a comparison on a moved baseline is not a finding: run it again"
    result = Claim(statement, bool(holds), evidence, why_it_may_not, reading)
    text = str(result) + (" [quick mode: small samples]" if quick_mode() else "")
    print(text, file=sys.stdout if result.holds else sys.stderr)
    return result


def pct(x: float) -> str:
    """A relative figure as the notebooks print it: ``pct(0.3)`` is ``'30 %'``."""
    return f"{abs(x) * 100:.0f} %"


NOISE = 0.05  # the smallest relative difference a claim may rest on when a run measures no spread of its own


def spread(values: Sequence[float]) -> float:
    """The relative spread of repeated measurements of one thing: (max - min) / median, or from
    ten repeats on, (p90 - p10) / median, so that one stray call does not set the noise.

    >>> round(spread([98.0, 100.0, 103.0]), 3)
    0.05
    """
    arr = np.asarray(values, dtype=float)
    arr = arr[np.isfinite(arr)]
    if arr.size < 2 or not np.median(arr):
        return 0.0
    low, high = np.percentile(arr, [10, 90]) if arr.size >= 10 else (arr.min(), arr.max())
    return float((high - low) / np.median(arr))


def compare(what: str, a: float, b: float, *, at_least: float | None = None, at_most: float | None = None,
            within: float | None = None, noise: float = NOISE, unit: str = "", saturated: bool | None = None,
            why_it_may_not: str = "", reading: str = "", baseline: Baseline | None = None) -> Claim:
    """A claim about the ratio ``a / b``, with its effect size and margin in the sentence.

    ``what`` names the ratio ("continuous / static tokens/s, saturated"); exactly one of
    ``at_least`` (a / b >= it), ``at_most`` (a / b <= it) or ``within`` (|a / b - 1| <= it) is
    the claim. Its margin (how far the bound is from 1) must exceed ``noise``, the run's own
    spread (``spread`` of repeats) or ``NOISE``: otherwise the claim is flagged, not made.
    A throughput ratio only means something when both runs were saturated: pass
    ``saturated`` (e.g. ``lab.saturated(...)``) and a False makes the claim fail with that
    reason, since below saturation a server's throughput is what was offered.

    >>> c = compare("x / y", 130.0, 100.0, at_least=1.2)  # doctest: +ELLIPSIS
    ✔ holds here: x / y is at least 1.2x (1.30x: 130 vs 100; margin 20 %, noise 5 %)
    >>> compare("x / y", 103.0, 100.0, at_least=1.02).holds  # doctest: +ELLIPSIS
    False
    """
    bounds = [(at_least, "at least {:g}x"), (at_most, "at most {:g}x"), (within, "within {} of 1")]
    given = [(value, form) for value, form in bounds if value is not None]
    if len(given) != 1:
        raise ValueError("compare takes exactly one of at_least, at_most, within")
    bound, form = given[0]
    ratio = a / b if b else math.inf
    if within is not None:
        holds, margin = abs(ratio - 1.0) <= within, within
    else:
        holds, margin = (ratio >= bound) if at_least is not None else (ratio <= bound), bound - 1.0
    evidence = f"{ratio:.2f}x: {a:.3g} vs {b:.3g}{' ' + unit if unit else ''}"
    statement = f"{what} is {form.format(pct(bound) if within is not None else bound)}"
    if saturated is False:
        evidence += "; not both saturated, so this throughput is what was offered, not a capacity"
        holds, why_it_may_not = False, "compare throughput only where both runs were saturated"
    if abs(margin) >= noise:
        evidence += f"; margin {pct(margin)}, noise {pct(noise)}"
    return claim(statement, holds, evidence, why_it_may_not, margin=margin, noise=noise, reading=reading,
                 baseline=baseline)


def saturated(offered: float, achieved: float, *, backlog: float = 0.0, share: float = 0.9) -> bool:
    """Whether a run was past what its server sustains: it answered under ``share`` of what was
    offered (per second), or left a ``backlog`` (requests still queued or in flight at the end).

    >>> saturated(100.0, 99.0), saturated(100.0, 70.0), saturated(100.0, 99.0, backlog=20)
    (False, True, True)
    """
    return bool(achieved < share * offered or backlog > 0)


def versus(a: float, b: float, *, more: str = "higher", less: str = "lower", noise: float = NOISE) -> str:
    """How ``a`` compares with ``b``, in words a printed reading can use: ``"1.6x higher than"``,
    ``"0.62x (lower than)"``, or ``"about the same as (within 5 %)"`` inside the noise.

    >>> versus(160, 100), versus(62, 100), versus(101, 100)
    ('1.6x higher than', '0.62x, so lower than', 'about the same as (within 5 %)')
    """
    ratio = a / b if b else math.inf
    if abs(ratio - 1.0) < noise:
        return f"about the same as (within {pct(noise)})"
    return f"{ratio:.2g}x {more} than" if ratio > 1 else f"{ratio:.2g}x, so {less} than"


def say(text: str) -> None:
    """Show a paragraph of reading, written by code from the run's numbers, as markdown.

    In Jupyter it renders as the lesson's text; elsewhere it prints. A notebook's reading of a
    run goes through this (or ``claim``), never into a static markdown cell after the run.
    """
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:  # pragma: no cover - IPython comes with the notebook extra
        print(text)
        return
    if get_ipython() is None:
        print(text)
    else:
        display(Markdown(text))




_REFERENCES: dict[str, float] = {}  # baseline name -> its first reading in this kernel


@dataclass(frozen=True)
class Baseline:
    """One reading of a quantity a comparison rests on, beside its reference."""

    name: str  # "labserver's TTFT p50, 1 request/s": the same quantity each time it is read
    value: float
    reference: float  # the first reading in this notebook, or a committed figure
    where: str  # where the reference comes from
    tolerance: float

    @property
    def ratio(self) -> float:
        return self.value / self.reference if self.reference else math.inf

    @property
    def moved(self) -> bool:
        return abs(self.ratio - 1.0) > self.tolerance

    def __str__(self) -> str:
        state = "moved" if self.moved else "held"
        return (f"the baseline {state}: {self.name} read {self.value:.3g} here against {self.reference:.3g} "
                f"{self.where} ({self.ratio:.2f}x, tolerance {pct(self.tolerance)})")


def baseline(name: str, value: float, *, reference: float | None = None, where: str = "",
             tolerance: float = 0.25) -> Baseline:
    """Read a baseline and hold it against its reference: is this still the machine it was?

    A comparison between two servers is only as good as the machine under both. Read the
    same quantity (one server's median at one load) where the notebook first measures it and
    again beside the comparison that rests on it; ``claim(..., baseline=b)`` then refuses to
    pass a finding whose baseline moved by more than ``tolerance``. Without ``reference`` the
    first reading of ``name`` in this kernel is the reference (and holds by definition); with
    it (a committed benchmark's figure), that figure is, and ``where`` says where it is from.

    >>> _REFERENCES.clear()
    >>> b = baseline("x's p50", 60.0)
    the baseline held: x's p50 read 60 here against 60 earlier in this notebook (1.00x, tolerance 25 %)
    >>> baseline("x's p50", 3500.0).moved  # (and says so, on stderr)
    True
    """
    if reference is None:
        reference = _REFERENCES.setdefault(name, value)
        where = where or "earlier in this notebook"
    b = Baseline(name, float(value), float(reference), where or "at its reference", tolerance)
    print(b, file=sys.stderr if b.moved else sys.stdout)
    return b
