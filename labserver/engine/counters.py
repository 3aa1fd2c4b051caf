"""Counters named once: where they are counted, with their help text; ``/stats`` and ``/metrics`` read them.

An engine counts into a dataclass of fields made by ``count`` (a number that only grows),
``tally`` (numbers by a label: why batches left, how sequences finished) and ``sizes``
(how many times each size was seen: a histogram). The field's name is the name
``/stats`` shows and ``/metrics`` exports (``labserver_<name>``), and its help text travels
with it, so a new counter is one line in one place.

What is not a count (the queue's depth, KV blocks by state) an engine reports as a
``gauge`` beside its counters (``EngineBase.metrics``). Nothing here knows HTTP or
Prometheus: ``labserver.server.metrics`` renders ``Metric`` values in its format.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["Metric", "count", "gauge", "metrics_of", "sizes", "tally"]


@dataclass(frozen=True)
class Metric:
    """One named figure an engine reports."""

    name: str  # /stats key; /metrics name after "labserver_"
    help: str
    kind: str  # "counter" | "gauge" | "sizes" (a histogram over sizes)
    value: Any  # a number, or a dict label -> number (one series per label), or Counter[int] for "sizes"
    label: str | None = None  # the label's name when value is a dict
    peer: str | None = None  # /metrics also exports it under this name: a peer server's (vLLM's), where it has one

    def shown(self) -> Any:
        """The value as /stats shows it (JSON keys are strings; sizes in order)."""
        if self.kind == "sizes":
            return {str(k): v for k, v in sorted(self.value.items())}
        if isinstance(self.value, dict):
            return dict(self.value)
        return self.value


def count(help: str, peer: str | None = None) -> Any:
    """A counter field: a number that only grows (``peer``: the name vLLM exports the same count under)."""
    return field(default=0, metadata={"help": help, "kind": "counter", "peer": peer})


def tally(help: str, label: str) -> Any:
    """Counts by a label (one series per label value)."""
    return field(default_factory=Counter, metadata={"help": help, "kind": "counter", "label": label})


def sizes(help: str) -> Any:
    """How many times each size was seen (a histogram)."""
    return field(default_factory=Counter, metadata={"help": help, "kind": "sizes"})


def gauge(name: str, help: str, value: Any, label: str | None = None) -> Metric:
    """A reading of state now (not a count)."""
    return Metric(name, help, "gauge", value, label)


def metrics_of(counters: Any) -> list[Metric]:
    """Every field of a counters dataclass made by ``count``, ``tally`` or ``sizes``, as a Metric."""
    return [Metric(f.name, f.metadata["help"], f.metadata["kind"], getattr(counters, f.name), f.metadata.get("label"),
                   f.metadata.get("peer")) for f in fields(counters) if "help" in f.metadata]
