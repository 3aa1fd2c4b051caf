"""When a figure can be trusted: one set of rules for tables, plots, claims and warnings.

* A percentile needs samples beyond it: ``enough(q, n)`` holds when at least
  ``TAIL_SAMPLES`` answers lie past the q-th percentile, so a p99 needs 300 answers
  (``MIN_P99_SAMPLES``) and a p90 needs 30. ``trusted(summary)`` blanks every tail
  column of a summary that has too few; tables and plots both go through it.
* A load generator's late sends matter only when they are large beside what the run
  measures: ``late_matters`` flags a run whose mean send lateness is more than
  ``LATE_SHARE`` of its median latency (and over ``LATE_FLOOR_MS``), or whose sends went out more than
  ``RATE_SHORTFALL`` slower than scheduled. A few ms of timer jitter against 15 ms
  or 3 s answers is noise, and said once in a table (``late_p99_ms``), not warned.
"""

from __future__ import annotations

import math
import re

import pandas as pd

__all__ = ["LATE_SHARE", "MIN_P99_SAMPLES", "RATE_SHORTFALL", "TAIL_SAMPLES", "enough", "late_matters",
           "load_seen", "tail_columns", "trusted"]

TAIL_SAMPLES = 3  # answers that must lie beyond a percentile for it to be reported
MIN_P99_SAMPLES = 300  # = TAIL_SAMPLES / 0.01
LATE_SHARE = 0.05  # mean send lateness above this share of the median latency distorts the run
RATE_SHORTFALL = 0.02  # sends this much slower than scheduled: the server saw a gentler load
LATE_FLOOR_MS = 0.5  # a mean lateness under this is timer noise, however fast the answers
_TAIL = re.compile(r"(^|_)p(9\d+)(_|$)")


def _short(sent_rate: float, scheduled_rate: float) -> bool:
    return scheduled_rate > 0 and sent_rate < (1.0 - RATE_SHORTFALL) * scheduled_rate


def load_seen(sent_rate: float, scheduled_rate: float) -> str:
    """What a server saw of a run whose sends were late: less load, or the same load unevenly.

    >>> load_seen(90.0, 100.0)
    'the server saw a gentler load than asked'
    """
    if _short(sent_rate, scheduled_rate):
        return "the server saw a gentler load than asked"
    return "the rate held, so the server saw the load asked, but bunched: sends meant to be spread out went together"


def enough(q: float, n: int) -> bool:
    """Whether ``n`` samples support a q-th percentile (at least 3 samples lie beyond it).

    >>> enough(99, 299), enough(99, 300), enough(90, 30), enough(50, 6)
    (False, True, True, True)
    """
    return n * (1.0 - q / 100.0) >= TAIL_SAMPLES - 1e-9


def tail_columns(columns: list[str] | pd.Index) -> dict[str, float]:
    """The percentile columns at or above p90 and their q: ``p99_ms`` -> 99, ``ttft_p999_ms`` -> 99.9.

    Inter-token latency pools every gap of every answer, so its samples are not the answers:
    ``itl_*`` columns are left out (their count is the tokens').
    """
    out = {}
    for column in columns:
        match = _TAIL.search(str(column))
        if match and not str(column).startswith("itl"):
            digits = match.group(2)
            out[str(column)] = float(digits[:2] + "." + digits[2:]) if len(digits) > 2 else float(digits)
    return out


def trusted(summary: pd.DataFrame, count: str = "n_ok") -> pd.DataFrame:
    """A copy of ``summary`` with each tail percentile blanked (NaN) where too few answers back it."""
    out = summary.copy()
    if count not in out.columns:
        return out
    for column, q in tail_columns(out.columns).items():
        few = out[count].fillna(0).map(lambda n, q=q: not enough(q, int(n)))
        out.loc[few, column] = math.nan
    return out


def late_matters(mean_late_ms: float, p50_latency_ms: float, sent_rate: float = math.nan,
                 scheduled_rate: float = math.nan) -> bool:
    """Whether a run's late sends change what it measured (see the module's rule).

    >>> late_matters(0.4, 15.0), late_matters(2.0, 15.0), late_matters(0.1, 15.0, 90.0, 100.0)
    (False, True, True)
    """
    if _short(sent_rate, scheduled_rate):
        return True
    if not p50_latency_ms > 0:
        return mean_late_ms > 1.0
    return mean_late_ms > max(LATE_SHARE * p50_latency_ms, LATE_FLOOR_MS)
