"""The one experiment driver: start each strategy in turn, load it at a few offered rates, keep everything.

``serve_and_load`` is what the notebooks and ``labserver compare`` call, for encoders
and generation alike: every strategy in turn on one model, the same open-loop
schedule (arrivals, payloads and, for generation, output lengths, drawn from one
seed) at every offered rate. For each run it keeps, in one ``Runs``:

- ``records``: the load generator's row per request (``labserver.load.results``);
- ``tokens``: every token's arrival at the client (generation: ITL);
- ``steps``: the server's step log (generation: who was in each prefill and decode step);
- ``lag``: the server's event-loop lag samples, and ``probes``: /health probes while it ran,
  both with ``t_s`` in the clock of their run's records;
- ``warnings``: the load generator's, as ``"label @ rate: ..."``.

All frames carry ``label`` and ``rate`` columns, so several runs live in one frame.
"""

from __future__ import annotations

import logging
import math
import os
import platform
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from typing import Any

import numpy as np
import pandas as pd

from .. import analysis
from ..launch import ServerHandle, serve_each
from ..load.arrivals import PayloadLike
from ..load.lengths import LengthsLike
from ..loadgen import LoadResult, run_load_sync

__all__ = ["LAG_COLUMNS", "PROBE_COLUMNS", "STEP_COLUMNS", "Runs", "lag_in_run_clock", "load_rates", "machine_info",
           "serve_and_load", "steps_in_run", "warm_up"]

LAG_COLUMNS = ["label", "rate", "t_s", "lag_ms"]
PROBE_COLUMNS = ["label", "rate", "t_s", "latency_ms", "status", "error"]
STEP_COLUMNS = ["label", "rate", "step", "start_s", "end_s", "seqs", "idle", "kv_tokens", "kv_reserved",
                "tokens", "prefilling", "preempted", "blocks_used", "blocks_cached", "blocks_free", "decoding"]
TOKEN_COLUMNS = ["label", "rate", "i", "k", "t_s"]


def _empty(columns: Sequence[str]) -> pd.DataFrame:
    return pd.DataFrame(columns=list(columns))


@dataclass
class Runs:
    """Several load runs told apart by ``label`` and offered ``rate`` (see the module docstring)."""

    records: pd.DataFrame
    tokens: pd.DataFrame = field(default_factory=lambda: _empty(TOKEN_COLUMNS))
    steps: pd.DataFrame = field(default_factory=lambda: _empty(STEP_COLUMNS))
    lag: pd.DataFrame = field(default_factory=lambda: _empty(LAG_COLUMNS))
    probes: pd.DataFrame = field(default_factory=lambda: _empty(PROBE_COLUMNS))
    warnings: list[str] = field(default_factory=list)

    def summary(self, slo_ms: float | None = None, *, ttft_slo_ms: float | None = None,
                tpot_slo_ms: float | None = None) -> pd.DataFrame:
        """``analysis.summarize_runs`` over the records (and tokens): one row per (label, rate)."""
        tokens = self.tokens if len(self.tokens) else None
        return analysis.summarize_runs(self.records, slo_ms=slo_ms, tokens=tokens, ttft_slo_ms=ttft_slo_ms,
                                       tpot_slo_ms=tpot_slo_ms)

    def run(self, label: str, rate: float | None = None) -> Runs:
        """The rows of one label (and one rate, or all of that label's rates)."""

        def keep(frame: pd.DataFrame) -> pd.DataFrame:
            rows = frame[frame["label"] == label]
            return rows if rate is None else rows[np.isclose(rows["rate"].astype(float), rate)]

        return Runs(keep(self.records), keep(self.tokens), keep(self.steps), keep(self.lag), keep(self.probes),
                    [w for w in self.warnings if w.startswith(f"{label} @")])

    def idle_share(self) -> pd.DataFrame:
        """Per run: the share of decode work spent on sequences already finished (gen-static's waste)."""
        decode = self.steps[self.steps["decoding"].map(len) == self.steps["seqs"].map(len)]  # decode steps only
        if decode.empty:
            return pd.DataFrame(columns=["label", "rate", "idle_share"])
        sizes = decode.assign(work=decode["seqs"].map(len), idle_n=decode["idle"].map(len))
        table = sizes.groupby(["label", "rate"], sort=False)[["work", "idle_n"]].sum().reset_index()
        return table.assign(idle_share=table["idle_n"] / table["work"])[["label", "rate", "idle_share"]]

    @staticmethod
    def concat(parts: Iterable[Runs]) -> Runs:
        parts = list(parts)

        def stack(name: str, columns: Sequence[str] | None) -> pd.DataFrame:
            frames = [getattr(p, name) for p in parts if len(getattr(p, name))]
            if frames:
                return pd.concat(frames, ignore_index=True)
            return analysis.combine({}) if columns is None else _empty(columns)

        return Runs(stack("records", None), stack("tokens", TOKEN_COLUMNS), stack("steps", STEP_COLUMNS),
                    stack("lag", LAG_COLUMNS), stack("probes", PROBE_COLUMNS), [w for p in parts for w in p.warnings])


