"""``GET /metrics``: the server's counters in Prometheus text format.

Counters are read from the runtime when scraped (a custom collector), so the hot
path pays only for the one latency histogram it observes per request. Each app
has its own registry: several servers in one notebook kernel do not collide.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from starlette.responses import Response

from ..engine import BatchEngine, StepEngine
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
        engine = rt.engine
        if engine is None:
            return
        c = engine.counters
        yield _gauge("queue_depth", "Requests waiting in the queue", len(engine.queue))
        for name, value, doc in (  # every engine counts these
            ("items_failed", c.failed, "Items (generation: sequences) the model failed on"),
            ("expired", c.expired, "Requests whose deadline passed while queued (504, never computed)"),
            ("skipped_client_gone", c.skipped_dead + engine.queue.skipped, "Requests dropped unrun: client left"),
            ("rejected_overload", c.rejected_overload, "Requests refused at the door (503)"),
            ("computed_after_deadline", c.computed_after_deadline, "Must stay 0"),
        ):
            yield _counter(name, doc, value)
        reasons = CounterMetricFamily("labserver_dispatch", "Batches (generation: prefills) by reason",
                                      labels=["reason"])
        for reason, n in sorted(c.reasons.items()):
            reasons.add_metric([reason], n)
        yield reasons
        if isinstance(engine, BatchEngine):
            b = engine.counters
            yield _counter("batches", "Batches dispatched to the model", b.batches)
            yield _counter("items_computed", "Items run through the model", b.items_computed)
            yield _histogram("batch_size", "Items per batch", b.batch_sizes)
        elif isinstance(engine, StepEngine):
            g = engine.counters
            yield _counter("requests_prefilled", "Sequences prefilled", g.requests)
            yield _counter("tokens_generated", "Tokens generated for clients", g.tokens)
            yield _counter("idle_tokens", "Tokens computed for sequences already finished (static batching)",
                           g.idle_tokens)
            yield _counter("decode_steps", "Decode steps run", g.decode_steps)
            yield _counter("left_while_generating", "Sequences dropped mid-generation: client left", g.left_running)
            yield _gauge("running", "Sequences in the running batch", len(engine.running))
            yield _gauge("kv_tokens", "KV-cache tokens held", engine.running.kv_tokens)
            yield _histogram("step_size", "Sequences per decode step", g.step_sizes)
            yield _counter("preemptions", "Sequences preempted for KV blocks (freed, requeued, recomputed)",
                           g.preempted)
            yield _counter("recomputed_tokens", "Tokens prefilled again after a preemption", g.recomputed_tokens)
            yield _counter("prompt_tokens", "Prompt tokens of admitted sequences", g.prompt_tokens)
            yield _counter("prefix_cached_tokens", "Prompt tokens served by the prefix cache", g.cached_tokens)
            blocks = GaugeMetricFamily("labserver_kv_blocks", "KV-cache blocks by state", labels=["state"])
            for state in ("used", "cached", "free"):
                blocks.add_metric([state], getattr(engine.blocks, state))
            yield blocks


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(f"labserver_{name}", doc)
    family.add_metric([], value)
    return family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(f"labserver_{name}", doc)
    family.add_metric([], value)
    return family


def _histogram(name: str, doc: str, counts: Counter[int]) -> HistogramMetricFamily:
    sizes = sorted(counts.items())
    buckets, running = [], 0
    for size, n in sizes:
        running += n
        buckets.append((str(float(size)), running))
    buckets.append(("+Inf", running))
    family = HistogramMetricFamily(f"labserver_{name}", doc)
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
