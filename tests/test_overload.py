"""Under overload, who goes first: disciplines, deadline admission, priorities, fair shares, SLOs.

Every rule exact on the virtual clock (labserver.engine.virtual): who is shed, who goes next,
who is refused at the door; then the same rules behind a real server on a loopback socket.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

import labserver
from labserver import wire
from labserver.engine.line import Line
from labserver.engine.gensim import simulate_gen
from labserver.engine.virtual import simulate
from labserver.strategies import Limits, make_strategy
from labserver.strategies.queueing import DISCIPLINES
from labserver.strategies.scheduling import SCHEDULING, Fair, Priority, SLOAware

from .fakes import GateModel


class Req:
    def __init__(self, name: str, t: float = 0.0, priority: int = 0, tenant: str = "") -> None:
        self.name, self.enqueued_s, self.priority, self.tenant, self.finished = name, t, priority, tenant, False

    def __repr__(self) -> str:
        return self.name


def served_order(run) -> list[int]:  # arrival indexes in the order they were answered
    answered = [(o.done_s, k) for k, o in enumerate(run.outcomes) if o.status == 200]
    return [k for _, k in sorted(answered)]


def one_at_a_time(**limits):
    return make_strategy("thread", Limits(max_batch_size=1, **limits))


# ---------------------------------------------------------------- the line


def test_the_line_serves_the_best_class_first_and_arrival_order_within_it() -> None:
    line = Line()
    for req in (Req("a1", priority=1), Req("b0", priority=0), Req("c1", priority=1), Req("d0", priority=0)):
        line.put(req)
    assert [r.name for r in line] == ["b0", "d0", "a1", "c1"]
    assert line.pop(0.0).name == "b0"
    line.putback(Req("e1", priority=1))  # to the head of its own class, not of the line
    assert [line.pop(0.0).name for _ in range(4)] == ["d0", "e1", "a1", "c1"]
    assert line.pop(0.0) is None and len(line) == 0


def test_every_discipline_is_registered_by_name() -> None:
    assert set(DISCIPLINES) == {"fifo", "lifo", "adaptive-lifo", "codel"}
    assert set(SCHEDULING) == {"fcfs", "priority", "fair", "slo"}
    with pytest.raises(ValueError, match="queue discipline"):
        make_strategy("thread", Limits(queue="random"))
    with pytest.raises(ValueError, match="scheduling policy"):
        make_strategy("gen-continuous", Limits(scheduling="lottery"))
    with pytest.raises(ValueError, match="encoder discipline"):
        make_strategy("gen-continuous", Limits(queue="lifo"))
    with pytest.raises(ValueError, match="timeout_ms"):
        Limits(admit="deadline")  # a deadline to keep is needed


# ---------------------------------------------------------------- disciplines on the virtual clock

BURST = [0.0] * 30  # thirty requests at once, a 10 ms model, one at a time


def test_fifo_serves_a_burst_in_arrival_order_and_lifo_newest_first() -> None:
    fifo = simulate(one_at_a_time(), BURST, lambda n: 10.0)
    assert served_order(fifo) == list(range(30))
    lifo = simulate(one_at_a_time(queue="lifo"), BURST, lambda n: 10.0)
    assert served_order(lifo) == list(range(29, -1, -1))


def test_adaptive_lifo_is_fifo_until_the_queue_has_stood_an_interval_then_newest_first() -> None:
    run = simulate(one_at_a_time(queue="adaptive-lifo", codel_interval_ms=95.0), BURST, lambda n: 10.0)
    # pops at 0, 10, ..., 90 ms find a queue younger than 95 ms: first come, first served;
    # from 100 ms on it has stood a whole interval: the newest go first
    assert served_order(run) == list(range(10)) + list(range(29, 9, -1))


def test_codel_sheds_whoever_waited_past_the_target_once_the_queue_stands() -> None:
    run = simulate(one_at_a_time(queue="codel", codel_target_ms=5.0, codel_interval_ms=95.0), BURST,
                   lambda n: 10.0)
    frame = run.frame()
    assert served_order(run) == list(range(10))  # before 95 ms nobody is shed, however long they waited
    shed = frame[frame["status"] == 503]
    assert len(shed) == 20 and set(shed["reason"]) == {"codel"}
    assert shed["done_s"].tolist() == pytest.approx([0.1] * 20)  # at once: the first pop once the queue stood


def test_codel_leaves_a_queue_that_keeps_emptying_alone() -> None:
    arrivals = [k * 0.012 for k in range(200)]  # 83/s at a 10 ms model: the queue empties between arrivals
    run = simulate(one_at_a_time(queue="codel", codel_target_ms=1.0), arrivals, lambda n: 10.0)
    assert (run.frame()["status"] == 200).all()


def test_deadline_admission_refuses_at_the_door_what_would_be_late() -> None:
    arrivals = [0.0] + [1.0] * 10  # one to learn the cost (10 ms), then a burst
    strategy = one_at_a_time(timeout_ms=35.0, admit="deadline")
    frame = simulate(strategy, arrivals, lambda n: 10.0).frame()
    burst = frame.iloc[1:]
    # expected answer of the k-th of the burst: k x 10 ms; 10, 20 and 30 ms make 35 ms, 40 does not
    assert burst["status"].tolist() == [200] * 3 + [503] * 7
    assert set(burst.loc[burst["status"] == 503, "reason"]) == {"deadline"}
    assert (burst.loc[burst["status"] == 503, "latency_ms"] == 0).all()  # refused at once
    assert (burst.loc[burst["status"] == 200, "latency_ms"] <= 35.0).all()
    # without it, the same burst waits and times out: 504 at each one's deadline, 35 ms after it came (the
    # fourth was dispatched at 30 ms and answered at 40: its client had its 504 at 35)
    late = simulate(one_at_a_time(timeout_ms=35.0), arrivals, lambda n: 10.0).frame().iloc[1:]
    assert late["status"].tolist() == [200] * 3 + [504] * 7
    assert late.loc[late["status"] == 504, "latency_ms"].tolist() == pytest.approx([35.0] * 7)


def test_deadline_admission_counts_the_batches_a_batching_rule_will_form() -> None:
    cost = lambda n: 8.0 + 2.0 * n  # noqa: E731
    arrivals = [0.0, 0.5, 0.5] + [1.0] * 20  # a batch of one and one of two teach a + b n; then 20 at once
    strategy = make_strategy("thread", Limits(max_batch_size=4, timeout_ms=50.0, admit="deadline"))
    frame = simulate(strategy, arrivals, cost).frame().iloc[3:]
    # the fitted cost of a full batch of 4 is 16 ms: three full batches (48 ms) make 50 ms, a fourth does not
    assert frame["status"].tolist() == [200] * 12 + [503] * 8


def test_a_queue_cap_refuses_at_the_door_on_the_virtual_clock_too() -> None:
    frame = simulate(one_at_a_time(max_queue=5), [k * 0.001 for k in range(10)], lambda n: 10.0).frame()
    # the first is taken at once; five wait; four find the line full
    assert (frame["status"] == 503).sum() == 4 and set(frame.loc[frame["status"] == 503, "reason"]) == {"queue-full"}


def test_priority_classes_go_first_on_the_encoder_queue() -> None:
    classes = [1] * 5 + [0] * 5
    run = simulate(one_at_a_time(), [0.0] * 10, lambda n: 10.0, classes=classes)
    assert served_order(run) == [5, 6, 7, 8, 9, 0, 1, 2, 3, 4]


# ---------------------------------------------------------------- generation on the virtual clock


def gen(name: str, **limits):
    return make_strategy(name, Limits(**{"max_batch_size": 2, "max_kv_tokens": 4096, **limits}))


def test_a_high_priority_arrival_displaces_a_low_one_and_no_token_is_lost_or_repeated() -> None:
    requests = [(0.0, 16, 40, 0, 1), (0.0, 16, 40, 0, 1), (0.1, 16, 10, 0, 0)]  # two batch streams, one interactive
    run = simulate_gen(gen("gen-continuous", scheduling="priority"), requests)
    _, seqs = run.frames()
    interactive = seqs.iloc[2]
    assert run.stats["preempted_for_priority"] == 1
    assert interactive["queue_ms"] <= 10.0 + 1e-6  # joined at the next step boundary (steps are 10 ms)
    assert (seqs["tokens"] == [40, 40, 10]).all()  # everyone answered in full
    # the displaced stream's tokens are those of a run where nobody displaced it
    alone = simulate_gen(gen("gen-continuous", scheduling="fcfs"), requests)
    assert [s.tokens for s in run.seqs[:2]] == [s.tokens for s in alone.seqs[:2]]
    assert alone.stats["preempted_for_priority"] == 0
    assert alone.frames()[1].iloc[2]["queue_ms"] > interactive["queue_ms"] + 100  # without it: waits for a lane


def test_fcfs_orders_by_class_but_never_displaces() -> None:
    requests = [(0.0, 16, 40, 0, 1), (0.0, 16, 60, 0, 1), (0.1, 16, 10, 0, 0), (0.1, 16, 10, 0, 1)]
    run = simulate_gen(gen("gen-continuous"), requests)
    _, seqs = run.frames()
    assert seqs.iloc[2]["queue_ms"] < seqs.iloc[3]["queue_ms"]  # the interactive one got the first free lane


def light_share(scheduling: str) -> float:
    """The light tenant's share of the tokens answered until its last request was (both had work waiting)."""
    heavy = [(k * 0.001, 16, 20, 0, 0, "heavy") for k in range(200)]  # ten times the requests...
    light = [(k * 0.01, 16, 20, 0, 0, "light") for k in range(20)]  # ...of this one, over the same 0.2 s
    run = simulate_gen(gen("gen-continuous", max_batch_size=4, scheduling=scheduling), heavy + light)
    end = max(s.finished_s for s in run.seqs if s.tenant == "light")
    tokens = {t: sum(len(s.tokens) for s in run.seqs if s.tenant == t and s.finished_s <= end)
              for t in ("heavy", "light")}
    return tokens["light"] / (tokens["light"] + tokens["heavy"])