def lag_in_run_clock(handle: ServerHandle, result: LoadResult) -> pd.DataFrame:
    """The server's event-loop lag samples during one load run, with ``t_s`` in that run's clock.

    The server stamps its samples with ``time.perf_counter`` from its own start;
    the load generator's records and probes count from its start (``meta["t0_unix_s"]``).
    Both are turned into wall-clock time, so lag and probe latency can share an axis.
    Works for a server on its own thread and for one attached to this loop.
    """
    monitor = handle.runtime.lag
    to_unix_s = time.time() - time.perf_counter()  # perf_counter -> unix, read now
    t0_unix_s = float(result.meta.get("t0_unix_s", math.nan))
    end_s = float(result.meta.get("elapsed_s", math.inf)) + 0.5
    rows = [(t + monitor.t0_s + to_unix_s - t0_unix_s, lag) for t, lag in handle.loop_lag()]
    frame = pd.DataFrame(rows, columns=["t_s", "lag_ms"])
    return frame[(frame["t_s"] >= -0.2) & (frame["t_s"] <= end_s)].reset_index(drop=True)


def steps_in_run(handle: ServerHandle, since_s: float) -> pd.DataFrame:
    """The server's steps (generation) that began at or after ``since_s`` (its clock); empty otherwise."""
    rows = [s for s in handle.steps() if s["start_s"] >= since_s]
    return pd.DataFrame(rows, columns=STEP_COLUMNS[2:])


def warm_up(url: str, n: int = 10, payload: PayloadLike = "warm up", mode: str = "text",
            api_key: str | None = None) -> None:
    """Send ``n`` requests one after another and forget them: a fresh model's first calls are slow.

    Nothing of it is measured, so the load generator's warnings about it (its client shares
    this process with the server) are not shown either.
    """
    if n > 0:
        extra = {"new_tokens": 8, "timeout_s": 600.0} if mode == "generate" else {}
        log, unmeasured = logging.getLogger("labserver.loadgen"), _BelowWarnings()
        log.addFilter(unmeasured)
        try:
            run_load_sync(url, users=1, max_requests=n, payload=payload, mode=mode, process=False, progress=False,
                          api_key=api_key, **extra)
        finally:
            log.removeFilter(unmeasured)


class _BelowWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


