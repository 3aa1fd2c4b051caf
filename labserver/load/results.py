"""What a load run leaves behind: the records frame, the tokens frame, and their files.

``LoadResult.records`` has one row per request (``RECORD_COLUMNS``, in order, one
schema for every mode: the generation columns are NaN, NA or "" for other runs).
A run with a mix (``labserver.load.mix``) names each request's ``flow`` and the
``priority`` and ``tenant`` it was sent with; ``reason`` is the server's ``x-reason`` on
a refusal or a shed; ``input_chars`` is what the request carried (summed over a JSON list
of texts) and ``input_tokens`` the server's count of its tokens, where it sends one. A
generation run also fills ``LoadResult.tokens``, one row per token event received
(``TOKEN_COLUMNS``: the request's ``i``, the token's index ``k`` and its client-clock
arrival ``t_s``), so inter-token gaps are ``tokens.groupby("i")["t_s"].diff()``.

Times in both are seconds from the run's start in the generator's clock, and every
latency-like column counts from the *scheduled* send (no coordinated omission):
``latency_ms`` to the last byte, ``ttft_ms`` to the first token event. ``tpot_ms``
is vLLM's time per output token, ``(done_s - first_token_s) / (n_tokens - 1)``;
for a one-piece (non-stream) answer the first token is taken to arrive with the
rest, so its TTFT is its latency and its TPOT is 0, as in vLLM's benchmark.

This module builds and stores frames; it sends nothing (``labserver.loadgen``) and
does no statistics: ``LoadResult.summary`` is ``labserver.analysis.summarize``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..analysis.flows import summarize_flows
from ..analysis.summary import summarize
from .mix import Flow, parse_mix
from .worker import PROBE_FIELDS, ROW_FIELDS

__all__ = ["LoadResult", "PROBE_COLUMNS", "RECORD_COLUMNS", "TOKEN_COLUMNS", "build_records"]

RECORD_COLUMNS: dict[str, str] = {  # column -> dtype, in order
    "i": "int64", "process": "int64", "scheduled_s": "float64", "sent_s": "float64",
    "done_s": "float64", "status": "int64", "error": "str",
    "reason": "str",  # the server's x-reason on a 503/504 (queue-full, codel, deadline, ...); "" when none
    "latency_ms": "float64", "send_latency_ms": "float64", "late_ms": "float64", "warmup": "bool",
    "input_chars": "int64",
    # a mix (labserver.load.mix): the request's flow, and the x-priority / x-tenant it was sent with
    "flow": "str",  # "" without a mix
    "priority": "Int64",  # NA when none was sent
    "tenant": "str",  # "" when none was sent
    "queue_ms": "float64", "compute_ms": "float64", "batch_size": "Int64", "batch_id": "Int64",
    "dispatch": "str", "server_ms": "float64", "request_id": "str", "replica": "str",
    # an encoder server's x-input-tokens: tokens the model computed for the request's texts, special
    # tokens included; NA when the server sends none
    "input_tokens": "Int64",
    # generation (mode "generate"); for a stream, queue_ms and server_ms come from its done event
    "first_token_s": "float64",  # first token event (one-piece answer: done_s), s
    "n_tokens": "Int64",  # token events received (one-piece answer: its generated_tokens)
    "max_new_tokens": "Int64",  # tokens asked for
    "finish_reason": "str",  # "length", "eos", ...; "" when none came
    "ttft_ms": "float64",  # first_token_s - scheduled_s
    "tpot_ms": "float64",  # (done_s - first_token_s) / (n_tokens - 1); NaN below 2 tokens
}
# text columns where "" means "none", never missing
_EMPTY_IS_NONE = ("error", "reason", "flow", "tenant", "finish_reason")
TOKEN_COLUMNS: dict[str, str] = {"i": "int64", "k": "int64", "t_s": "float64"}
PROBE_COLUMNS = PROBE_FIELDS


def _empty_tokens() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=d) for c, d in TOKEN_COLUMNS.items()})


@dataclass
class LoadResult:
    records: pd.DataFrame  # one row per request, columns RECORD_COLUMNS
    meta: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    probes: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=PROBE_COLUMNS))
    tokens: pd.DataFrame = field(default_factory=_empty_tokens)  # generation: one row per token event

    @property
    def measured(self) -> pd.DataFrame:
        """The records after warm-up: what summaries are made of."""
        return self.records[~self.records["warmup"]]

    def summary(self, **options: Any) -> dict[str, Any]:
        """``labserver.analysis.summarize`` over this run (its meta and tokens included), as a dict.

        ``options`` as there (``slo_ms``, ``ttft_slo_ms``, ``tpot_slo_ms`` ...): one summary, one
        name and one formula per figure, whichever way it is asked for.
        """
        return summarize(self.records, meta=self.meta, tokens=self.tokens, **options).to_dict()

    def flow_summary(self, **options: Any) -> pd.DataFrame:
        """``labserver.analysis.summarize_flows`` over this run, each flow under the targets its
        mix gave it (``options`` as there: ``key="tenant"``, fallback ``slo_ms`` ...)."""
        mix = self.meta.get("mix")
        return summarize_flows(self.records, parse_mix(mix) if mix else None, self.tokens, **options)

    def save(self, path: str | Path, summary: Mapping[str, Any] | None = None) -> list[Path]:
        """Write the run in the format its name asks for; the files written.

        ``run.csv``: the records, with ``run.csv.json`` (summary, meta, warnings, probes)
        and, for generation, ``run.csv.tokens.csv``; ``run.parquet``: the same with the
        records as Parquet (needs pyarrow); ``run.json``: the summary, meta and warnings
        alone; a name without a suffix: a folder holding ``records.csv`` and the rest.
        """
        path = Path(path)
        summary = dict(summary) if summary is not None else self.summary()
        suffix = path.suffix.lower()
        if suffix == ".json":
            doc = {"summary": summary, "meta": self.meta, "warnings": self.warnings}
            path.write_text(json.dumps(doc, indent=1, default=_jsonable))
            return [path]
        if suffix == ".parquet":
            try:
                self.records.to_parquet(path, index=False)
            except ImportError as e:
                raise ValueError(f"writing {path.name} needs pyarrow (pip install pyarrow); "
                                 "or save as .csv or .json") from e
            return [path, *self._sidecars(path, summary)]
        if suffix == ".csv":
            return [self.to_csv(path, summary)]
        path.mkdir(parents=True, exist_ok=True)
        return [self.to_csv(path / "records.csv", summary)]

    def to_csv(self, path: str | Path, summary: Mapping[str, Any] | None = None) -> Path:
        """Write the records to ``path``, summary, meta, warnings and probes to ``path``.json
        and, for a generation run, the tokens to ``path``.tokens.csv."""
        path = Path(path)
        self.records.to_csv(path, index=False)
        self._sidecars(path, summary)
        return path

    def _sidecars(self, path: Path, summary: Mapping[str, Any] | None) -> list[Path]:
        side = {"summary": dict(summary) if summary is not None else self.summary(), "meta": self.meta,
                "warnings": self.warnings, "probes": self.probes.to_dict("list")}
        _sidecar(path, ".json").write_text(json.dumps(side, indent=1, default=_jsonable))
        tokens_path = _sidecar(path, ".tokens.csv")
        if len(self.tokens):
            self.tokens.to_csv(tokens_path, index=False)
            return [_sidecar(path, ".json"), tokens_path]
        if tokens_path.exists():
            tokens_path.unlink()  # a stale one from an earlier run at this path would be read back
        return [_sidecar(path, ".json")]

    @classmethod
    def from_csv(cls, path: str | Path) -> LoadResult:
        """Read what ``to_csv`` wrote; files from before a column existed load with it empty."""
        path = Path(path)
        # an empty cell is a missing value, except in "error" where it means "no error"
        raw = pd.read_csv(path, keep_default_na=False,
                          na_values={c: [""] for c in RECORD_COLUMNS if c not in _EMPTY_IS_NONE})
        records = _typed(raw)
        side_path = _sidecar(path, ".json")
        side = json.loads(side_path.read_text()) if side_path.exists() else {}
        probes = pd.DataFrame(side.get("probes") or {c: [] for c in PROBE_COLUMNS})
        tokens_path = _sidecar(path, ".tokens.csv")
        tokens = (pd.read_csv(tokens_path).astype(TOKEN_COLUMNS) if tokens_path.exists() else _empty_tokens())
        return cls(records, side.get("meta", {}), side.get("warnings", []), probes, tokens)


def build_records(outs: list[dict[str, Any]], warmup_s: float, *, closed: bool,
                  flows: Sequence[Flow] = ()) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The records and tokens frames from the generator processes' rows (``ROW_FIELDS``);
    ``flows``: the mix's, which the rows' ``flow_k`` index."""
    df = pd.DataFrame([r for o in outs for r in o["rows"]], columns=ROW_FIELDS)
    k = df["flow_k"].to_numpy(dtype=np.int64) if len(df) else np.empty(0, np.int64)
    if flows and len(df) and (k < 0).any():
        raise ValueError("rows without a flow in a run with a mix")
    pick = (lambda values: [values[j] for j in k]) if flows else (lambda values: [None] * len(df))
    df["flow"] = pick([f.name for f in flows])
    df["priority"] = pick([f.priority for f in flows])
    df["tenant"] = pick([f.tenant for f in flows])
    if closed:  # numbered in the order the users meant to send
        df = df.sort_values(["scheduled_s", "process"], kind="stable", ignore_index=True)
        df["i"] = np.arange(len(df))
    df = df.sort_values("i", ignore_index=True)
    df["latency_ms"] = (df["done_s"] - df["scheduled_s"]) * 1e3
    df["send_latency_ms"] = (df["done_s"] - df["sent_s"]) * 1e3
    df["late_ms"] = (df["sent_s"] - df["scheduled_s"]) * 1e3
    df["warmup"] = df["scheduled_s"] < warmup_s
    first_s = pd.to_numeric(df["first_token_s"], errors="coerce")
    n = pd.to_numeric(df["n_tokens"], errors="coerce")
    df["ttft_ms"] = (first_s - df["scheduled_s"]) * 1e3
    df["tpot_ms"] = ((df["done_s"] - first_s) * 1e3 / (n - 1)).where(n > 1)
    return _typed(df), _tokens(df["i"].to_numpy(), df["token_s"].tolist())


