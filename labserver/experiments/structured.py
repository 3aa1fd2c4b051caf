"""Structured outputs measured on a live server: answers with and without a schema, what the mask costs a step, and
what a compile costs cold and cached. ``benchmarks/structured.py`` and notebook 15 share these.

- ``answer_all``: the tasks (``labserver.load.shapes``) as greedy chat requests over ``streams``
  concurrent clients (1: one at a time), each with its schema's ``response_format`` or without
  (``shaped``; or without, made to given lengths): output tokens per second over the wall time, every answer with its finish reason
  and whether it fits its schema, and, from ``/stats`` and the step log of the same window, the
  mask's seconds, its rows and the seconds of the model calls it was part of;
- ``compile_times``: a fresh ``Grammars`` for a model: the vocabulary's preparation, each
  schema's first compile and its cached one.

Nothing here serves, decides or plots.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from .. import wire
from ..load.shapes import SCHEMAS, ShapedTask, fits, response_format

__all__ = ["answer_all", "compile_times", "mask_costs"]


def _ask(client: httpx.Client, url: str, model: str, task: ShapedTask, shaped: bool, max_tokens: int,
         ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": task.messages, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": ignore_eos}
    if shaped:
        body["response_format"] = response_format(task.schema)
    r = client.post(url + wire.V1_CHAT_PATH, json=body, timeout=600)
    r.raise_for_status()
    doc = r.json()
    text = doc["choices"][0]["message"]["content"]
    return {"schema": task.schema, "text": text, "tokens": doc["usage"]["completion_tokens"],
            "finish": doc["choices"][0]["finish_reason"], "fits": fits(text, task.schema)}


def answer_all(url: str, model: str, tasks: list[ShapedTask], *, shaped: bool, max_tokens: int | list[int],
               streams: int = 1, handle: Any = None) -> dict[str, Any]:
    """Every task answered, ``streams`` at a time (stream i takes tasks i, i + streams, ...); ``max_tokens`` a list:
    each task's own budget, made in full (``ignore_eos``: free answers of given lengths); ``handle`` (a
    ``ServerHandle`` in this process): the mask's costs in the window too (``mask_costs``)."""
    exact = isinstance(max_tokens, list)
    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(tasks)
    before = httpx.get(url + "/stats", timeout=30).json()
    start = time.perf_counter()

    def stream(i: int) -> list[dict[str, Any]]:
        with httpx.Client() as client:
            return [_ask(client, url, model, t, shaped, n, exact)
                    for t, n in zip(tasks[i::streams], budgets[i::streams], strict=True)]

    with ThreadPoolExecutor(streams) as pool:
        parts = list(pool.map(stream, range(streams)))
    answers = [parts[i % streams][i // streams] for i in range(len(tasks))]  # (in the tasks' order)
    end = time.perf_counter()
    after = httpx.get(url + "/stats", timeout=30).json()
    tokens = sum(a["tokens"] for a in answers)
    out = {"tps": tokens / (end - start), "tokens": tokens, "seconds": end - start, "answers": answers,
           "fit": sum(a["fits"] for a in answers), "cut": sum(a["finish"] == "length" for a in answers)}
    if handle is not None:
        out.update(mask_costs(before, after, handle.steps(), start, end))
    return out


def mask_costs(before: dict[str, Any], after: dict[str, Any], steps: list[dict[str, Any]], start_s: float,
               end_s: float) -> dict[str, Any]:
    """The mask's seconds and rows between two ``/stats`` readings, beside the model calls of that window (the step
    log's, on the same clock): the mask's share of their time, per call and per row."""
    mask_s = after.get("grammar_mask_seconds", 0.0) - before.get("grammar_mask_seconds", 0.0)
    rows = after.get("grammar_mask_rows", 0) - before.get("grammar_mask_rows", 0)
    calls = [s for s in steps if start_s <= s["start_s"] and s["end_s"] <= end_s]
    call_s = sum(s["end_s"] - s["start_s"] for s in calls)
    return {"mask_s": mask_s, "mask_rows": rows, "calls": len(calls), "call_s": call_s,
            "mask_share": mask_s / call_s if call_s else 0.0, "mask_ms_per_call": 1000 * mask_s / max(len(calls), 1),
            "call_ms": 1000 * call_s / max(len(calls), 1), "mask_ms_per_row": 1000 * mask_s / max(rows, 1)}


def compile_times(model: Any, schemas: dict[str, dict[str, Any]] = SCHEMAS) -> dict[str, Any]:
    """A fresh compiler for ``model``: the vocabulary's preparation (once per model), then each schema's first
    compile and a second request for it (the cache), seconds."""
    import orjson

    from ..models.grammar import Constraint, Grammars

    grammars = Grammars(model)
    out: dict[str, Any] = {"cold_s": {}, "cached_s": {}}

    async def run() -> None:
        start = time.perf_counter()
        await grammars.compile(Constraint("regex", "x"))  # (the vocabulary, prepared once per model)
        out["vocab_s"] = time.perf_counter() - start
        for name, schema in schemas.items():
            constraint = Constraint("json", orjson.dumps(schema).decode())
            for key in ("cold_s", "cached_s"):
                start = time.perf_counter()
                await grammars.compile(constraint)
                out[key][name] = time.perf_counter() - start

    with ThreadPoolExecutor(1) as pool:  # (a loop of its own: a notebook's kernel runs one already)
        pool.submit(asyncio.run, run()).result()
    out["compiles"], out["hits"] = grammars.compiles, grammars.hits
    return out