def load_rates(handle: ServerHandle, rates: Sequence[float], *, label: str, duration_s: float,
               warmup_s: float = 0.0, payload: PayloadLike = "hello world", arrival: str = "poisson", seed: int = 0,
               on_run: Callable[[str, float, LoadResult], None] | None = None, **load_options: Any) -> Runs:
    """Load a running server at each offered rate in turn (open loop); one ``Runs``.

    Each run lasts ``warmup_s + duration_s``; requests scheduled in the first
    ``warmup_s`` are recorded but left out of the summaries. The schedule (arrivals,
    payloads, output lengths) depends only on ``(seed, rate)``: every server, in any
    list of rates, gets the same requests at the same rate. ``load_options`` go to
    ``run_load_sync`` (``mode``, ``new_tokens``, ``process``, ``probe_interval_s``, ``timeout_s`` ...);
    ``on_run(label, rate, result)`` is called after each run. A server started with a key
    is sent its key.
    """
    parts = []
    options = {"progress": False, "api_key": handle.api_key, **load_options}
    for rate in rates:
        since = time.perf_counter()
        result = run_load_sync(handle.url, arrival=arrival, rate_per_s=rate, duration_s=duration_s + warmup_s,
                               warmup_s=warmup_s, payload=payload, seed=seed + round(rate * 1000), **options)
        keys = {"label": label, "rate": float(rate)}
        lag = lag_in_run_clock(handle, result).assign(**keys)
        parts.append(Runs(analysis.combine([(label, rate, result)]),
                          analysis.combine_tokens([(label, rate, result)])[TOKEN_COLUMNS],
                          steps_in_run(handle, since).assign(**keys)[STEP_COLUMNS],
                          lag[LAG_COLUMNS], result.probes.assign(**keys)[PROBE_COLUMNS],
                          [f"{label} @ {rate:g}/s: {w}" for w in result.warnings]))
        if on_run is not None:
            on_run(label, rate, result)
    return Runs.concat(parts)


def serve_and_load(strategies: Sequence[str] | Mapping[str, Mapping[str, Any]], model: Any, rates: Sequence[float],
                   *, duration_s: float, warmup_s: float = 0.0, payload: PayloadLike = "hello world",
                   arrival: str = "poisson", seed: int = 0, mode: str = "text", new_tokens: LengthsLike = 64,
                   warm_requests: int = 10, load_options: Mapping[str, Any] | None = None,
                   on_run: Callable[[str, float, LoadResult], None] | None = None, **knobs: Any) -> Runs:
    """Start each strategy in turn, warm it up, load it at every rate, stop it.

    ``strategies`` is a list of strategy names, or ``{label: options}`` where the
    options (``strategy`` among them, else the label is the strategy's name) are
    added to ``knobs`` for that server only, e.g.
    ``{"deadline, 5 ms": {"strategy": "deadline", "max_wait_ms": 5}}``. ``model``
    is a spec or, better, an object from ``labserver.load_model``, so it loads once
    for all of them. ``mode="generate"`` (and ``new_tokens``) loads ``/generate``;
    ``knobs`` go to ``labserver.serve`` (max_batch_size, max_queue, timeout_ms, ...),
    ``load_options`` to the load generator.
    """
    options = dict(load_options or {})
    if mode == "generate":
        options = {"new_tokens": new_tokens, "timeout_s": 1800.0, **options}
    parts = []
    for label, handle in serve_each(strategies, model, **knobs):
        warm_up(handle.url, warm_requests if mode != "generate" else min(warm_requests, 4), payload, mode,
                handle.api_key)
        parts.append(load_rates(handle, rates, label=label, duration_s=duration_s, warmup_s=warmup_s,
                                payload=payload, arrival=arrival, seed=seed, mode=mode, on_run=on_run, **options))
    return Runs.concat(parts)


def machine_info(device: str = "auto") -> dict[str, Any]:
    """What the numbers were measured on: enough to tell two machines apart."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import psutil

        info["memory_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
        info["cpu_affinity"] = len(psutil.Process().cpu_affinity() or [])
    except (ImportError, AttributeError):
        pass
    for pkg in ("torch", "transformers", "starlette", "uvicorn", "httpx", "labserver"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = None
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    info["device_requested"] = device
    return info
