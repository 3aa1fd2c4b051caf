"""A server's own view, read from its ``/metrics`` in vLLM's names: the same code reads vLLM and labserver.

vLLM times every request it finishes in phases (``vllm:request_queue_time_seconds``, then
prefill to the first token, then decode to the last) and every gap between tokens; labserver
exports the same histograms under the same names (``labserver.server.metrics``). Two scrapes,
one before a run and one after, give what the server saw of that run alone:

    before = scrape(url); ...run the load...; phases = server_phases(before, scrape(url))

``server_phases``: per request answered in between, the mean seconds of each phase, the
mean gap between tokens, and how many requests and tokens it counted. HTTP only, as the
rest of ``labserver.load``: it knows nothing of the server's code.
"""

from __future__ import annotations

import math

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["PHASES", "scrape", "server_phases"]

PHASES = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
          "decode": "vllm:request_decode_time_seconds", "ttft": "vllm:time_to_first_token_seconds",
          "e2e": "vllm:e2e_request_latency_seconds", "itl": "vllm:inter_token_latency_seconds"}


def scrape(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> dict[str, float]:
    """Every ``vllm:`` sample's value by its name, summed over engines and label values (``le`` kept apart)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=timeout_s).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:") and not s.name.endswith("_created"):
                key = s.name + (f"{{le={s.labels['le']}}}" if "le" in s.labels else "")
                out[key] = out.get(key, 0.0) + float(s.value)
    return out


def server_phases(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Between two scrapes: requests answered, tokens made, and the mean of each phase in ms (NaN: none seen)."""
    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    out = {"requests": moved(PHASES["e2e"] + "_count"), "tokens": moved("vllm:generation_tokens_total")}
    for phase, name in PHASES.items():
        n = moved(name + "_count")
        out[f"{phase}_ms"] = 1000 * moved(name + "_sum") / n if n else math.nan
    return out
