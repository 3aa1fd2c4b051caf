"""Counters named once: where they are counted, with their help text; ``/stats`` and ``/metrics`` read them.

An engine counts into a dataclass of fields made by ``count`` (a number that only grows),
``tally`` (numbers by a label: why batches left, how sequences finished), ``sizes``
(how many times each size was seen: a histogram) and ``histogram`` (values in fixed
buckets: latencies, tokens per request). The field's name is the name ``/stats`` shows
and ``/metrics`` exports (``labserver:<name>``), and its help text travels with it, so a
new counter is one line in one place. A field may also name its ``peer``: the name vLLM
exports the same figure under, which ``/metrics`` uses too (vLLM's dashboards read it).

What is not a count (the queue's depth, KV blocks by state) an engine reports as a
``gauge`` beside its counters (``EngineBase.metrics``). Nothing here knows HTTP or
Prometheus: ``labserver.server.metrics`` renders ``Metric`` values in its format.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["Histogram", "Metric", "count", "gauge", "histogram", "metrics_of", "sizes", "tally"]


@dataclass(frozen=True)
class Metric:
    """One named figure an engine reports."""

    name: str  # /stats key; /metrics name after "labserver:"
    help: str
    kind: str  # "counter" | "gauge" | "sizes" (a histogram over sizes) | "histogram" (fixed buckets)
    value: Any  # a number, or a dict label -> number (one series per label), Counter[int] for "sizes", a Histogram
    label: str | None = None  # the label's name when value is a dict
    peer: str | tuple[str, ...] | None = None  # /metrics also exports it under this name (or these): a peer
    #   server's (vLLM's), where it has one

    @property
    def peers(self) -> tuple[str, ...]:
        return (self.peer,) if isinstance(self.peer, str) else tuple(self.peer or ())

    def shown(self) -> Any:
        """The value as /stats shows it (JSON keys are strings; sizes in order)."""
        if self.kind == "sizes":
            return {str(k): v for k, v in sorted(self.value.items())}
        if self.kind == "histogram":
            return self.value.shown()
        if isinstance(self.value, dict):
            return dict(self.value)
        return self.value


def count(help: str, peer: str | tuple[str, ...] | None = None) -> Any:
    """A counter field: a number that only grows (``peer``: the name vLLM exports the same count under)."""
    return field(default=0, metadata={"help": help, "kind": "counter", "peer": peer})


def tally(help: str, label: str, peer: str | None = None) -> Any:
    """Counts by a label (one series per label value)."""
    return field(default_factory=Counter, metadata={"help": help, "kind": "counter", "label": label, "peer": peer})


def sizes(help: str) -> Any:
    """How many times each size was seen (a histogram)."""
    return field(default_factory=Counter, metadata={"help": help, "kind": "sizes"})


def histogram(help: str, bounds: tuple[float, ...], peer: str | None = None) -> Any:
    """Values counted in fixed buckets (``bounds``: each bucket's upper edge, as Prometheus' ``le``)."""
    return field(default_factory=lambda: Histogram(bounds), metadata={"help": help, "kind": "histogram", "peer": peer})


class Histogram:
    """How many values fell at or under each bound, their count and sum (Prometheus' histogram, kept by hand)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(bounds) + 1)  # per bucket, the last one past every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, values at or under it) for every bound, then (inf, all)."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out

    def shown(self) -> dict[str, Any]:
        """/stats' view: count, sum and the cumulative count at each bound that has one (as Prometheus' ``le``)."""
        return {"count": self.count, "sum": round(self.sum, 6),
                "le": {f"{b:g}": n for b, n in self.cumulative() if n and b != float("inf")}}

    def __getstate__(self) -> tuple[Any, ...]:  # (it travels from replicas to the ingress)
        return self.bounds, self.counts, self.sum

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.bounds, self.counts, self.sum = state


def gauge(name: str, help: str, value: Any, label: str | None = None, peer: str | None = None) -> Metric:
    """A reading of state now (not a count); ``peer``: vLLM's name for the same reading."""
    return Metric(name, help, "gauge", value, label, peer)


def metrics_of(counters: Any) -> list[Metric]:
    """Every field of a counters dataclass made by ``count``, ``tally`` or ``sizes``, as a Metric."""
    return [Metric(f.name, f.metadata["help"], f.metadata["kind"], getattr(counters, f.name), f.metadata.get("label"),
                   f.metadata.get("peer")) for f in fields(counters) if "help" in f.metadata]