def test_fair_shares_give_a_light_tenant_half_the_tokens_while_both_wait() -> None:
    assert light_share("fair") >= 0.45
    assert light_share("fcfs") <= 0.15  # first come, first served: about its share of the requests


def test_fair_gives_no_credit_for_time_away() -> None:
    rule = Fair(Limits())
    rule.arrange([Req("a1", tenant="a")], [], 0.0)
    rule.served(Req("a1", tenant="a"), 0, 100)  # a was served 200 units while b had nothing waiting
    order = rule.arrange([Req("a2", tenant="a"), Req("b1", tenant="b")], [], 0.0)
    assert rule.counter["b"] == rule.counter["a"] == 200  # b comes back at a's level, not at 0...
    assert [r.name for r in order] == ["a2", "b1"]  # ...so it is not served 200 units in a row: a tie, arrival order
    rule.served(order[0], 16, 0)
    assert rule.arrange([Req("a3", tenant="a"), Req("b1", tenant="b")], [], 0.0)[0].name == "b1"


def test_fair_forgets_idle_tenants_and_keeps_the_same_order() -> None:
    """100,000 one-request tenants (a client choosing a new x-tenant each time) leave the counters as few as the
    tenants that still matter; and forgetting changes no order while some tenant stays active (the floor only
    rises then): a tenant back from idle starts at the floor either way."""
    import random

    class Remembers(Fair):
        def _forget(self, active: set[str], floor: float) -> None:
            pass

    rule = Fair(Limits())
    for k in range(100_000):  # each step serves both (a batch): heavy's counter, the floor, rises
        for r in rule.arrange([Req(f"r{k}", tenant=f"t{k}"), Req("heavy", tenant="heavy")], [], 0.0):
            rule.served(r, 16, 1)
    assert len(rule.counter) < 100
    class Capped(Fair):
        max_idle_tenants = 500

    starved = Capped(Limits())  # here heavy is never served: the floor stays, the newcomers' counters stay above it
    for k in range(3000):
        starved.served(starved.arrange([Req(f"r{k}", tenant=f"t{k}"), Req("heavy", tenant="heavy")], [], 0.0)[0],
                       16, 1)
    assert len(starved.counter) <= 2 * Capped.max_idle_tenants + 66
    forgets, remembers, draw = Fair(Limits()), Remembers(Limits()), random.Random(0)
    for k in range(3000):  # tenants that come and go, some for good, some back after a while; one always waits
        waiting = [Req(f"r{k}-{j}", tenant=f"t{draw.randrange(200) if draw.random() < 0.5 else k}")
                   for j in range(draw.randrange(1, 4))] + [Req(f"h{k}", tenant="heavy")]
        a, b = forgets.arrange(list(waiting), [], 0.0), remembers.arrange(list(waiting), [], 0.0)
        assert [r.name for r in a] == [r.name for r in b]
        tokens = draw.randrange(1, 32)
        forgets.served(a[0], tokens, 1)
        remembers.served(b[0], tokens, 1)
    assert len(forgets.counter) < len(remembers.counter)


