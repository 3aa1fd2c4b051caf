"""``GET /metrics``: the server's counters in Prometheus text format.

Counters are read from the runtime when scraped (a custom collector), so the hot
path pays only for the one latency histogram it observes per request. What the
engine reports is whatever its ``metrics()`` lists, each under the name ``/stats``
shows (``labserver_<name>``; a counter vLLM also keeps, under vLLM's name as well: ``Metric.peer``), so a
new counter needs no edit here. Each app has its
own registry: several servers in one notebook kernel do not collide.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from starlette.responses import Response

from ..engine.counters import Metric
from .runtime import Runtime

_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _RuntimeCollector:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def collect(self) -> Iterator[Any]:
        rt = self.rt
        up = GaugeMetricFamily("labserver_up", "1 when the model is loaded and the worker alive")
        up.add_metric([], 1.0 if rt.healthy() else 0.0)
        yield up
        responses = CounterMetricFamily("labserver_responses", "Responses sent, by HTTP status", labels=["status"])
        for status, n in sorted(rt.statuses.items()):
            responses.add_metric([str(status)], n)
        yield responses
        if rt.engine is not None:
            for metric in rt.engine.metrics():  # each under the name /stats shows it by (and a peer's, if any)
                for name in (f"labserver_{metric.name}", metric.peer):
                    family = family_of(metric, name) if name else None
                    if family is not None:
                        yield family
            yield from replica_families(rt.engine.by_replica())


def replica_families(by_replica: dict[str, list[Metric]]) -> Iterator[Any]:
    """Behind a router: every replica's metrics as ``labserver_replica_<name>{replica="..."}``."""
    first: dict[str, Metric] = {}
    for metrics in by_replica.values():
        for m in metrics:
            first.setdefault(m.name, m)
    for name, proto in first.items():
        if proto.kind == "sizes":
            continue  # (batch-size histograms stay on each replica's own /stats)
        family_type = CounterMetricFamily if proto.kind == "counter" else GaugeMetricFamily
        keyed = isinstance(proto.value, dict)
        family = family_type(f"labserver_replica_{name}", proto.help,
                             labels=["replica", proto.label or "label"] if keyed else ["replica"])
        for replica, metrics in sorted(by_replica.items()):
            for m in metrics:
                if m.name != name or m.value is None:
                    continue
                if isinstance(m.value, dict):
                    for key, value in sorted(m.value.items()):
                        family.add_metric([replica, str(key)], value)
                elif not keyed:
                    family.add_metric([replica], m.value)
        yield family


def family_of(m: Metric, name: str | None = None) -> Any:
    """One engine metric in Prometheus' types, as ``labserver_<name>`` or ``name`` (None: nothing to export yet)."""
    name = name or f"labserver_{m.name}"
    if m.kind == "sizes":
        return _histogram(name, m.help, m.value)
    family_type = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
    if isinstance(m.value, dict):
        family = family_type(name, m.help, labels=[m.label or "label"])
        for key, value in sorted(m.value.items()):
            family.add_metric([str(key)], value)
        return family
    if m.value is None:
        return None
    family = family_type(name, m.help)
    family.add_metric([], m.value)
    return family


def _histogram(name: str, doc: str, counts: Counter[int]) -> HistogramMetricFamily:
    sizes = sorted(counts.items())
    buckets, running = [], 0
    for size, n in sizes:
        running += n
        buckets.append((str(float(size)), running))
    buckets.append(("+Inf", running))
    family = HistogramMetricFamily(name, doc)
    family.add_metric([], buckets, sum_value=sum(s * n for s, n in sizes))
    return family


def attach_metrics(rt: Runtime) -> CollectorRegistry:
    """Give the runtime its own registry (so several servers in one kernel do not collide)."""
    registry = CollectorRegistry()
    registry.register(_RuntimeCollector(rt))  # type: ignore[arg-type]
    latency = Histogram("labserver_request_seconds", "Server time of successful requests",
                        registry=registry, buckets=_LATENCY_BUCKETS_S)
    rt.latency_observer = latency.observe
    rt.registry = registry
    return registry


def metrics_response(rt: Runtime) -> Response:
    return Response(generate_latest(rt.registry), media_type=CONTENT_TYPE_LATEST)
