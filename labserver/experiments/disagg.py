"""Disaggregated against colocated serving, live on this machine: what ``benchmarks/disagg.py`` and notebook 14 share.

Two arrangements of the same model on Ray Serve, one after the other, each loaded with the
same requests (``LiveConfig``):

- ``colocated``: two replicas, each doing both phases, one torch thread each, each pinned to a
  core of its own (``pin_cores``), as the disaggregated ones are: the two differ in who
  computes what, not in where;
- ``disaggregated``: one prefill and one decode replica (``disaggregate=(1, 1)``), each pinned
  to a core of its own (``pin_cores``), one torch thread each.

The workload is the one disaggregation is for: long prompts with short answers mixed with
short prompts and long answers (two flows of a ``Mix``), Poisson arrivals at ``rate``.
Colocated, a long prompt's prefill stalls every answer decoding on its replica; disaggregated,
no prefill ever runs beside a decode, and each prompt's KV crosses between the two processes.
``run`` returns the run's records and tokens (``labserver.loadgen``), its summary under the
SLO (``analysis.summarize``: TTFT and ITL percentiles, goodput, output tokens per second) and
what the ingress counted over it (the KV handed over, the TTFT split by part). A closed-loop
run with ``users`` users after it gives the throughput at saturation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pandas as pd

__all__ = ["ARRANGEMENTS", "LiveConfig", "LiveRun", "arrangement_options", "measured_costs", "run"]

ARRANGEMENTS = ("colocated", "disaggregated")
COUNTED = ("kv_transfers", "kv_transfer_bytes", "kv_transfer_ms", "answered_by_prefill", "decode_retries")


@dataclass(frozen=True)
class LiveConfig:
    """The workload, the load and the SLO of one comparison."""

    model: str = "smollm2"
    long_prompt: int = 512  # tokens of a long prompt (the first flow), answered in ``short_answer`` tokens
    short_answer: int = 16
    short_prompt: int = 32  # the second flow: short prompts with long answers
    long_answer: int = 128
    long_share: float = 0.5  # of the arrivals, the first flow's
    rate: float = 1.0  # requests per second, Poisson
    requests: int = 300  # open-loop requests measured (after ``warm`` sent one at a time)
    users: int = 8  # the closed-loop run (throughput at saturation); 0: none
    closed_requests: int = 64
    ttft_slo_ms: float = 3000.0  # goodput: first token within this...
    tpot_slo_ms: float = 60.0  # ...and each request's mean time per output token within this
    max_batch_size: int = 8
    warm: int = 4
    seed: int = 0

    def flows(self) -> Any:
        """The two flows, prompts of exact token counts in the model's own tokenizer when it has a folder."""
        from ..load.mix import Flow, Mix
        from ..load.prompts import TokenPrompts

        tokenizer = _tokenizer_folder(self.model)
        long = Flow("long-prompt", self.long_share, payload=TokenPrompts(self.long_prompt, tokenizer=tokenizer),
                    new_tokens=self.short_answer, ttft_slo_ms=self.ttft_slo_ms, tpot_slo_ms=self.tpot_slo_ms)
        short = Flow("long-answer", 1 - self.long_share, payload=TokenPrompts(self.short_prompt, tokenizer=tokenizer),
                     new_tokens=self.long_answer, ttft_slo_ms=self.ttft_slo_ms, tpot_slo_ms=self.tpot_slo_ms)
        return Mix((long, short))


@dataclass
class LiveRun:
    """One arrangement's run: its records and tokens, summaries and what the ingress counted."""

    arrangement: str
    config: LiveConfig
    records: pd.DataFrame
    tokens: pd.DataFrame
    summary: pd.Series  # the open-loop run under the SLO
    by_flow: dict[str, pd.Series]  # the same, each flow's requests alone
    counted: dict[str, float]  # COUNTED over the open-loop run
    ttft_split_ms: dict[str, float]  # disaggregated: the mean TTFT of a handed-over request, by part
    saturated: pd.Series | None  # the closed-loop run's summary
    replicas: dict[str, Any]  # each replica's /stats at the end (its role, cores, counters)
    seconds: float


def arrangement_options(name: str) -> dict[str, Any]:
    """``serve_replicas`` keywords of an arrangement."""
    if name == "colocated":
        return {"replicas": 2, "router": "least-loaded", "pin_cores": True, "threads": 1}
    if name == "disaggregated":
        return {"disaggregate": (1, 1), "router": "least-loaded", "pin_cores": True, "threads": 1}
    raise ValueError(f"unknown arrangement {name!r}: {' or '.join(ARRANGEMENTS)}")


