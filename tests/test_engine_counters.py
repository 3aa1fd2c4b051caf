"""One vocabulary: a counter is named once, where it is counted, and /stats and /metrics show it by that name.

And an engine is found by its strategy's class (``ENGINES``), never by the server asking
``isinstance``: a new strategy or a new counter is one edit.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

import labserver
from labserver.engine import BatchEngine, EngineBase, HFEngine, StepEngine, make_engine
from labserver.engine.counters import count, metrics_of, sizes
from labserver.engine.scheduler import StepCounters
from labserver.models import Synthetic, SyntheticGen
from labserver.server.metrics import family_of
from labserver.strategies import GenContinuous, GenHFContinuous, Limits, Thread, make_strategy

ROOT = Path(__file__).resolve().parents[1]


def engines() -> list[EngineBase]:
    return [BatchEngine(make_strategy("thread"), Synthetic(0, 0)),
            StepEngine(make_strategy("gen-paged", Limits(max_batch_size=4)), SyntheticGen(0, 0)),  # type: ignore[arg-type]
            HFEngine(make_strategy("gen-hf-cb"), SyntheticGen(0, 0))]  # type: ignore[arg-type]


@pytest.mark.parametrize("engine", engines(), ids=lambda e: type(e).__name__)
def test_every_counter_reaches_stats_under_its_own_name(engine: EngineBase) -> None:
    metrics = engine.metrics()
    names = [m.name for m in metrics]
    assert len(names) == len(set(names)), Counter(names).most_common(3)  # no name twice
    assert all(m.help and m.kind in ("counter", "gauge", "sizes", "histogram") for m in metrics)
    counted = {m.name for m in metrics_of(engine.counters)}
    assert counted and counted <= set(engine.stats())  # every counter field, by its field name
    assert {"rejected_overload", "expired_in_queue", "skipped_client_gone", "items_failed"} <= counted


def test_a_new_counter_is_one_line() -> None:
    @dataclass
    class More(StepCounters):
        coffee_breaks: int = count("Breaks the engine took")
        break_lengths: Counter[int] = sizes("How long each break was")

    engine = StepEngine(make_strategy("gen-continuous"), SyntheticGen(0, 0))  # type: ignore[arg-type]
    engine.counters = engine.scheduler.counters = More()
    engine.counters.coffee_breaks += 2
    engine.counters.break_lengths[5] += 1
    stats = engine.stats()
    assert stats["coffee_breaks"] == 2 and stats["break_lengths"] == {"5": 1}
    rendered = {m.name: family_of(m) for m in engine.metrics()}
    assert rendered["coffee_breaks"].name == "labserver:coffee_breaks"
    assert rendered["coffee_breaks"].documentation == "Breaks the engine took"


def test_stats_and_metrics_speak_the_same_names() -> None:
    with labserver.serve("gen-paged", SyntheticGen(0, 0), max_batch_size=4, max_kv_tokens=256) as h:
        for k in range(6):
            r = httpx.post(h.url + "/generate", json={"prompt": f"p {k} q", "max_new_tokens": 5}, timeout=30)
            assert r.status_code == 200
        stats = h.stats()
        text = httpx.get(h.url + "/metrics").text
        engine = h.runtime.engine
        assert engine is not None
        for m in engine.metrics():
            assert m.name in stats, m.name
            if m.value is not None:  # (a counter's samples end in _total, as Prometheus names them)
                exported = f"labserver:{m.name}" + ("_total" if m.kind == "counter" else "")
                assert f"# HELP {exported} {m.help}" in text, m.name
        assert stats["tokens_generated"] == 30 and "labserver:tokens_generated_total 30.0" in text
        assert stats["requests_prefilled"] == 6 and "labserver:requests_prefilled_total 6.0" in text


@pytest.mark.parametrize("strategy, engine", [(Thread, BatchEngine), (GenContinuous, StepEngine),
                                              (GenHFContinuous, HFEngine)])
def test_an_engine_is_found_by_the_strategys_class(strategy: type, engine: type) -> None:
    class Mine(strategy):  # type: ignore[misc, valid-type]  # a user's rule, unregistered
        name = "mine"

    assert type(make_engine(Mine(), SyntheticGen(0, 0))) is engine


def test_nothing_outside_the_engine_room_asks_which_engine_it_has() -> None:
    """The server, launch and experiments ask an engine what it exposes; they never test its class."""
    found = []
    for path in (ROOT / "labserver").rglob("*.py"):
        if path.parent.name == "engine":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"isinstance\([^)]*(Batch|Step|HF|Gen)Engine", line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, found