def test_priority_displaces_the_lowest_class_newest_first() -> None:
    rule = Priority(Limits())
    running = [Req("old2", priority=2), Req("one", priority=1), Req("new2", priority=2)]
    assert rule.displace(Req("x", priority=0), running).name == "new2"
    assert rule.displace(Req("y", priority=2), running) is None  # nobody below its class


def test_slo_serves_the_earliest_deadline_that_can_still_be_met_first() -> None:
    rule = SLOAware(Limits(ttft_targets_ms={0: 100.0, 1: 1000.0}))
    batch, urgent, missed = Req("batch", t=0.0, priority=1), Req("urgent", t=0.5, priority=0), \
        Req("missed", t=0.0, priority=0)
    assert [r.name for r in rule.arrange([batch, missed, urgent], [], now=0.55)] == ["urgent", "batch", "missed"]


def test_slo_admits_no_one_whose_step_would_break_the_tightest_tpot_target() -> None:
    rule = SLOAware(Limits(tpot_targets_ms={0: 35.0}))
    assert rule.fits(Req("a", priority=0), [Req("r")] * 50, [])  # nothing measured yet: no grounds to refuse
    for batch, ms in ((1, 12.0), (2, 14.0), (4, 18.0), (8, 26.0)):  # 10 ms + 2 ms a sequence
        rule.observe_step(batch, ms)
    assert rule.step_ms(12) == pytest.approx(34.0)
    assert rule.fits(Req("a", priority=0), [Req(f"r{k}", priority=0) for k in range(11)], [])  # 12: 34 ms
    assert not rule.fits(Req("a", priority=0), [Req(f"r{k}", priority=0) for k in range(12)], [])  # 13: 36 ms
    assert rule.fits(Req("b", priority=1), [Req(f"r{k}", priority=1) for k in range(12)], [])  # no target: no cap


