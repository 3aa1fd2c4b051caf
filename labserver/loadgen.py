"""The load generator: send a schedule of requests over HTTP and record each one.

Open loop (the default) sends at the times an arrival process chose in advance,
whatever the server does; closed loop runs N users that each wait for an answer
(and an optional think time) before sending again. Every request is one row in
``LoadResult.records``; ``latency_ms`` runs from the *scheduled* send time, so a
stalled server or a stalled client cannot hide queueing (no coordinated omission),
and ``send_latency_ms`` is what a naive client would report, kept for comparison.

``mode="json"`` with ``texts_per_request=N`` sends each request as a JSON list of N texts
(``{"inputs": [t1, ..., tN]}``), drawn from the payload in order; its ``input_chars`` is
their sum, and ``input_tokens`` is the server's count (``x-input-tokens``) when it sends one.

``mode="generate"`` loads a generative server instead: it posts
``{"prompt", "max_new_tokens", "stream", "ignore_eos"}`` to ``/generate``, reads the
event stream, and records time to first token and each token's arrival, also from
the schedule (``labserver.load.results`` describes the columns).

``api="openai-completions"`` / ``"openai-chat"`` / ``"openai-embeddings"`` speaks the
OpenAI API instead, which labserver's ``/v1`` routes and every LLM server (vLLM, TGI,
SGLang, Ollama, llama.cpp, ``transformers serve``) offer: the same schedule, the same
records, so any of them is measured the same way (``labserver.load.apis``). ``model``
names the model in every request; left out, the server's ``GET /v1/models`` is asked.

``mix`` sends several flows side by side (``labserver.load.mix``): each request is dealt
to a flow by its own seeded draw and carries that flow's ``x-priority`` / ``x-tenant``
headers (and ``"priority"`` in an OpenAI body), optionally its own prompts and output
lengths; the records name its ``flow``, and ``labserver.analysis.summarize_flows`` judges
each flow by its own targets.

Entry points: ``await run_load(url, **options)`` in async code and notebooks,
``run_load_sync(url, **options)`` anywhere else (also inside a running Jupyter
kernel); the options are the fields of ``LoadSpec``. Arrival processes live in
``labserver.load.arrivals``, payloads in ``labserver.load.payloads``, output lengths in
``labserver.load.lengths``, the sending loop in ``labserver.load.worker`` (what it is told,
``Plan``, in ``labserver.load.plan``; its event loop in ``labserver.load.loops``; spawned
processes in ``labserver.load.processes``), the records and their files in ``labserver.load.results``.

This module talks HTTP only (``labserver.load.clients``) and reads the server's
timing headers by name (``labserver.wire``); it can load any URL. By default it
runs in a separate, spawned process so that a model running inline in the caller
(a notebook kernel) cannot stall the client. Scripts that use process mode need the
usual ``if __name__ == "__main__":`` guard, as with any spawned multiprocessing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import pickle
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import pandas as pd

from . import wire
from .load.apis import APIS, OPENAI_APIS, default_path, is_generative, models_url
from .load.arrivals import Arrival, make_arrival
from .load.clients import CLIENTS, check_target
from .load.lengths import LengthsLike, make_lengths, take_lengths
from .load.loops import run_on_fresh_loop
from .load.mix import Flow, Mix, MixLike, make_mix, parse_mix
from .load.payloads import PayloadLike, take_payloads, take_requests
from .load.plan import Plan
from .load.processes import run_in_processes
from .load.results import PROBE_COLUMNS, RECORD_COLUMNS, TOKEN_COLUMNS, LoadResult, build_records
from .load.worker import run_here
from .analysis.trust import late_matters, load_seen

logger = logging.getLogger(__name__)

__all__ = ["LATE_MS", "Flow", "LoadResult", "LoadSpec", "Mix", "RECORD_COLUMNS", "TOKEN_COLUMNS", "parse_mix",
           "run_load", "run_load_sync"]

LATE_MS = 1.0  # a send this much after its scheduled time counts as late


@dataclass
class LoadSpec:
    """Everything that defines a run; ``run_load(url, **fields)`` builds one."""

    url: str  # base ("http://127.0.0.1:8000") or full target URL
    arrival: str | Arrival | Iterable[float] | None = None  # open loop; None -> "poisson"
    rate_per_s: float | None = None  # for arrival "constant"/"poisson"
    duration_s: float | None = None  # open loop: schedule window; closed: stop starting requests
    max_requests: int | None = None  # at least one of duration_s / max_requests
    users: int | None = None  # closed loop: this many users instead of an arrival process
    think_s: float = 0.0  # closed loop: pause between a user's answer and its next send
    payload: PayloadLike = "hello world"  # str, WordTexts, FileLines/Path, or any iterable (generate: prompts)
    mode: str = "text"  # "text": POST text/plain body; "json": POST {"inputs": text}; "generate": POST {"prompt", ...}
    texts_per_request: int = 1  # mode "json": above 1, each request is {"inputs": [N texts of payload, in order]}
    api: str = "labserver"  # or "openai-completions", "openai-chat", "openai-embeddings" (then mode is not used)
    model: str | None = None  # OpenAI APIs: the model name to send; None: the first of the server's GET /v1/models
    path: str | None = None  # None -> url's own path, else the api's (labserver: "/", "/predict", "/generate")
    new_tokens: LengthsLike = 64  # generate: max_new_tokens, an int, a Lengths or a list to replay
    stream: bool = True  # generate: ask for server-sent events (else one JSON answer)
    ignore_eos: bool = True  # generate: ask the model to run to max_new_tokens
    warmup_s: float = 0.0  # requests scheduled before this are recorded but flagged
    seed: int = 0
    timeout_s: float = 60.0  # per request, connect to last byte
    max_in_flight: int = 512  # open loop: outstanding requests allowed (all processes together)
    overflow: str = "error"  # at max_in_flight: "error" records client_overflow; "wait" sends late
    drain_s: float | None = None  # after the last send, wait this long for answers (None: up to timeout_s)
    client: str = "raw"  # "raw" (fast) or "httpx"
    process: bool = True  # run the client in spawned processes, away from the caller's loop
    processes: int = 1  # generator processes splitting the schedule round-robin
    probe_interval_s: float | None = None  # also GET probe_path this often, on its own connection
    probe_path: str = "/health"
    progress: bool | None = None  # tqdm bar; None: only for runs of 10 s or more
    allow_remote: bool = False  # loopback targets only unless this is True
    mix: MixLike | None = None  # flows sent side by side (a Mix, a list of Flow, or "name:share:key=value,...")
    api_key: str | None = field(default_factory=wire.env_api_key, repr=False)  # "Authorization: Bearer KEY"; $LABSERVER_API_KEY

    def __post_init__(self) -> None:
        check_target(self.url, self.allow_remote)
        choices = {"mode": ("text", "json", "generate"), "overflow": ("error", "wait"), "client": tuple(CLIENTS),
                   "api": APIS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.duration_s is None and self.max_requests is None:
            raise ValueError("give duration_s or max_requests (or both): a run must be bounded")
        if self.users is not None and self.arrival is not None:
            raise ValueError("give either users (closed loop) or arrival (open loop), not both")
        if self.users is not None and self.users < 1:
            raise ValueError(f"users must be >= 1, got {self.users}")
        if self.processes < 1 or (self.processes > 1 and not self.process):
            raise ValueError("processes must be >= 1, and process=True to use more than one")
        if self.max_in_flight < self.processes:
            raise ValueError("max_in_flight must be at least the number of processes")
        n = self.texts_per_request
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"texts_per_request must be an int >= 1, got {n!r}")
        if n > 1 and (self.api != "labserver" or self.mode != "json"):
            raise ValueError(f"texts_per_request={n} posts {{\"inputs\": [...]}} lists, which only mode='json' of "
                             f"api='labserver' sends (--mode json); got mode={self.mode!r}, api={self.api!r}")
        self.mix = make_mix(self.mix)
        if self.mix is not None:
            self.mix.check(generative=self.generative)
        if self.generative:
            make_lengths(self.new_tokens)  # fails now, with what to pass, rather than in a worker
            if self.client != "raw":
                raise ValueError(f"{self.api if self.api != 'labserver' else 'mode=generate'} needs client='raw': "
                                 "only it times each token event")

    @property
    def generative(self) -> bool:
        return is_generative(self.api, self.mode)

    def target_url(self) -> str:
        parts = urlsplit(self.url)
        given = parts.path if parts.path not in ("", "/") and not parts.path.rstrip("/").endswith("/v1") else None
        path = self.path or given or default_path(self.api, self.mode, parts.path)
        return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))

    def probe_url(self) -> str:
        parts = urlsplit(self.url)
        return urlunsplit((parts.scheme, parts.netloc, self.probe_path, "", ""))


async def run_load(url: str | LoadSpec, **options: Any) -> LoadResult:
    """Run one load and return its records; see ``LoadSpec`` for the options.

    ``await run_load("http://127.0.0.1:8000", rate_per_s=50, duration_s=10)``
    """
    spec = dataclasses.replace(url, **options) if isinstance(url, LoadSpec) else LoadSpec(url, **options)
    if spec.api in OPENAI_APIS and spec.model is None:
        spec = dataclasses.replace(spec, model=await served_model(spec.url, spec.timeout_s, spec.api_key))
    plans, arrival = _plan(spec)
    if spec.users:
        total, expected_s = spec.max_requests, spec.duration_s or 0.0
    else:
        total = sum(len(p.scheduled_s) for p in plans)
        expected_s = max((float(p.scheduled_s[-1]) for p in plans if len(p.scheduled_s)), default=0.0)
    logger.info("load %s: %s requests over %.1f s, %s", spec.target_url(), total or "?", expected_s,
                f"{spec.users} users" if spec.users else repr(arrival))
    bar = _Progress(total, spec.progress if spec.progress is not None else expected_s >= 10)
    started = datetime.now(timezone.utc)
    t_wall = time.perf_counter()
    try:
        if not plans:
            outs = []
        elif spec.process:
            outs = await run_in_processes(plans, bar.set)
        else:
            outs = [await run_here(plans[0], bar.set)]
    finally:
        bar.close()
    records, tokens = build_records(outs, spec.warmup_s, closed=bool(spec.users),
                                    flows=spec.mix.flows if spec.mix else ())
    probes = pd.DataFrame([p for o in outs for p in o["probes"]], columns=PROBE_COLUMNS)
    meta, warnings = _assess(spec, arrival, records)
    meta.update(started_at=started.isoformat(), elapsed_s=time.perf_counter() - t_wall,
                t0_unix_s=min((o["t0_unix_s"] for o in outs), default=math.nan))
    for w in warnings:
        logger.warning(w)
    return LoadResult(records, meta, warnings, probes.sort_values("t_s", ignore_index=True), tokens)


async def served_model(url: str, timeout_s: float = 10.0, api_key: str | None = None) -> str:
    """The id of the first model a server lists at ``GET /v1/models`` (OpenAI's way to ask)."""
    import httpx

    where = models_url(url)
    try:
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
            r = await client.get(where, headers={"authorization": f"Bearer {api_key}"} if api_key else None)
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"could not ask {where} which model it serves ({type(e).__name__}: {e}); "
                         "name it with model=... (--model on the command line)") from None


