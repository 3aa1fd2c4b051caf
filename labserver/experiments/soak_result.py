"""A soak's figures and verdict: what was sent (``SoakConfig``), what each request got
(``Record``), and what the run counts and which promises it broke (``SoakResult``, ``table``).

The promises a server under overload must keep, each checked by ``SoakResult.problems``:

- every request gets exactly one outcome: the server counts one status per request
  sent (499 for a client that left first), every client that stayed got exactly one
  response, and it carried its own request id;
- only poisoned inputs get a model error (500), and every poisoned one that was
  computed gets it;
- overload is refused at the door (503), fast: p99 under 10 % of ``timeout_ms``;
- an accepted request is answered within ``timeout_ms`` by the server's clock, or 504;
- nothing is computed after its deadline (the server's ``computed_after_deadline``)
  or after its client left (the model's own log of when it saw each unique text);
- memory, threads and event-loop tasks are the same after the run as before it.

Nothing here sends a request or starts a server (``labserver.experiments.soak`` does),
so the checker is tested on hand-made results.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..analysis.theory import capacity_rps

__all__ = ["NOTICE_SLACK_MS", "Record", "SoakConfig", "SoakResult", "table"]

NOTICE_SLACK_MS = 50.0  # a server may take one batch plus this long to see a closed socket, ms


@dataclass
class Record:
    i: int
    text: str
    poisoned: bool
    leave_after_s: float | None  # a leaver closes its connection this long after sending
    scheduled_s: float  # time.monotonic() it was due
    sent_s: float = math.nan
    done_s: float = math.nan
    status: int | None = None  # None: no response (it left, or an error)
    left_s: float = math.nan  # when a leaver closed its connection, time.monotonic()
    server_ms: float = math.nan  # x-server-ms
    rid_ok: bool = True  # the response carried this request's own x-request-id
    error: str = ""


@dataclass
class SoakConfig:
    strategy: str = "deadline"
    base_ms: float = 20.0  # synthetic model: BASE ms per call ...
    per_item_ms: float = 2.0  # ... plus PER ms per item
    max_batch_size: int = 8
    max_wait_ms: float = 2.0
    timeout_ms: float = 1000.0  # per-request deadline, and the SLO the 503 speed is judged against
    queue_timeouts: float = 0.5  # max_queue = this many timeout_ms of work at capacity (FIFO: keep it < 1)
    overload: float = 2.0  # offered rate / capacity
    duration_s: float = 60.0  # the measured phase
    warmup_s: float = 2.0  # same load before the "start" snapshot (allocator, pools, threads settle)
    poison_frac: float = 0.01
    leave_frac: float = 0.05  # these clients close the connection after U(0, timeout/2)
    seed: int = 0

    @property
    def model(self) -> str:
        return f"synthetic:{self.base_ms:g}+{self.per_item_ms:g}"

    @property
    def batch_cap(self) -> int:
        return 1 if self.strategy == "naive" else self.max_batch_size  # naive runs one item per call

    @property
    def batch_ms(self) -> float:
        """One full batch of the synthetic model, ms."""
        return self.base_ms + self.batch_cap * self.per_item_ms

    @property
    def capacity_rps(self) -> float:
        """Full batches back to back: what the model alone can do (HTTP costs come on top)."""
        return capacity_rps(self.batch_ms, self.batch_cap)

    @property
    def offered_rps(self) -> float:
        return self.overload * self.capacity_rps

    @property
    def max_queue(self) -> int:
        return max(self.batch_cap, math.ceil(self.capacity_rps * self.timeout_ms / 1000 * self.queue_timeouts))

    def server_options(self) -> dict[str, Any]:
        return {"max_batch_size": self.max_batch_size, "max_wait_ms": self.max_wait_ms,
                "max_queue": self.max_queue, "timeout_ms": self.timeout_ms}


@dataclass
class SoakResult:
    config: SoakConfig
    records: list[Record] = field(repr=False)
    stats_start: dict[str, Any] = field(repr=False)  # /stats after warmup, idle
    stats_end: dict[str, Any] = field(repr=False)  # /stats after the run, idle
    computed_s: Mapping[str, float] | None = field(default=None, repr=False)  # text -> first compute start

    def _by(self, pred: Any) -> list[Record]:
        return [r for r in self.records if pred(r)]

    def _server(self, key: str) -> int:
        return int(self.stats_end.get(key, 0)) - int(self.stats_start.get(key, 0))

    def _server_status(self, code: int) -> int:
        return (int(self.stats_end["statuses"].get(str(code), 0))
                - int(self.stats_start["statuses"].get(str(code), 0)))

    def counts(self) -> dict[str, Any]:
        cfg = self.config
        answered = self._by(lambda r: r.status is not None)
        left = self._by(lambda r: r.status is None and not math.isnan(r.left_s))
        stayed = self._by(lambda r: math.isnan(r.left_s))

        def status(code: int) -> list[Record]:
            return [r for r in answered if r.status == code]

        def lat_ms(rs: list[Record]) -> list[float]:  # from the scheduled send: no coordinated omission
            return sorted((r.done_s - r.scheduled_s) * 1000 for r in rs)

        ok, rejected = status(200), status(503)
        poisoned = self._by(lambda r: r.poisoned)
        server_total = sum(int(v) for v in self.stats_end["statuses"].values()) - sum(
            int(v) for v in self.stats_start["statuses"].values())
        leave_limit_s = (cfg.batch_ms + NOTICE_SLACK_MS) / 1000
        after_left = None
        if self.computed_s is not None:
            after_left = sum(1 for r in left if self.computed_s.get(r.text, -math.inf) > r.left_s + leave_limit_s)
        start, end = self.stats_start["process"], self.stats_end["process"]
        span_s = max(r.done_s for r in answered) - min(r.scheduled_s for r in self.records) if answered else 1.0
        return {
            "strategy": cfg.strategy,
            "model": cfg.model,
            "max_batch_size / max_queue": f"{cfg.batch_cap} / {cfg.max_queue}",
            "timeout_ms": cfg.timeout_ms,
            "capacity_rps (computed)": round(cfg.capacity_rps, 1),
            "offered_rps": round(cfg.offered_rps, 1),
            "requests sent": len(self.records),
            "server outcomes (must = sent)": server_total,
            "200 ok": len(ok),
            "goodput_rps": round(len(ok) / span_s, 1),
            "ok latency p50 / p99 ms": _pair(lat_ms(ok)),
            "503 overloaded": len(rejected),
            "503 latency p50 / p99 ms": _pair(lat_ms(rejected)),
            "504 timeout": len(status(504)),
            "500 model error": len(status(500)),
            "poisoned sent": len(poisoned),
            "500 not poisoned (must be 0)": sum(1 for r in status(500) if not r.poisoned),
            "poisoned answered 200 (must be 0)": sum(1 for r in ok if r.poisoned),
            "other statuses (must be 0)": sum(1 for r in answered if r.status not in (200, 500, 503, 504)),
            "200 over timeout_ms, server clock (must be 0)": sum(
                1 for r in ok if not r.server_ms <= cfg.timeout_ms + 1),
            "slowest answer ms (client)": round(max((r.done_s - r.sent_s for r in answered), default=0) * 1000, 1),
            "stayed without exactly one response (must be 0)": sum(
                1 for r in stayed if r.status is None or not r.rid_ok),
            "clients that left": len(left),
            "server 499 (left while waiting)": self._server_status(499),
            "dropped unrun: client left or timed out (server)": self._server("skipped_client_gone"),
            "computed after client left (must be 0)": "n/a" if after_left is None else after_left,
            "expired in queue (server)": self._server("expired_in_queue"),
            "computed after deadline (server, must be 0)": self._server("computed_after_deadline"),
            "rss_mb start / end": f"{start['rss_mb']:.1f} / {end['rss_mb']:.1f}",
            "threads start / end": f"{start['threads']} / {end['threads']}",
            "tasks start / end": f"{start['tasks']} / {end['tasks']}",
            "client send lag p99 ms": round(_pct(sorted((r.sent_s - r.scheduled_s) * 1000
                                                        for r in self.records), 0.99), 1),
        }

    def problems(self, rss_growth_mb: float = 10.0) -> list[str]:
        """Every promise this run broke, in words; empty when all held."""
        c, cfg = self.counts(), self.config
        out = [f"{k} = {v}" for k, v in c.items() if "must be 0" in k and v not in (0, "n/a")]
        errors = Counter(r.error.split(":")[0] for r in self.records if r.error)
        if errors:
            out.append(f"client errors: {dict(errors)}; first: {next(r.error for r in self.records if r.error)}")
        if c["server outcomes (must = sent)"] != c["requests sent"]:
            out.append(f"server counted {c['server outcomes (must = sent)']} outcomes for "
                       f"{c['requests sent']} requests")
        p99_503 = _pct(sorted((r.done_s - r.scheduled_s) * 1000 for r in self.records if r.status == 503), 0.99)
        if not c["503 overloaded"]:
            out.append(f"no 503 at {cfg.overload:g}x capacity: is max_queue enforced?")
        elif not p99_503 < cfg.timeout_ms / 10:
            out.append(f"503 p99 {p99_503:.1f} ms is not under 10 % of timeout_ms ({cfg.timeout_ms:g})")
        if c["slowest answer ms (client)"] > 3 * cfg.timeout_ms:
            out.append(f"an answer took {c['slowest answer ms (client)']} ms, over 3 x timeout_ms")
        if not c["clients that left"]:
            out.append("no client left while waiting: the disconnect path went untested")
        start, end = self.stats_start["process"], self.stats_end["process"]
        if end["rss_mb"] - start["rss_mb"] > rss_growth_mb:
            out.append(f"rss grew {end['rss_mb'] - start['rss_mb']:.1f} MB (> {rss_growth_mb:g})")
        for key in ("threads", "tasks"):
            if end[key] != start[key]:
                out.append(f"{key} went from {start[key]} to {end[key]}")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {**self.counts(), "config": asdict(self.config), "problems": self.problems()}


def _pct(values: Sequence[float], q: float) -> float:
    return values[min(len(values) - 1, int(len(values) * q))] if values else math.nan


def _pair(values: Sequence[float]) -> str:
    return f"{_pct(values, 0.5):.1f} / {_pct(values, 0.99):.1f}" if values else "-"


def table(results: Sequence[SoakResult]) -> str:
    """A markdown table: one row per figure, one column per run."""
    rows = [r.counts() for r in results]
    keys = list(rows[0])
    lines = ["| | " + " | ".join(str(r["strategy"]) for r in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    lines += [f"| {k} | " + " | ".join(str(r[k]) for r in rows) + " |" for k in keys if k != "strategy"]
    return "\n".join(lines)
