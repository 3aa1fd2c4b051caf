"""Padding: the tokens a batch computes beyond its texts' own.

A batch is padded to its longest text, so it computes ``longest x count`` tokens for
``sum(lengths)`` real ones. Both come from the server's batch log (``ServerHandle.batches()``,
``BatchRecord`` fields ``tokens`` and ``padded_tokens``) or a virtual run's ``SimRun.batches``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pandas as pd

__all__ = ["batch_frame", "padding_share"]


def batch_frame(batches: Iterable[Any], label: Any = None) -> pd.DataFrame:
    """Batches (``BatchRecord`` objects or the batch log's dicts) as the frame ``plots.batch_gantt`` draws:
    ``start_s`` and ``end_s`` from the first batch's start, ``size``, ``tokens``, ``padded_tokens``,
    ``padding`` (the share of computed tokens that were padding), ``reason`` and ``label``."""
    rows = [b if isinstance(b, dict) else vars(b) for b in batches]
    frame = pd.DataFrame(rows, columns=["dispatched_s", "compute_ms", "size", "tokens", "padded_tokens", "reason"])
    t0 = frame["dispatched_s"].min() if len(frame) else 0.0
    frame["start_s"] = frame["dispatched_s"] - t0
    frame["end_s"] = frame["start_s"] + frame["compute_ms"] / 1000
    padded = frame["padded_tokens"].where(frame["padded_tokens"] > 0)
    frame["padding"] = ((frame["padded_tokens"] - frame["tokens"]) / padded).fillna(0.0)
    frame["label"] = label
    return frame


def padding_share(batches: Iterable[Any]) -> float:
    """(padded - real) / padded over all the batches: the share of the model's work spent on padding."""
    frame = batch_frame(batches)
    padded = float(frame["padded_tokens"].sum())
    return (padded - float(frame["tokens"].sum())) / padded if padded else 0.0
