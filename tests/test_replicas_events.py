"""The ingress mirrors a replica's events into its own sequence: tokens, then log-probabilities, in order.

No Ray here: the replica's events are replayed through a stand-in handle (``fakes.ReplayHandle``), so
what crosses (``engine.output.Made`` from the replica, ``RemoteEngine`` at the ingress) is checked
alone; ``test_replicas.py`` runs the real deployment.
"""

from __future__ import annotations

from typing import Any

import pytest

from .fakes import ReplayHandle, generate_alone_served, remote_answer

pytest.importorskip("ray")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")  # Ray's own


def test_logprobs_cross_from_a_replica_to_the_ingress_in_order() -> None:
    """A replica's events carry each token's log-probability (and echo's prompt ones) to the ingress's sequence."""
    from labserver.engine import FinishReason
    from labserver.engine.output import Done, Made, Placed
    from labserver.models import Logprob, Sampling, load_model

    model = load_model("gpt2-tiny-random", device="cpu")
    scoring = Sampling(logprobs=2, prompt_logprobs=2)
    made = generate_alone_served(model, "one two three", 5, scoring)  # what a replica's engine made
    first = Made.since(made, 0)
    assert first.prefill_ms is not None and first.prompt_logprobs == made.prompt_logprobs
    events: list[Any] = [
        Placed("r1"),
        Made(first.tokens[:3], first.logprobs[:3], made.prompt_logprobs, first.prefill_ms),  # type: ignore[index]
        Made.since(made, 3),
        Done(FinishReason.LENGTH)]
    seen = remote_answer(model, ReplayHandle(events), made.prompt_ids, 5, scoring)
    assert seen.tokens == made.tokens and seen.logprobs == made.logprobs and len(seen.logprobs) == 5
    assert seen.prompt_logprobs == made.prompt_logprobs and len(seen.prompt_logprobs) == len(made.prompt_ids) - 1
    assert all(isinstance(e, Logprob) and len(e.top) == 2 for e in seen.logprobs)


def test_the_board_forgets_a_replica_that_stopped_reporting() -> None:
    """Each replica that ever reported was kept forever (a dead or replaced one never reports again)."""
    from labserver.replicas.deploy import Reports

    now = [1000.0]
    board = Reports(clock=lambda: now[0])
    board.put("a", {"running": 1}, [])
    board.put("b", {"running": 2}, [])
    now[0] += 10
    board.put("a", {"running": 0}, [])
    assert list(board.all()) == ["a"] and set(board.reports) == {"a", "b"}  # b: not shown, not yet forgotten
    for replica in range(100):  # replaced, one after another, long after b went quiet
        now[0] += Reports.FORGET_S
        board.put(f"r{replica}", {}, [])
    assert set(board.reports) == {"r98", "r99"}


def test_the_salt_crosses_to_the_replica_and_the_router_keys_on_it() -> None:
    """The ingress's salt goes with the job: the replica shares blocks under it, a router reads it with the prompt."""
    from types import SimpleNamespace

    from labserver.engine.sequence import Request, Seq
    from labserver.replicas.remote import job_of
    from labserver.replicas.routers import route_of

    job = job_of(Seq(1, Request([5, 6, 7], 4, 0.0, tenant="a", cache_salt="tenant:1:a:"), None))
    assert job["cache_salt"] == "tenant:1:a:"
    route = route_of(SimpleNamespace(args=[job]))  # type: ignore[arg-type]
    assert (route.prompt, route.salt) == ("5 6 7", "tenant:1:a:")
    assert route_of(SimpleNamespace(args=[{"prompt": "5 6 7"}])).salt == ""  # type: ignore[arg-type]
