"""Per-flow, per-class and per-tenant views of a run with a mix of traffic.

A run with a mix (``labserver.load.mix``) names each request's ``flow``, ``priority`` and
``tenant`` in its records. Here each flow is summarised by the one summary
(``summary.summary_row``) under its *own* targets: an interactive flow's goodput under its
TTFT target, a batch flow's under its own, or none. Every rate is per second of the
whole run's window, so the flows' throughputs add up to the run's, and shares
(``share_of_requests``, ``share_of_answers``, ``share_of_tokens``) are of the run's.

``tokens_by`` counts tokens served per tenant (or any record column) in time bins, for a
plot of who is served while all are waiting.

Nothing here knows of HTTP or matplotlib.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pandas as pd

from .records import RUN_KEYS, measured, ok, window_s
from .summary import summary_row, tidy_counts
from .tokens import has_generation, tokens_of_run

__all__ = ["meets_targets", "summarize_flows", "tokens_by"]

_TARGETS = ("slo_ms", "ttft_slo_ms", "tpot_slo_ms")


def _flows(mix: Any) -> dict[str, dict[str, float | None]]:
    """flow name -> its targets, from a Mix, a list of Flow (anything with ``name`` and the
    targets as attributes), a mapping ``{name: {"slo_ms": ..., ...}}`` or None."""
    if mix is None:
        return {}
    if isinstance(mix, str):
        raise TypeError("a mix string is read by labserver.load.mix.parse_mix: pass parse_mix(text), or use "
                        "LoadResult.flow_summary()")
    if isinstance(mix, Mapping):
        return {str(name): {t: (targets or {}).get(t) for t in _TARGETS} for name, targets in mix.items()}
    flows = getattr(mix, "flows", mix)
    return {f.name: {t: getattr(f, t, None) for t in _TARGETS} for f in flows}


def _targets_of(rows: pd.DataFrame, flows: dict, defaults: dict) -> pd.DataFrame:
    """Each row's targets: its flow's own where it sets one, else ``defaults``."""
    names = rows["flow"].fillna("") if "flow" in rows.columns else pd.Series("", index=rows.index)
    out = {}
    for target in _TARGETS:
        own = {name: t[target] for name, t in flows.items() if t[target] is not None}
        fallback = math.nan if defaults[target] is None else float(defaults[target])
        out[target] = names.map(own).astype(float).fillna(fallback)
    return pd.DataFrame(out, index=rows.index)


def meets_targets(records: pd.DataFrame, mix: Any = None, *, slo_ms: float | None = None,
                  ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None) -> pd.DataFrame:
    """Whether each request met its own flow's targets: columns ``good`` (an answer within
    ``slo_ms``) and ``gen_good`` (an answer within ``ttft_slo_ms`` and ``tpot_slo_ms``; a
    request of one token has no TPOT and cannot miss it), as ``summarize``'s goodput counts.

    A flow's own targets win; the keyword targets stand in for flows that set none. Where a
    request has no target of a kind, that column is NA (``boolean`` dtype).
    """
    targets = _targets_of(records, _flows(mix), dict(slo_ms=slo_ms, ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms))
    answered = ok(records)
    good = answered & (records["latency_ms"] <= targets["slo_ms"])
    gen_targets = targets["ttft_slo_ms"].notna() | targets["tpot_slo_ms"].notna()
    gen_good = answered.copy()
    if "ttft_ms" in records.columns:
        gen_good &= targets["ttft_slo_ms"].isna() | (records["ttft_ms"] <= targets["ttft_slo_ms"])
        gen_good &= (targets["tpot_slo_ms"].isna() | records["tpot_ms"].isna()
                     | (records["tpot_ms"] <= targets["tpot_slo_ms"]))
    return pd.DataFrame({
        "good": good.astype("boolean").where(targets["slo_ms"].notna()),
        "gen_good": gen_good.astype("boolean").where(gen_targets),
    }, index=records.index)


def summarize_flows(records: pd.DataFrame, mix: Any = None, tokens: pd.DataFrame | None = None, *,
                    key: str = "flow", by: Iterable[str] = RUN_KEYS, slo_ms: float | None = None,
                    ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None,
                    duration_s: float | None = None, late_threshold_ms: float = 1.0) -> pd.DataFrame:
    """One summary row per run (``by``: label, rate) and value of ``key`` (a flow, or a
    ``priority`` class, or a ``tenant``), each judged by its own flow's targets.

    ``mix`` (a ``labserver.load.mix.Mix``, a list of its ``Flow``, or ``{flow: {"slo_ms": ...}}``)
    gives each flow's ``slo_ms`` / ``ttft_slo_ms`` / ``tpot_slo_ms``; the keyword targets stand in
    for flows that set none (``LoadResult.flow_summary()`` passes the run's own mix).
    ``tokens`` as in ``summarize`` (one run's, or ``combine_tokens``'s).

    Columns: the run keys, ``key`` (for flows, also the ``priority`` and ``tenant`` they were
    sent with), then ``summary_row``'s entries computed over that
    flow's measured requests with the *run's* window (so the flows' ``throughput_rps``,
    ``goodput_rps`` and ``token_throughput_tps`` add up to the run's), with:
    ``share_of_requests`` and ``share_of_answers`` (of the run's measured requests and of
    its answers), ``good_frac`` (the share of this key's requests that met their targets;
    ``gen_good_frac`` for generation targets), and for generation ``tokens_per_s`` (its
    ``token_throughput_tps``) and ``share_of_tokens`` (of the run's output tokens).
    ``goodput_rps`` and ``gen_goodput_rps`` count each request against its own flow's
    targets; ``slo_ms`` and the like show the target when all of a row's requests share it.
    """
    if key not in records.columns:
        raise ValueError(f"records have no {key!r} column to split by (flow, priority and tenant come from a run "
                         "with mix=...; combine runs with analysis.combine)")
    flows = _flows(mix)
    defaults = dict(slo_ms=slo_ms, ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms)
    keys = [k for k in by if k in records.columns]
    runs = records.groupby(keys, sort=False, dropna=False) if keys else [((), records)]
    n_runs = runs.ngroups if keys else 1
    out = []
    for run_key, run in runs:
        rows = measured(run)
        window = window_s(rows, duration_s)
        targets = _targets_of(rows, flows, defaults)
        good = meets_targets(rows, mix, **defaults)
        run_tokens = tokens_of_run(tokens, keys, run_key, n_runs)
        gen = has_generation(rows)
        n_ok = int(ok(rows).sum())
        total_tokens = float(rows.loc[ok(rows), "n_tokens"].fillna(0).sum()) if gen else math.nan
        for value in _order(rows[key], flows if key == "flow" else {}):
            mask = rows[key].isna() if pd.isna(value) else rows[key].eq(value)
            group, group_targets = rows[mask], targets[mask]
            shared = {t: _shared(group_targets[t]) for t in _TARGETS}
            row = summary_row(group, shared["slo_ms"], window, late_threshold_ms,
                              dict(tokens=run_tokens, ttft_slo_ms=shared["ttft_slo_ms"],
                                   tpot_slo_ms=shared["tpot_slo_ms"]))
            n_good, n_gen_good = good.loc[mask, "good"], good.loc[mask, "gen_good"]
            if window > 0:  # each request against its own target, whether or not the row shares one
                row["goodput_rps"] = int(n_good.sum()) / window if n_good.notna().any() else math.nan
                if gen:
                    row["gen_goodput_rps"] = int(n_gen_good.sum()) / window if n_gen_good.notna().any() else math.nan
            head = {**dict(zip(keys, run_key if isinstance(run_key, tuple) else (run_key,))), key: value}
            if key == "flow":  # what it was sent as
                head.update({c: group[c].iloc[0] if len(group) else None
                             for c in ("priority", "tenant") if c in group.columns})
            extra: dict[str, Any] = {
                "share_of_requests": row["count"] / len(rows) if len(rows) else math.nan,
                "share_of_answers": row["n_ok"] / n_ok if n_ok else math.nan,
                "good_frac": _frac(n_good, row["count"]),
            }
            if gen:
                extra.update(gen_good_frac=_frac(n_gen_good, row["count"]), tokens_per_s=row["token_throughput_tps"],
                             share_of_tokens=row["output_tokens"] / total_tokens if total_tokens else math.nan)
            out.append({**head, **extra, **row})
    if not out:
        return pd.DataFrame(columns=[*keys, key])
    table = tidy_counts(pd.DataFrame(out)).reset_index(drop=True)
    if "priority" in table.columns:  # ints with NA where none was sent, as in the records
        table["priority"] = pd.array(table["priority"].tolist(), dtype="Int64")
    return table


def tokens_by(records: pd.DataFrame, tokens: pd.DataFrame | None = None, key: str = "tenant", bin_s: float = 1.0,
              *, by: Iterable[str] = RUN_KEYS) -> pd.DataFrame:
    """Tokens served per value of ``key`` (a tenant, a flow, a priority) in bins of ``bin_s``.

    Each token event of ``tokens`` (the run's tokens frame) counts in the bin its client-clock
    arrival falls in; without ``tokens`` (or for one-piece answers, which have no token
    events), an answer's ``n_tokens`` count at its ``done_s``. Warm-up is kept: it is part of
    the timeline. Columns: the run keys present in both frames, ``t_s`` (the bin's start, s from
    the run's start), ``key`` (named as given), ``tokens`` and ``tokens_per_s``; every
    (bin, value) pair of a run is present, zero when that value was served nothing then.

    >>> rec = pd.DataFrame({"i": [0, 1], "tenant": ["a", "b"], "n_tokens": [3, 1], "done_s": [1.5, 0.5],
    ...                     "status": 200, "error": ""})
    >>> tok = pd.DataFrame({"i": [0, 0, 0, 1], "k": [0, 1, 2, 0], "t_s": [0.2, 1.1, 1.4, 0.5]})
    >>> tokens_by(rec, tok, bin_s=1.0)[["t_s", "tenant", "tokens"]].values.tolist()
    [[0.0, 'a', 1], [0.0, 'b', 1], [1.0, 'a', 2], [1.0, 'b', 0]]
    """
    if not bin_s > 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s!r}")
    if key not in records.columns:
        raise ValueError(f"records have no {key!r} column (flow, priority and tenant come from a run with mix=...)")
    run = [k for k in by if k in records.columns and (tokens is None or k in tokens.columns)]
    streamed = tokens is not None and len(tokens) > 0
    events = tokens[["i", "t_s", *run]] if streamed else pd.DataFrame(columns=["i", "t_s", *run])
    events = events.assign(tokens=1)
    # answers with tokens but no token events (one-piece answers, or no tokens frame given) count at done_s
    answers = records[ok(records) & records["n_tokens"].fillna(0).gt(0)] if "n_tokens" in records.columns \
        else records.iloc[:0]
    if streamed:
        have = events.groupby(["i", *run], dropna=False).size().rename("_n").reset_index()
        answers = answers.merge(have, on=["i", *run], how="left")
        answers = answers[answers["_n"].isna()]
    lump = pd.DataFrame({"i": answers["i"].to_numpy(), "t_s": answers["done_s"].to_numpy(dtype=float),
                         **{k: answers[k].to_numpy() for k in run},
                         "tokens": answers["n_tokens"].to_numpy(dtype=np.int64)}) if len(answers) else None
    events = events.merge(records[["i", key, *run]], on=["i", *run], how="inner")
    if lump is not None:
        lump = lump.merge(records[["i", key, *run]], on=["i", *run], how="inner")
        events = pd.concat([events, lump], ignore_index=True) if len(events) else lump
    columns = [*run, "t_s", key, "tokens", "tokens_per_s"]
    if events.empty:
        return pd.DataFrame(columns=columns)
    events["t_s"] = np.floor(events["t_s"].to_numpy(dtype=float) / bin_s) * bin_s
    counts = events.groupby([*run, "t_s", key], dropna=False)["tokens"].sum()
    values = _order(counts.index.get_level_values(key).to_series(), {})  # every run shows every value
    frames = []
    for run_key, part in (counts.groupby(level=list(range(len(run))), dropna=False) if run else [((), counts)]):
        part = part.droplevel(list(range(len(run)))) if run else part
        last = part.index.get_level_values("t_s").max()
        bins = np.arange(0, int(round(last / bin_s)) + 1) * bin_s
        grid = pd.MultiIndex.from_product([bins, values], names=["t_s", key])
        filled = part.reindex(grid, fill_value=0).reset_index()
        for k, v in zip(run, run_key if isinstance(run_key, tuple) else (run_key,)):
            filled[k] = v
        frames.append(filled)
    table = pd.concat(frames, ignore_index=True)
    table["tokens"] = table["tokens"].astype("int64")
    table["tokens_per_s"] = table["tokens"] / bin_s
    return table[columns]


def _order(values: pd.Series, flows: dict) -> list:
    """The values of ``values``: a mix's flows in its order first, then the rest sorted (NA last)."""
    seen = pd.unique(values)
    present = [v for v in seen if not pd.isna(v)]
    first = [name for name in flows if name in present]
    rest = sorted((v for v in present if v not in first), key=lambda v: (str(type(v)), v))
    return first + rest + ([seen[pd.isna(seen)][0]] if pd.isna(seen).any() else [])


def _shared(values: pd.Series) -> float | None:
    """The one target all these requests share, else None."""
    distinct = values.dropna().unique()
    return float(distinct[0]) if len(distinct) == 1 and values.notna().all() else None


def _frac(good: pd.Series, count: int) -> float:
    return int(good.sum()) / count if count and good.notna().any() else math.nan