def _tokens(ids: np.ndarray, times: list[list[float] | None]) -> pd.DataFrame:
    counts = np.array([len(t) if t else 0 for t in times], dtype=np.int64)
    if not counts.sum():
        return _empty_tokens()
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return pd.DataFrame({
        "i": np.repeat(ids.astype(np.int64), counts),
        "k": np.arange(counts.sum(), dtype=np.int64) - starts,
        "t_s": np.concatenate([np.asarray(t, dtype=float) for t in times if t]),
    })


def _typed(df: pd.DataFrame) -> pd.DataFrame:
    out = {}
    for col, dtype in RECORD_COLUMNS.items():
        s = df[col] if col in df.columns else pd.Series(None, index=df.index, dtype=object)  # an older file
        if col in _EMPTY_IS_NONE:
            s = s.fillna("").astype("str")
        elif dtype == "str":
            s = s.astype("str").where(s.notna())
        elif dtype == "Int64":
            num = pd.to_numeric(s, errors="coerce")
            s = num.where(num == num.round()).astype("Int64")
        elif dtype == "bool" and s.dtype == object:
            s = s.map({"True": True, "False": False, True: True, False: False}).astype(bool)
        else:
            s = pd.to_numeric(s, errors="coerce").astype(dtype)
        out[col] = s
    return pd.DataFrame(out).reset_index(drop=True)


def _sidecar(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    return repr(obj)
