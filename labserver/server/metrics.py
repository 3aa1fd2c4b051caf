"""``GET /metrics``: the server's counters in Prometheus text format, in labserver's names and in vLLM's.

Counters are read from the runtime when scraped (a custom collector), so the hot
path pays only for the one latency histogram it observes per request. What the
engine reports is whatever its ``metrics()`` lists, each under the name ``/stats``
shows (``labserver:<name>``), so a new counter needs no edit here. Each app has its
own registry: several servers in one notebook kernel do not collide.

A figure vLLM also keeps (``Metric.peer``) is exported a second time in vLLM 0.32's
dialect (``vllm_families``): its name (``vllm:time_to_first_token_seconds`` ...), its
type with the ``_created`` sample prometheus-client adds, and its labels ``engine`` and
``model_name`` (the id ``/v1/models`` lists), so vLLM's dashboards, ``vllm bench`` and a
Prometheus set up for vLLM scrape labserver unchanged. Behind a router each replica is one
``engine`` (vLLM's data-parallel ranks are labelled so). vLLM's finish reasons are words of
its own: ``server.openai.finish`` translates them, at the edge.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric as Family
from prometheus_client.utils import floatToGoString
from starlette.responses import Response

from ..engine.counters import Metric
from ..engine.ending import FinishReason
from .openai.finish import API_WORDS
from .runtime import Runtime

_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _RuntimeCollector:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def collect(self) -> Iterator[Any]:
        rt = self.rt
        up = GaugeMetricFamily("labserver:up", "1 when the model is loaded and the worker alive")
        up.add_metric([], 1.0 if rt.healthy() else 0.0)
        yield up
        responses = CounterMetricFamily("labserver:responses", "Responses sent, by HTTP status", labels=["status"])
        for status, n in sorted(rt.statuses.items()):
            responses.add_metric([str(status)], n)
        yield responses
        if rt.engine is not None:
            metrics = rt.engine.metrics()
            for metric in metrics:  # each under the name /stats shows it by
                family = family_of(metric)
                if family is not None:
                    yield family
            by_replica = rt.engine.by_replica()
            yield from replica_families(by_replica)
            yield from vllm_families(by_replica or {"0": metrics}, rt.config.model, rt.started_s)


def vllm_families(engines: dict[str, list[Metric]], model_name: str, created_s: float) -> Iterator[Family]:
    """Every metric with a peer, under vLLM's name, one series per engine (a replica behind a router)."""
    families: dict[str, Family] = {}
    for engine, metrics in sorted(engines.items()):
        labels = {"engine": engine, "model_name": model_name}
        for m in metrics:
            for name in m.peers:
                if m.value is None:
                    continue
                kind = "histogram" if m.kind == "histogram" else m.kind
                base = name.removesuffix("_total") if kind == "counter" else name
                family = families.setdefault(base, Family(base, m.help, kind))
                _add_samples(family, m, labels, created_s)
    yield from families.values()


def _add_samples(family: Family, m: Metric, labels: dict[str, str], created_s: float) -> None:
    name = family.name
    if m.kind == "histogram":
        for bound, n in m.value.cumulative():
            family.add_sample(f"{name}_bucket", {**labels, "le": floatToGoString(bound)}, n)
        family.add_sample(f"{name}_count", labels, m.value.count)
        family.add_sample(f"{name}_sum", labels, m.value.sum)
        family.add_sample(f"{name}_created", labels, created_s)
        return
    if isinstance(m.value, dict):  # (vLLM keys request_success by its own words: translated, each from 0)
        words = {w: 0.0 for w in API_WORDS.values() if w is not None}
        for key, value in m.value.items():
            word = API_WORDS[FinishReason(key)]
            if word is not None:
                words[word] += value
        series = [({**labels, "finished_reason": w}, v) for w, v in words.items()]
    else:
        series = [(labels, m.value)]
    for where, value in series:
        if m.kind == "counter":
            family.add_sample(f"{name}_total", where, value)
            family.add_sample(f"{name}_created", where, created_s)
        else:
            family.add_sample(name, where, value)


def replica_families(by_replica: dict[str, list[Metric]]) -> Iterator[Any]:
    """Behind a router: every replica's metrics as ``labserver:replica_<name>{replica="..."}``."""
    first: dict[str, Metric] = {}
    for metrics in by_replica.values():
        for m in metrics:
            first.setdefault(m.name, m)
    for name, proto in first.items():
        if proto.kind in ("sizes", "histogram"):
            continue  # (histograms stay on each replica's own /stats; vLLM's names carry them by engine)
        family_type = CounterMetricFamily if proto.kind == "counter" else GaugeMetricFamily
        keyed = isinstance(proto.value, dict)
        family = family_type(f"labserver:replica_{name}", proto.help,
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
    """One engine metric in Prometheus' types, as ``labserver:<name>`` or ``name`` (None: nothing to export yet)."""
    name = name or f"labserver:{m.name}"
    if m.kind == "sizes":
        return _histogram(name, m.help, m.value)
    if m.kind == "histogram":
        family = HistogramMetricFamily(name, m.help)
        family.add_metric([], [(floatToGoString(b), n) for b, n in m.value.cumulative()], sum_value=m.value.sum)
        return family
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
    latency = Histogram("labserver:request_seconds", "Server time of successful requests",
                        registry=registry, buckets=_LATENCY_BUCKETS_S)
    rt.latency_observer = latency.observe
    rt.registry = registry
    return registry


def metrics_response(rt: Runtime) -> Response:
    return Response(generate_latest(rt.registry), media_type=CONTENT_TYPE_LATEST)
