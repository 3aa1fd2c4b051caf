"""Soak: offer about twice what a synthetic model can serve, with faults, and count.

A run keeps a server over capacity for a while (Poisson arrivals at ``overload`` x
the computed capacity, 1 % of inputs poisoned, 5 % of clients leaving early), then
counts what happened; the promises it checks, and the figures, are in
``labserver.experiments.soak_result`` (its names are re-exported here).

``soak(url, config)`` runs the load against any labserver URL over HTTP (loopback
only). ``run(config)`` also starts the server, in a child process with a model that
logs when it computed what: the server's memory and thread counts are then its own,
the client does not compete with it for the GIL, and the leavers can be checked.
From the shell, ``python -m labserver.experiments.soak --duration 60`` soaks naive,
per-fetch, deadline, thread and adaptive for 60 s each and prints the table
(``--help`` for the rest); ``pytest -m slow tests/test_soak.py`` runs the same as tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import multiprocessing
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..load.arrivals import Poisson
from ..load.clients import RequestFailed, StreamClient, check_target
from ..models import POISON, Model, parse_synthetic
from .soak_result import Record, SoakConfig, SoakResult, table

__all__ = ["Record", "RecordingModel", "SoakConfig", "SoakResult", "run", "soak", "table"]


# -- the load ----------------------------------------------------------------------------

async def soak(url: str, config: SoakConfig) -> SoakResult:
    """Run warmup and the measured phase against ``url`` (a labserver; loopback only)."""
    _, host, port = check_target(url)
    base = f"http://{host}:{port}"
    rng = random.Random(config.seed)
    tag = f"{config.strategy}-{config.seed}-{time.monotonic_ns():x}"  # texts unique across runs too
    patience_s = 3 * config.timeout_ms / 1000 + 30  # a server that keeps its promise answers far sooner
    client = StreamClient(base + "/", content_type="text/plain; charset=utf-8", timeout_s=patience_s)
    stats = StreamClient(base + "/stats", method="GET", timeout_s=30)
    try:
        warm = await _phase(client, config, config.warmup_s, rng, tag, 0)
        stats_start = await _idle_stats(client, stats)
        records = await _phase(client, config, config.duration_s, rng, tag, len(warm))
        stats_end = await _idle_stats(client, stats)
    finally:
        await client.aclose()
        await stats.aclose()
    return SoakResult(config, records, stats_start, stats_end)


async def _phase(client: StreamClient, cfg: SoakConfig, duration_s: float, rng: random.Random,
                 tag: str, first: int) -> list[Record]:
    times = Poisson(cfg.offered_rps).times(duration_s=duration_s, seed=rng.randrange(2**31))
    t0 = time.monotonic() + 0.05
    records = []
    for k, t in enumerate(times):
        i = first + k
        poisoned = rng.random() < cfg.poison_frac
        leave = rng.uniform(0, cfg.timeout_ms / 2000) if rng.random() < cfg.leave_frac else None
        text = f"soak {tag} #{i}" + (f" {POISON}" if poisoned else "")
        records.append(Record(i, text, poisoned, leave, t0 + float(t)))
    tasks = []
    for r in records:
        delay = r.scheduled_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_one(client, r)))
    await asyncio.gather(*tasks)
    return records


async def _one(client: StreamClient, r: Record) -> None:
    loop = asyncio.get_running_loop()
    rid = f"soak-{r.i}"

    def leave() -> None:  # this client gives up: close the socket while the server still works on it
        if not call.done():
            r.left_s = time.monotonic()
            call.cancel()

    def written() -> None:  # a leaver's patience starts once its request is out: the server has it
        nonlocal timer
        if r.leave_after_s is not None and timer is None:
            timer = loop.call_later(r.leave_after_s, leave)

    timer: asyncio.TimerHandle | None = None
    r.sent_s = time.monotonic()
    call = asyncio.ensure_future(client.request(r.text.encode(), {"x-request-id": rid}, written))
    try:
        answer = await call
    except asyncio.CancelledError:
        if math.isnan(r.left_s):
            raise
        return
    except RequestFailed as e:
        r.error = str(e)
        return
    finally:
        if timer is not None:
            timer.cancel()
    r.done_s = time.monotonic()
    r.status = answer.status
    r.rid_ok = answer.headers.get("x-request-id") == rid
    r.server_ms = float(answer.headers.get("x-server-ms", "nan"))


async def _idle_stats(client: StreamClient, stats: StreamClient, timeout_s: float = 30.0) -> dict[str, Any]:
    """/stats once nothing is queued or computing (a bounded poll: there is no idle event)."""
    client.drop_idle()  # no kept-alive sockets from the load: they are not part of the server's state
    end_s = time.monotonic() + timeout_s
    while True:
        answer = await stats.request()
        doc = json.loads(answer.body)
        if answer.status == 200 and not doc.get("queue_depth") and not doc.get("computing"):
            stats.drop_idle()
            return doc
        if time.monotonic() > end_s:
            raise TimeoutError(f"server not idle after {timeout_s} s: {doc}")
        await asyncio.sleep(0.05)


# -- a server to soak, in its own process -------------------------------------------------

class RecordingModel:
    """Wraps a model and notes when each text first reached it (``time.monotonic()``, s).

    CLOCK_MONOTONIC is one clock for every process on the machine, so the parent can
    compare these times with when its clients left.
    """

    def __init__(self, model: Model) -> None:
        self.model = model
        self.name = model.name
        self.max_chars = model.max_chars
        self.started: dict[str, float] = {}

    def __call__(self, texts: list[str]) -> list[Any]:
        now = time.monotonic()
        for t in texts:
            self.started.setdefault(t, now)
        return self.model(texts)

    def check(self, text: str) -> None:
        self.model.check(text)

    def count_tokens(self, texts: list[str]) -> list[int]:
        return self.model.count_tokens(texts)


def _serve_child(conn: Any, strategy: str, spec: str, options: dict[str, Any]) -> None:
    import labserver

    logging.getLogger("labserver").setLevel(logging.ERROR)  # 1 % poison would log a warning each
    model = RecordingModel(parse_synthetic(spec))
    with labserver.serve(strategy, model, **options) as handle:
        conn.send(handle.url)
        conn.recv()  # the parent says stop
    conn.send(model.started)
    conn.close()


def run(config: SoakConfig, start_timeout_s: float = 60.0) -> SoakResult:
    """Start a server for ``config`` in a child process, soak it, stop it, check the leavers."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or state inherited
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_serve_child, name=f"labserver-soak-{config.strategy}",
                        args=(theirs, config.strategy, config.model, config.server_options()))
    child.start()
    theirs.close()
    try:
        if not ours.poll(start_timeout_s):
            raise RuntimeError(f"soak server did not start within {start_timeout_s} s")
        try:
            url = ours.recv()
        except EOFError:
            raise RuntimeError("the soak server process ended before it started; from a script, call "
                               "run() under `if __name__ == '__main__':` (it spawns a process)") from None
        result = asyncio.run(soak(url, config))
        ours.send("stop")
        if not ours.poll(start_timeout_s):
            raise RuntimeError("soak server did not stop")
        result.computed_s = ours.recv()
    finally:
        ours.close()
        child.join(start_timeout_s)
        if child.is_alive():
            child.kill()
            child.join()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labserver.experiments.soak",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="measured seconds per strategy")
    p.add_argument("--strategies", default="naive,per-fetch,deadline,thread,adaptive")
    p.add_argument("--model-ms", default="20+2", help="synthetic cost BASE+PER_ITEM in ms (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--timeout-ms", type=float, default=1000.0)
    p.add_argument("--overload", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    base, per = (float(x) for x in args.model_ms.split("+"))
    results = []
    for name in args.strategies.split(","):
        cfg = SoakConfig(strategy=name, base_ms=base, per_item_ms=per, max_batch_size=args.max_batch,
                         timeout_ms=args.timeout_ms, overload=args.overload, duration_s=args.duration,
                         seed=args.seed)
        print(f"soaking {name} for {args.duration:g} s ...", file=sys.stderr, flush=True)
        results.append(run(cfg))
    print(table(results))
    bad = [(r.config.strategy, p) for r in results for p in r.problems()]
    for name, problem in bad:
        print(f"{name}: {problem}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
