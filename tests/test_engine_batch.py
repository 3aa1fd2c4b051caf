"""The engine without HTTP: poison isolation, splitting, expiry, overload, death, drain."""

from __future__ import annotations

import asyncio
import time

import pytest

from labserver.engine import BatchEngine, Expired, Overloaded, ShuttingDown, WorkerDied
from labserver.engine.modelthread import run_isolating
from labserver.strategies import Limits
from labserver.models import POISON, ModelError, Synthetic, parse_synthetic
from labserver.strategies import STRATEGIES, make_strategy, strategy_names

from .fakes import CrashModel


def engine(name: str, model, **limits) -> Engine:  # type: ignore[no-untyped-def]
    return BatchEngine(make_strategy(name, Limits(**limits)), model)


async def settle(items):  # type: ignore[no-untyped-def]
    return await asyncio.gather(*(i.future for i in items), return_exceptions=True)


@pytest.mark.parametrize("name", strategy_names("encode"))
def test_poison_fails_alone(name: str) -> None:
    model = Synthetic(0, 0)

    async def main() -> list[object]:
        e = engine(name, model, max_batch_size=8, max_wait_ms=5)
        e.start()
        texts = [f"t{i}" for i in range(8)]
        texts[5] = f"bad {POISON} input"
        items = e.submit(texts)
        out = await settle(items)
        await e.stop()
        return out

    out = asyncio.run(main())
    assert isinstance(out[5], ModelError)
    assert all(isinstance(o, dict) for i, o in enumerate(out) if i != 5)


def test_run_isolating_bisects() -> None:
    model = Synthetic(0, 0)
    texts = [f"t{i}" for i in range(64)]
    texts[17] = POISON
    results, calls = run_isolating(model, texts)
    assert [i for i, r in enumerate(results) if isinstance(r, Exception)] == [17]
    assert calls <= 2 * 6 + 1  # ~2 log2(n) + 1, not n


def test_out_of_memory_batch_is_split_and_retried() -> None:
    model = parse_synthetic("synthetic:0+0?oom_above=4")
    results, calls = run_isolating(model, [f"t{i}" for i in range(16)])
    assert all(isinstance(r, dict) for r in results)
    assert calls == 1 + 2 + 4  # 16 -> 2x8 -> 4x4
    one = parse_synthetic("synthetic:0+0?oom_above=0")
    results, _ = run_isolating(one, ["x"])
    assert isinstance(results[0], ModelError)  # a single item that still does not fit gives up


def test_wrong_number_of_outputs_is_a_model_error() -> None:
    results, _ = run_isolating(lambda texts: [], ["a", "b"])
    assert all(isinstance(r, ModelError) for r in results)


@pytest.mark.parametrize("name", strategy_names("encode"))
def test_expired_items_are_never_computed(name: str) -> None:
    model = Synthetic(60, 0)

    async def main() -> tuple[list[object], Engine]:
        e = engine(name, model, max_batch_size=1, timeout_ms=30)
        e.start()
        first = e.submit(["first"])
        second = e.submit(["second"])  # waits behind a 60 ms batch with a 30 ms deadline
        out = await settle(first + second)
        await e.stop()
        return out, e

    out, e = asyncio.run(main())
    assert isinstance(out[1], Expired)
    assert model.items == 1  # only "first" reached the model
    assert e.counters.expired_in_queue == 1
    assert e.counters.computed_after_deadline == 0


@pytest.mark.parametrize("name", strategy_names("encode"))
def test_cancelled_items_are_skipped(name: str) -> None:
    model = Synthetic(30, 0)

    async def main() -> Engine:
        e = engine(name, model, max_batch_size=1)
        e.start()
        first = e.submit(["first"])
        await asyncio.sleep(0)
        gone = e.submit(["client left"])
        gone[0].future.cancel()  # what the server does when the client disconnects
        await settle(first)
        third = e.submit(["third"])
        await settle(third)
        await e.stop()
        return e

    e = asyncio.run(main())
    assert model.items == 2
    assert e.stats()["skipped_client_gone"] == 1


def test_overload_rejects_at_max_queue_all_or_nothing() -> None:
    async def main() -> Engine:
        e = engine("naive", Synthetic(0, 0), max_queue=3)  # not started: nothing drains the queue
        e.accepting = True
        e.submit(["a", "b"])
        with pytest.raises(Overloaded, match="2 of 3"):
            e.submit(["c", "d"])  # would make 4: refused whole
        e.submit(["c"])
        with pytest.raises(Overloaded):
            e.submit(["d"])
        return e

    e = asyncio.run(main())
    assert len(e.queue) == 3
    assert e.counters.rejected_overload == 3


@pytest.mark.parametrize("name", strategy_names("encode"))
def test_worker_death_is_noticed(name: str) -> None:
    async def main() -> tuple[list[object], Engine]:
        e = engine(name, CrashModel(), max_batch_size=1)
        e.start()
        items = e.submit(["ok", "__crash__", "after"])
        out = await settle(items)
        with pytest.raises(WorkerDied):
            e.submit(["later"])
        healthy = e.healthy
        await e.stop()
        return out + [healthy], e

    out, e = asyncio.run(main())
    assert out[0] == {"text": "ok"}
    assert isinstance(out[1], WorkerDied) and isinstance(out[2], WorkerDied)
    assert out[3] is False
    assert e.dead is not None


@pytest.mark.parametrize("grace_s, expect_computed", [(5.0, 3), (0.0, 1)])
def test_drain_finishes_or_answers_503(grace_s: float, expect_computed: int) -> None:
    model = Synthetic(20, 0)

    async def main() -> list[object]:
        e = engine("thread", model, max_batch_size=1)
        e.start()
        items = e.submit(["a", "b", "c"])
        await asyncio.sleep(0.005)  # the first is computing; drain(0) must not wait for the rest
        await e.drain(grace_s)
        out = await settle(items)
        await e.stop()
        return out

    out = asyncio.run(main())
    assert sum(isinstance(o, dict) for o in out) == expect_computed
    assert all(isinstance(o, (dict, ShuttingDown)) for o in out)


def lag_during_compute(name: str) -> float:
    """Longest gap of a 5 ms ticker on the loop while a 300 ms batch computes."""
    async def main() -> float:
        e = engine(name, Synthetic(300, 0))
        e.start()
        ticks: list[float] = []
        ticking = asyncio.Event()

        async def ticker(n: int) -> None:
            for _ in range(n):
                ticks.append(time.perf_counter())
                ticking.set()
                await asyncio.sleep(0.005)

        await asyncio.create_task(ticker(2))  # the ticker runs before the batch starts
        t = asyncio.create_task(ticker(1000))
        await ticking.wait()
        await settle(e.submit(["x"]))
        t.cancel()
        ticks.append(time.perf_counter())
        await e.stop()
        return max(b - a for a, b in zip(ticks, ticks[1:]))

    return asyncio.run(main())


def test_event_loop_stays_responsive_under_thread_not_naive() -> None:
    assert lag_during_compute("naive") >= 0.25  # the loop froze for the whole batch
    assert lag_during_compute("thread") < 0.15  # it kept ticking (generous: a noisy 2-core box)
