"""What load-test records say: summaries, token metrics, batches, sweeps, queueing theory.

- ``records``: stacking runs (``combine``), the rows every figure counts (``measured``,
  ``ok``, ``window_s``), batches and request phases reconstructed from the server's headers;
- ``summary``: ``summarize`` / ``summarize_runs``, the one summary (one name, one formula per figure);
- ``tokens``: TTFT, TPOT, inter-token latency and goodput of generation runs;
- ``flows``: a mix's flows (or priority classes, or tenants) each judged by its own targets,
  and tokens served per tenant over time;
- ``sweep``: the highest offered rate that meets a latency SLO;
- ``trust``: when a percentile has enough samples and when late sends matter;
- ``theory``: M/D/1, M/M/1 and M/G/1 predictions to hold measurements against;
- ``padding``: the tokens batches compute beyond their texts' own (from the server's batch log).

Nothing here knows of HTTP or matplotlib.
"""

from __future__ import annotations

from .flows import meets_targets, summarize_flows, tokens_by
from .padding import batch_frame, padding_share
from .records import (RUN_KEYS, batch_size_counts, batches, combine, measured, ok, request_phases, run_keys,
                      unpack, window_s)
from .summary import PERCENTILE_METHOD, PERCENTILES, summarize, summarize_runs, summary_row
from .sweep import SweepResult, sweep
from .theory import (busy_cycles_ms, capacity_rps, md1_mean_response_ms, mg1_mean_response_ms, mm1_mean_response_ms,
                     mm1_response_quantile_ms, utilization)
from .tokens import combine_tokens, decode_calls, gen_summary, itl_ms
from .trust import MIN_P99_SAMPLES, enough, late_matters, trusted

__all__ = [
    "MIN_P99_SAMPLES",
    "PERCENTILES",
    "PERCENTILE_METHOD",
    "RUN_KEYS",
    "SweepResult",
    "batch_frame",
    "batch_size_counts",
    "batches",
    "busy_cycles_ms",
    "capacity_rps",
    "enough",
    "late_matters",
    "padding_share",
    "combine",
    "combine_tokens",
    "decode_calls",
    "gen_summary",
    "itl_ms",
    "md1_mean_response_ms",
    "measured",
    "meets_targets",
    "mg1_mean_response_ms",
    "mm1_mean_response_ms",
    "mm1_response_quantile_ms",
    "ok",
    "request_phases",
    "run_keys",
    "summarize",
    "summarize_flows",
    "summarize_runs",
    "summary_row",
    "sweep",
    "tokens_by",
    "trusted",
    "unpack",
    "utilization",
    "window_s",
]
