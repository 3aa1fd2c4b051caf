"""``GET /metrics``: the server's counters in Prometheus text format.

Counters are read from the runtime when scraped (a custom collector), so the hot
path pays only for the one latency histogram it observes per request. Each app
has its own registry: several servers in one notebook kernel do not collide.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from starlette.responses import Response

if TYPE_CHECKING:
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
        depth = GaugeMetricFamily("labserver_queue_depth", "Items waiting in the queue")
        depth.add_metric([], len(engine.queue))
        yield depth
        for name, value, doc in (
            ("batches", c.batches, "Batches dispatched to the model"),
            ("items_computed", c.items_computed, "Items run through the model"),
            ("items_failed", c.items_failed, "Items the model failed on"),
            ("expired", c.expired, "Items whose deadline passed while queued (504, never computed)"),
            ("skipped_client_gone", c.skipped_dead + engine.queue.skipped, "Items dropped unrun: client left"),
            ("rejected_overload", c.rejected_overload, "Items refused at the door (503)"),
        ):
            counter = CounterMetricFamily(f"labserver_{name}", doc)
            counter.add_metric([], value)
            yield counter
        gen = getattr(engine, "gen", None)
        if gen is not None:  # a generation engine
            for name, value, doc in (
                ("tokens_generated", gen.tokens, "Tokens generated for clients"),
                ("idle_tokens", gen.idle_tokens, "Tokens computed for sequences already finished (static batching)"),
                ("decode_steps", gen.decode_steps, "Decode steps run"),
                ("left_while_generating", gen.left_running, "Sequences dropped mid-generation: client left"),
            ):
                counter = CounterMetricFamily(f"labserver_{name}", doc)
                counter.add_metric([], value)
                yield counter
            for name, value, doc in (("running", len(engine.running), "Sequences in the running batch"),
                                     ("kv_tokens", engine.running.kv_tokens, "KV-cache tokens held")):
                gauge = GaugeMetricFamily(f"labserver_{name}", doc)
                gauge.add_metric([], value)
                yield gauge
        reasons = CounterMetricFamily("labserver_dispatch", "Batches by dispatch reason", labels=["reason"])
        for reason, n in sorted(c.reasons.items()):
            reasons.add_metric([reason], n)
        yield reasons
        sizes = sorted(c.batch_sizes.items())
        buckets, running = [], 0
        for size, n in sizes:
            running += n
            buckets.append((str(float(size)), running))
        buckets.append(("+Inf", running))
        hist = HistogramMetricFamily("labserver_batch_size", "Items per batch")
        hist.add_metric([], buckets, sum_value=sum(s * n for s, n in sizes))
        yield hist


def attach_metrics(rt: Runtime) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_RuntimeCollector(rt))  # type: ignore[arg-type]
    latency = Histogram("labserver_request_seconds", "Server time of successful requests",
                        registry=registry, buckets=_LATENCY_BUCKETS_S)
    rt.latency_observer = latency.observe
    return registry


def metrics_response(rt: Runtime) -> Response:
    return Response(generate_latest(rt.registry), media_type=CONTENT_TYPE_LATEST)