# ---------------------------------------------------------------- behind a real server


def wait_until(cond, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    end = time.perf_counter() + timeout_s
    while not cond():
        assert time.perf_counter() < end, "condition not reached"
        time.sleep(0.005)


def post_in_thread(c: httpx.Client, url: str, text: str, out: dict, **headers: str) -> threading.Thread:
    t = threading.Thread(target=lambda: out.__setitem__(text, c.post(url, content=text.encode(), headers=headers)))
    t.start()
    return t


def test_a_full_queue_says_why_in_x_reason(gate: GateModel) -> None:
    with labserver.serve("thread", gate, max_batch_size=1, max_queue=1) as h, httpx.Client() as c:
        out: dict[str, httpx.Response] = {}
        first = post_in_thread(c, h.url + "/", "first", out)
        assert gate.entered.wait(10)
        second = post_in_thread(c, h.url + "/", "second", out)
        wait_until(lambda: h.stats()["queue_depth"] == 1)
        r = c.post(h.url + "/", content=b"third")
        assert r.status_code == 503 and r.headers[wire.HEADER_REASON] == "queue-full"
        gate.gate.set()
        first.join(), second.join()


def test_priority_header_orders_the_queue_and_a_bad_one_is_400(gate: GateModel) -> None:
    with labserver.serve("thread", gate, max_batch_size=1) as h, httpx.Client() as c:
        bad = c.post(h.url + "/", content=b"x", headers={wire.HEADER_PRIORITY: "high"})
        assert bad.status_code == 400 and "x-priority" in bad.json()["error"]["message"]
        out: dict[str, httpx.Response] = {}
        threads = [post_in_thread(c, h.url + "/", "first", out)]
        assert gate.entered.wait(10)
        threads.append(post_in_thread(c, h.url + "/", "low", out, **{wire.HEADER_PRIORITY: "5"}))
        wait_until(lambda: h.stats()["queue_depth"] == 1)
        threads.append(post_in_thread(c, h.url + "/", "high", out, **{wire.HEADER_PRIORITY: "-1"}))
        wait_until(lambda: h.stats()["queue_depth"] == 2)
        gate.gate.set()
        for t in threads:
            t.join()
        assert gate.computed == ["first", "high", "low"]  # the later, higher class went first
        assert all(r.status_code == 200 for r in out.values())


def test_codel_sheds_a_standing_queue_with_503_and_its_reason(gate: GateModel) -> None:
    with labserver.serve("thread", gate, max_batch_size=1, queue="codel", codel_target_ms=20,
                         codel_interval_ms=50) as h, httpx.Client() as c:
        out: dict[str, httpx.Response] = {}
        threads = [post_in_thread(c, h.url + "/", "first", out)]
        assert gate.entered.wait(10)
        threads += [post_in_thread(c, h.url + "/", name, out) for name in ("a", "b")]
        wait_until(lambda: h.stats()["queue_depth"] == 2)
        time.sleep(0.1)  # the condition under test is time itself: the queue stands past the interval
        gate.gate.set()
        for t in threads:
            t.join()
        assert out["first"].status_code == 200
        for name in ("a", "b"):
            assert out[name].status_code == 503 and out[name].headers[wire.HEADER_REASON] == "codel"
            assert out[name].json()["error"]["type"] == "overloaded"
        stats = h.stats()
        assert gate.computed == ["first"] and stats["shed"] == {"codel": 2}
        assert c.post(h.url + "/", content=b"after").status_code == 200  # a queue that empties sheds nobody


def test_deadline_admission_refuses_at_once_what_it_expects_to_be_late() -> None:
    with labserver.serve("thread", "synthetic:50+0", max_batch_size=1, timeout_ms=130,
                         admit="deadline") as h, httpx.Client(timeout=10) as c:
        assert c.post(h.url + "/", content=b"learn the cost").status_code == 200
        out: dict[str, httpx.Response] = {}
        threads = [post_in_thread(c, h.url + "/", f"r{k}", out) for k in range(6)]
        for t in threads:
            t.join()
        refused = [r for r in out.values() if r.status_code == 503]
        assert len(refused) >= 3 and all(r.headers[wire.HEADER_REASON] == "deadline" for r in refused)
        assert all(float(r.elapsed.total_seconds()) < 0.05 for r in refused)  # at once, not after waiting
        assert not [r for r in out.values() if r.status_code == 504]  # none admitted and then late
        assert h.stats()["refused_deadline"] == len(refused)


def test_a_high_priority_request_displaces_a_running_stream_live_and_the_stream_loses_nothing() -> None:
    with labserver.serve("gen-continuous", "synthetic-gen:5+5", max_batch_size=2, scheduling="priority") as h, \
            httpx.Client(timeout=30) as c:
        def generate(prompt: str, n: int, priority: int) -> httpx.Response:
            return c.post(h.url + "/generate", json={"prompt": prompt, "max_new_tokens": n},
                          headers={wire.HEADER_PRIORITY: str(priority), wire.HEADER_TENANT: "t"})

        solo = generate("the long stream one", 150, 1).json()["tokens"]  # what it says when nobody displaces it
        out: dict[str, httpx.Response] = {}
        low = [threading.Thread(target=lambda p=p: out.__setitem__(p, generate(p, 150, 1)))
               for p in ("the long stream one", "the long stream two")]
        for t in low:
            t.start()
        wait_until(lambda: h.stats()["running"] == 2)
        started = time.perf_counter()
        high = generate("an urgent question", 5, 0)
        took_s = time.perf_counter() - started
        for t in low:
            t.join()
        assert high.status_code == 200 and took_s < 0.5  # not after a stream's 150 steps (~0.75 s)
        assert h.stats()["preempted_for_priority"] >= 1
        assert [len(out[p].json()["tokens"]) for p in out] == [150, 150]
        assert out["the long stream one"].json()["tokens"] == solo  # recomputed, nothing lost or repeated
