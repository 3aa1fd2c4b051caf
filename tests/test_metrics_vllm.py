"""``/metrics`` in vLLM's dialect: vLLM 0.32's names, types and labels, with values that are ``/stats``' own.

The reference is what vLLM 0.32 (its CPU build) served here after a run
(``../shared/reference/vllm-0.32-metrics.txt``: every family's HELP and TYPE lines, then
one sample line of each). A dashboard or ``vllm bench`` built for vLLM reads a family by
its name, its type and its labels, so each ``vllm:`` family labserver exports must be one
of those with the same type, its ``_created`` gauge and the same label names; and what it
says must be what ``/stats`` says under labserver's own names.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import labserver
from labserver import wire
from labserver.models import SyntheticGen

REFERENCE = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "vllm-0.32-metrics.txt"
NAME = "synthetic-gen:1+0.5"
# what labserver measures, under vLLM's names (the families a vLLM dashboard plots first)
REQUIRED = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prompt_tokens_cached", "vllm:request_success",
            "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
            "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
            "vllm:request_decode_time_seconds", "vllm:iteration_tokens_total", "vllm:request_prompt_tokens",
            "vllm:request_generation_tokens"}
# vLLM exports these only with a speculative config, which the reference run had none of (anchors.md names them)
SPECULATION = {"vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_drafts"}


def reference() -> tuple[dict[str, str], dict[str, set[str]]]:
    """vLLM's families: TYPE by name (``_created`` gauges included), and each family's label names."""
    types, labels = {}, {}
    for line in REFERENCE.read_text().splitlines():
        if m := re.match(r"# TYPE (\S+) (\S+)$", line):
            types[m.group(1)] = m.group(2)
        elif line.startswith("vllm:"):
            family = next(f for f in text_string_to_metric_families(line + "\n"))
            for s in family.samples:
                base = re.sub(r"(_total|_bucket|_count|_sum)$", "", s.name)
                labels.setdefault(base, set(s.labels) - {"le"})
    return types, labels


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, dict[str, Any]]]:
    """A paged engine with a prefix cache after a few requests, one of them preempted, its /metrics and /stats."""
    with labserver.serve("gen-paged", SyntheticGen(1, 0.5, max_context=256), max_batch_size=4, max_kv_tokens=96,
                         kv_block_tokens=8, max_new_tokens=40, prefix_cache=True) as h:
        shared = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"
        for k in range(6):
            body = {"prompt": f"{shared} {k}", "max_tokens": 12 + k, "ignore_eos": True}
            assert httpx.post(h.url + wire.V1_COMPLETIONS_PATH, json=body, timeout=30).status_code == 200
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(4) as pool:  # together: more than the pool holds (preemptions)
            bodies = [{"prompt": f"w{k} " * 10, "max_tokens": 30, "ignore_eos": True} for k in range(4)]
            for r in pool.map(lambda b: httpx.post(h.url + wire.V1_COMPLETIONS_PATH, json=b, timeout=60), bodies):
                assert r.status_code == 200, r.text
        steps = h.runtime.engine.step_log()  # type: ignore[union-attr]
        yield httpx.get(h.url + "/metrics").text, {**h.stats(), "steps": steps}


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict[str, Any], name: str, suffix: str = "", **labels: str) -> float:
    base = name if name in fams else re.sub(r"_total$", "", name)  # (a counter's family drops _total; a histogram's not)
    for s in fams[base].samples:
        if s.name == base + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    raise KeyError((name, suffix, labels))


def test_every_vllm_family_has_vllms_name_type_created_gauge_and_labels(served: tuple[str, dict[str, Any]]) -> None:
    text, _ = served
    types, labels = reference()
    for name in SPECULATION:
        types.update({f"{name}_total": "counter", f"{name}_created": "gauge"})
        labels[name] = {"engine", "model_name"}
    ours = {m.group(1): m.group(2) for m in re.finditer(r"^# TYPE (vllm:\S+) (\S+)$", text, re.M)}
    assert ours, text[:500]
    for name, kind in ours.items():
        assert types.get(name) == kind, f"{name}: {kind}, vLLM's is {types.get(name)}"
    exported = {re.sub(r"_total$", "", n) if k == "counter" else n for n, k in ours.items()
                if not n.endswith("_created")}
    assert REQUIRED <= exported, REQUIRED - exported
    for name in exported:
        kind = ours.get(name) or ours.get(name + "_total")
        if kind in ("counter", "histogram"):
            assert ours[f"{name}_created"] == "gauge", name  # (prometheus-client's, as vLLM's server shows it)
    for f in families(text).values():
        if f.name.startswith("vllm:"):
            for s in f.samples:
                want = labels[f.name.removesuffix("_created")]
                assert set(s.labels) - {"le"} == want, (s.name, s.labels, want)
                assert s.labels["model_name"] == NAME and s.labels["engine"] == "0"


def test_vllm_names_say_what_stats_says(served: tuple[str, dict[str, Any]]) -> None:
    text, stats = served
    fams = families(text)
    answered = sum(stats["finished"].values())
    assert answered == 10 and stats["preemptions"] > 0 and stats["cached_tokens"] > 0, stats
    assert value(fams, "vllm:generation_tokens", "_total") == stats["tokens_generated"]
    assert value(fams, "vllm:prompt_tokens", "_total") == stats["prompt_tokens"]
    assert value(fams, "vllm:prefix_cache_queries", "_total") == stats["prompt_tokens"]
    assert value(fams, "vllm:prompt_tokens_cached", "_total") == stats["cached_tokens"]
    assert value(fams, "vllm:prefix_cache_hits", "_total") == stats["cached_tokens"]
    assert value(fams, "vllm:num_preemptions", "_total") == stats["preemptions"]
    assert value(fams, "vllm:num_requests_running") == stats["running"] == 0
    assert value(fams, "vllm:num_requests_waiting") == stats["queue_depth"] == 0
    assert value(fams, "vllm:kv_cache_usage_perc") == stats["kv_usage"] == 0
    assert value(fams, "vllm:request_success", "_total", finished_reason="length") == stats["finished"]["length"]
    for word in ("stop", "abort", "error"):  # every word from the start, as vLLM's
        assert value(fams, "vllm:request_success", "_total", finished_reason=word) == 0
    for vllm, ours in (("vllm:time_to_first_token_seconds", "time_to_first_token_s"),
                       ("vllm:e2e_request_latency_seconds", "e2e_latency_s"),
                       ("vllm:request_queue_time_seconds", "queue_time_s"),
                       ("vllm:request_prefill_time_seconds", "prefill_time_s"),
                       ("vllm:request_decode_time_seconds", "decode_time_s"),
                       ("vllm:request_prompt_tokens", "request_prompt_tokens"),
                       ("vllm:request_generation_tokens", "request_generation_tokens"),
                       ("vllm:inter_token_latency_seconds", "inter_token_latency_s"),
                       ("vllm:iteration_tokens_total", "iteration_tokens")):
        assert value(fams, vllm, "_count") == stats[ours]["count"], vllm
        assert value(fams, vllm, "_sum") == pytest.approx(stats[ours]["sum"], abs=1e-5), vllm
        assert value(fams, vllm, "_bucket", le="+Inf") == stats[ours]["count"], vllm
    assert stats["request_generation_tokens"]["sum"] == stats["tokens_generated"]
    assert stats["time_to_first_token_s"]["count"] == answered
    # one gap per token after a sequence's first (no speculation here: one token per call)
    assert stats["inter_token_latency_s"]["count"] == stats["tokens_generated"] - answered
    steps = stats["steps"]  # one per model call, with the tokens it computed
    assert stats["iteration_tokens"]["count"] == len(steps)
    assert stats["iteration_tokens"]["sum"] == sum(s["tokens"] for s in steps) > stats["tokens_generated"] - answered
    decode = value(fams, "vllm:request_decode_time_seconds", "_sum")
    assert 0 < decode < value(fams, "vllm:e2e_request_latency_seconds", "_sum")


def test_the_route_is_behind_the_key() -> None:
    with labserver.serve("gen-continuous", SyntheticGen(0, 0), api_keys=["k1"]) as h:
        assert httpx.get(h.url + "/metrics").status_code == 401
        ok = httpx.get(h.url + "/metrics", headers={"Authorization": "Bearer k1"})
        assert ok.status_code == 200 and 'vllm:num_requests_running{engine="0"' in ok.text


def test_scrape_splits_a_run_into_the_servers_own_phases() -> None:
    """``labserver.load.scrape``: two scrapes of vLLM's names around a run give that run's requests, tokens and the
    mean of each phase, as the server's own /stats counts them (the same code reads vLLM)."""
    from labserver.load.scrape import scrape, server_phases

    with labserver.serve("gen-continuous", SyntheticGen(2, 1), max_batch_size=4) as h:
        httpx.post(h.url + wire.V1_COMPLETIONS_PATH, json={"prompt": "before", "max_tokens": 3}, timeout=30)
        before, stats_before = scrape(h.url), h.stats()
        for k in range(3):
            r = httpx.post(h.url + wire.V1_COMPLETIONS_PATH, json={"prompt": f"x {k}", "max_tokens": 5,
                                                                  "ignore_eos": True}, timeout=30)
            assert r.status_code == 200
        phases, stats = server_phases(before, scrape(h.url)), h.stats()
    assert phases["requests"] == 3 and phases["tokens"] == 15
    e2e = stats["e2e_latency_s"]["sum"] - stats_before["e2e_latency_s"]["sum"]
    assert phases["e2e_ms"] == pytest.approx(1000 * e2e / 3, rel=1e-3)  # (/stats rounds to the microsecond)
    assert phases["decode_ms"] > 0 and phases["queue_ms"] >= 0 and phases["itl_ms"] > 0
    assert phases["queue_ms"] + phases["prefill_ms"] + phases["decode_ms"] == pytest.approx(phases["e2e_ms"], rel=0.05)
