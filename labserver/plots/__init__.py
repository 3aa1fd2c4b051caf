"""Matplotlib pictures of what happened, drawn over ``labserver.analysis`` frames.

- ``requests``: latency CDFs, latency against load, where each request's time went,
  latency over time, the event loop's lag, measured against queueing theory;
- ``batches``: batch sizes, batches over time, and ``overview`` (all on one page);
- ``tokens``: TTFT/TPOT/ITL CDFs, token throughput and TTFT against offered rate,
  the step Gantt (one lane per sequence's stay, preemptions marked), ``generation_overview``;
- ``kv``: KV-cache memory: tokens held and reserved, blocks used/cached/free over time,
  time to first token split into queueing and the rest;
- ``replicas``: requests routed to each replica over time (load skew behind a router);
- ``overload``: goodput against offered load, the queue standing and shedding, tokens per tenant,
  padding against offered load;
- ``common``: what they share (records in, one colour per label, ``ax=None`` in, Axes out).

Every helper takes ``ax=None``, returns the Axes and never changes global matplotlib
state. Nothing here knows of servers or clients.
"""

from __future__ import annotations

from .batches import batch_gantt, batch_size_hist, overview
from .requests import (latency_cdf, latency_over_time, latency_vs_throughput, loop_lag, request_timeline,
                       theory_vs_measured)
from .kv import kv_blocks, kv_tokens, ttft_split
from .overload import goodput_vs_load, padding_vs_load, queue_over_time, tokens_over_time
from .replicas import replica_load
from .tokens import (generation_overview, itl_cdf, step_gantt, token_throughput_vs_rate, tpot_cdf, ttft_cdf,
                     ttft_vs_rate)

__all__ = [
    "batch_gantt",
    "goodput_vs_load",
    "padding_vs_load",
    "queue_over_time",
    "tokens_over_time",
    "batch_size_hist",
    "generation_overview",
    "itl_cdf",
    "kv_blocks",
    "kv_tokens",
    "latency_cdf",
    "latency_over_time",
    "latency_vs_throughput",
    "loop_lag",
    "overview",
    "replica_load",
    "request_timeline",
    "step_gantt",
    "theory_vs_measured",
    "token_throughput_vs_rate",
    "tpot_cdf",
    "ttft_cdf",
    "ttft_split",
    "ttft_vs_rate",
]