def run_load_sync(url: str | LoadSpec, **options: Any) -> LoadResult:
    """``run_load`` for plain code, and for a Jupyter cell where an event loop already
    runs in this thread: then the run gets a fresh loop in a helper thread.

    While it runs this thread is blocked: a server started on this thread's loop
    cannot answer. Use ``await run_load(...)`` in that case.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run_on_fresh_loop(lambda: run_load(url, **options))
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = run_on_fresh_loop(lambda: run_load(url, **options))
        except BaseException as exc:  # handed to the caller's thread below
            box["error"] = exc

    helper = threading.Thread(target=target, name="labserver-loadgen", daemon=True)
    helper.start()
    helper.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


# --- planning: what each generator process sends ------------------------------------------

def _plan(spec: LoadSpec) -> tuple[list[Plan], Arrival | None]:
    n_proc = spec.processes if spec.process else 1
    per = spec.texts_per_request
    base = dict(url=spec.target_url(), mode=spec.mode, client=spec.client, timeout_s=spec.timeout_s,
                overflow=spec.overflow, drain_s=spec.drain_s, seed=spec.seed, stream=spec.stream,
                ignore_eos=spec.ignore_eos, api=spec.api, model=spec.model or "", texts_per_request=per,
                headers={"authorization": f"Bearer {spec.api_key}"} if spec.api_key else {})
    generate = spec.generative
    mix = spec.mix
    plans: list[Plan] = []
    if spec.users:
        texts: list[str] = []
        if spec.process and mix and not _picklable(mix):
            raise ValueError("a flow's payload cannot be shipped to a generator process: give it a list, "
                             "a WordTexts or a file, or use process=False")
        if spec.process and not _picklable(spec.payload):
            if spec.max_requests is None:
                raise ValueError("a generator of payloads cannot be shipped to a generator process: "
                                 "pass a list, give max_requests, or use process=False")
            texts = take_payloads(spec.payload, spec.max_requests * per, seed=[spec.seed, 1])
        for w in range(n_proc):
            share = len(range(w, spec.max_requests, n_proc)) if spec.max_requests is not None else None
            plans.append(Plan(worker=w, index=np.empty(0, int), scheduled_s=np.empty(0),
                              texts=texts[w::n_proc], users=len(range(w, spec.users, n_proc)),
                              think_s=spec.think_s, duration_s=spec.duration_s or math.inf,
                              max_requests=share, payload=None if texts else spec.payload,
                              max_in_flight=spec.users, lengths=make_lengths(spec.new_tokens) if generate else None,
                              flows=mix.flows if mix else (), **base))
        arrival = None
    else:
        arrival = make_arrival(spec.arrival or "poisson", spec.rate_per_s)
        times = arrival.times(spec.duration_s, spec.max_requests, seed=spec.seed)
        texts = take_requests(spec.payload, len(times), per, seed=[spec.seed, 1])
        sizes = take_lengths(spec.new_tokens, len(times), seed=[spec.seed, 2]) if generate else None
        flow = mix.assign(len(times), seed=spec.seed) if mix else None
        if mix:
            mix.place_own(flow, texts, sizes, spec.seed, per)
        index = np.arange(len(times))
        for w in range(n_proc):  # round-robin keeps every process's share evenly spread in time
            plans.append(Plan(worker=w, index=index[w::n_proc], scheduled_s=times[w::n_proc],
                              texts=texts[w::n_proc], max_in_flight=-(-spec.max_in_flight // n_proc),
                              new_tokens=sizes[w::n_proc] if generate else None,
                              flows=mix.bare().flows if mix else (), flow=flow[w::n_proc] if mix else None, **base))
    if spec.probe_interval_s:
        plans[0].probe_url, plans[0].probe_interval_s = spec.probe_url(), spec.probe_interval_s
    return [p for p in plans if p.users or len(p.scheduled_s) or p.probe_url], arrival


def _picklable(obj: Any) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


# --- records, checks, small helpers ------------------------------------------------------

def _assess(spec: LoadSpec, arrival: Arrival | None, records: pd.DataFrame) -> tuple[dict, list[str]]:
    measured = records[~records["warmup"]]
    sent = measured[measured["sent_s"].notna()]
    late = sent["late_ms"]
    late_fraction = float((late > LATE_MS).mean()) if len(sent) else 0.0
    scheduled_rate = _rate(measured["scheduled_s"])
    achieved = _rate(sent["sent_s"])
    sent_scheduled = _rate(sent["scheduled_s"])  # what it sent, on time or not: an overflow is its own warning
    n_overflow = int((records["error"] == "client_overflow").sum())
    n_cancelled = int((records["error"] == "cancelled").sum())
    meta = {f.name: _plain(getattr(spec, f.name)) for f in dataclasses.fields(spec)}
    meta.update(
        mix=str(spec.mix) if spec.mix else None,  # parse_mix reads it back (LoadResult.flow_summary does)
        target_url=spec.target_url(), loop="closed" if spec.users else "open",
        arrival=repr(arrival) if arrival else None,
        # offered load per second (open loop) and users (closed loop), as analysis.summarize reads them
        target_rate=_target_rate(arrival, spec.duration_s, scheduled_rate) if arrival else None,
        concurrency=spec.users,
        scheduled_rate_per_s=scheduled_rate, achieved_send_rate_per_s=achieved,
        n_requests=len(records), n_warmup=int(records["warmup"].sum()), n_measured=len(measured),
        n_sent=int(records["sent_s"].notna().sum()), n_overflow=n_overflow, n_cancelled=n_cancelled,
        late_fraction=late_fraction, late_ms_p99=float(late.quantile(0.99)) if len(late) else math.nan,
        late_ms_max=float(late.max()) if len(late) else math.nan,
        processes=spec.processes if spec.process else 0,
    )
    warnings = []
    answered = measured.loc[measured["status"].between(200, 299), "latency_ms"]
    p50 = float(answered.median()) if len(answered) else math.nan
    meta["late_matters"] = bool(len(sent)) and late_matters(float(late.clip(lower=0).mean()), p50, achieved,
                                                            sent_scheduled)
    if meta["late_matters"]:  # a few ms of timer jitter against longer answers is not worth a warning
        why = (f" max_in_flight={spec.max_in_flight} was reached and overflow='wait' held sends back."
               if spec.overflow == "wait" and not spec.users else
               " Use processes=N, a lower rate, or a quieter machine.")
        warnings.append(
            f"the load generator fell behind: {late_fraction:.1%} of sends were more than {LATE_MS:g} ms "
            f"late (mean {late.clip(lower=0).mean():.1f} ms, p99 {meta['late_ms_p99']:.1f} ms, against a median "
            f"latency of {p50:.1f} ms); sent "
            f"{achieved:.1f}/s against {sent_scheduled:.1f}/s scheduled. latency_ms still counts from "
            f"the schedule; {load_seen(achieved, sent_scheduled)}.{why}")
    if n_overflow:
        warnings.append(
            f"{n_overflow} requests ({n_overflow / len(records):.1%}) were not sent because "
            f"max_in_flight={spec.max_in_flight} were already outstanding (error 'client_overflow'); "
            "the server is slower than the arrival rate, or raise max_in_flight.")
    if n_cancelled:
        warnings.append(f"{n_cancelled} requests were still unanswered at the end and were cancelled.")
    return meta, warnings


def _target_rate(arrival: Arrival, duration_s: float | None, scheduled_rate: float) -> float:
    """The arrival process's mean rate over the run; for replayed times, the schedule's."""
    nominal = arrival.mean_rate_per_s(duration_s) if duration_s else None
    return scheduled_rate if nominal is None else nominal


def _plain(value: Any) -> Any:
    """Keep JSON-friendly settings as they are; describe the rest (a generator, an Arrival,
    a list of payloads) in a line."""
    if isinstance(value, (int, float, bool, type(None))):
        return value
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _rate(times_s: pd.Series) -> float:
    span = _span(times_s)
    return (len(times_s) - 1) / span if span > 0 else math.nan


def _span(times_s: pd.Series) -> float:
    return float(times_s.max() - times_s.min()) if len(times_s) > 1 else 0.0


class _Progress:
    """A tqdm bar when shown (a widget in Jupyter, stderr in a shell), else nothing."""

    def __init__(self, total: int | None, show: bool) -> None:
        self.bar = None
        if show:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="req", desc="load", dynamic_ncols=True)

    def set(self, n: int) -> None:
        if self.bar is not None and n > self.bar.n:
            self.bar.update(n - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