def run(arrangement: str, cfg: LiveConfig = LiveConfig()) -> LiveRun:
    """Deploy ``arrangement`` of ``cfg.model`` on a local Ray Serve, load it, remove it (and the Ray it started)."""
    from ..analysis import summarize
    from ..config import ServerConfig
    from ..loadgen import run_load_sync
    from ..replicas import serve_replicas
    from ..strategies import Limits

    start = time.perf_counter()
    config = ServerConfig(strategy="gen-continuous", model=cfg.model, port=0, max_new_tokens=max(
        cfg.short_answer, cfg.long_answer), limits=Limits(max_batch_size=cfg.max_batch_size, timeout_ms=None))
    with serve_replicas(config, num_cpus=4, **arrangement_options(arrangement)) as h:
        common = dict(mode="generate", mix=cfg.flows(), seed=cfg.seed, stream=True, ignore_eos=True, timeout_s=600,
                      drain_s=600, progress=False)
        if cfg.warm:  # every replica's first calls (and the ingress's) outside the measurement
            run_load_sync(h.url, users=1, max_requests=cfg.warm, **{**common, "seed": cfg.seed + 1})
        before = h.stats()
        result = run_load_sync(h.url, arrival="poisson", rate_per_s=cfg.rate, max_requests=cfg.requests, **common)
        after = h.stats()
        saturated = None
        if cfg.users:
            closed = run_load_sync(h.url, users=cfg.users, max_requests=cfg.closed_requests,
                                   **{**common, "seed": cfg.seed + 2})
            saturated = summarize(closed.records, tokens=closed.tokens)
        replicas = after.get("replicas", {})
    records, tokens = result.records, result.tokens
    slo = dict(ttft_slo_ms=cfg.ttft_slo_ms, tpot_slo_ms=cfg.tpot_slo_ms)
    summary = summarize(records, tokens=tokens, **slo)
    by_flow = {name: summarize(records[records["flow"] == name], tokens=tokens, **slo)
               for name in cfg.flows().names}
    counted = {k: float(after.get(k, 0) or 0) - float(before.get(k, 0) or 0) for k in COUNTED}
    n = counted["kv_transfers"]
    split = {part: (float(after.get("ttft_split_ms", {}).get(part, 0)) -
                    float(before.get("ttft_split_ms", {}).get(part, 0))) / n if n else float("nan")
             for part in ("queue", "prefill", "transfer", "decode")}
    return LiveRun(arrangement, cfg, records, tokens, summary, by_flow, counted, split, saturated, replicas,
                   time.perf_counter() - start)


def _tokenizer_folder(model: str) -> str | None:
    """The folder whose tokenizer counts prompt tokens exactly: smollm2's converted folder, a folder given as the
    model; None (a word a token) for others."""
    from pathlib import Path

    if model.split(":")[0] in ("smollm2", "smollm2-q4"):
        from ..models.smollm2 import folder

        return str(folder())
    return model if Path(model).is_dir() else None


def measured_costs(model: Any, *, threads: int = 1, prompts: tuple[int, ...] = (64, 256, 512),
                   batches: tuple[int, ...] = (1, 4, 8, 16), context: int = 256, repeats: int = 3,
                   **rest: Any) -> Any:
    """``routing.pd.PDCosts`` from this machine: ``model`` (a loaded generator) timed alone with ``threads`` torch
    threads, a prefill of each prompt length and a decode step of each batch at ``context`` positions a sequence
    (the medians of ``repeats``); ``rest`` are PDCosts' other fields (the link, ``max_batch``)."""
    import statistics

    import torch

    from ..models import Chunk
    from ..routing.pd import PDCosts

    def ms(chunks_of: Any, release: bool) -> float:
        times = []
        for _ in range(repeats):
            chunks, t = chunks_of(), time.perf_counter()
            model.forward(chunks)
            times.append((time.perf_counter() - t) * 1000)
            if release:
                model.release([c.sid for c in chunks])
        return statistics.median(times)

    block = 16
    per = -(-(max(max(prompts), context) + 1) // block)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model.allocate_kv(per * max(batches), block)
        prefill = [(n, ms(lambda n=n: [Chunk(1, [100 + i % 900 for i in range(n)], 0, tuple(range(per)))], True))
                   for n in prompts]
        steps = []
        for b in batches:
            tables = [tuple(range(k * per, (k + 1) * per)) for k in range(b)]
            model.forward([Chunk(k + 1, [100 + i % 900 for i in range(context)], 0, tables[k]) for k in range(b)])
            steps.append((b, ms(lambda: [Chunk(k + 1, [7], context, tables[k], decode=True, prompt_len=context)
                                         for k in range(b)], False)))
            model.release(list(range(1, b + 1)))
    finally:
        torch.set_num_threads(before)
    return PDCosts.from_measured(prefill, steps, kv_bytes_per_token=float(model.kv_bytes_per_token), **rest)
