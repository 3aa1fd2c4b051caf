"""What one generator process is told to send (``Plan``) and the row it writes per request.

``labserver.loadgen`` builds the plans (request numbers, scheduled times, payloads and
flows of a mix, or closed-loop users) and turns the rows that come back into records
(``labserver.load.results`` names their columns from ``ROW_FIELDS``). Sending is not
here: ``labserver.load.worker`` sends a plan, ``labserver.load.processes`` sends several
from spawned processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import wire
from .mix import Flow

__all__ = ["GEN_FIELDS", "HEADER_COLUMNS", "PROBES_IN_FLIGHT", "PROBE_FIELDS", "ROW_FIELDS", "Plan"]

# server header -> record column (loadgen parses them; missing ones stay None here)
HEADER_COLUMNS = {
    "queue_ms": wire.HEADER_QUEUE_MS, "compute_ms": wire.HEADER_COMPUTE_MS,
    "batch_size": wire.HEADER_BATCH_SIZE, "batch_id": wire.HEADER_BATCH_ID,
    "dispatch": wire.HEADER_DISPATCH, "server_ms": wire.HEADER_SERVER_MS,
    "request_id": wire.HEADER_REQUEST_ID, "replica": wire.HEADER_REPLICA,
    "reason": wire.HEADER_REASON,  # why a 503/504 was refused or shed
    "input_tokens": wire.HEADER_INPUT_TOKENS,  # an encoder answer: the tokens its texts are computed with
}
# what a generation answer adds (None/NaN for other modes); token_s is a list of client-clock
# times (s from the run's start), one per token event, that loadgen turns into its tokens frame
GEN_FIELDS = ("first_token_s", "n_tokens", "max_new_tokens", "finish_reason", "token_s")
# flow_k: the request's flow, an index into Plan.flows (-1 without a mix); records name it
ROW_FIELDS = ("i", "process", "scheduled_s", "sent_s", "done_s", "status", "error", "input_chars", "flow_k",
              *HEADER_COLUMNS, *GEN_FIELDS)
PROBE_FIELDS = ("t_s", "latency_ms", "status", "error")
PROBES_IN_FLIGHT = 64  # outstanding probes allowed; later ones are recorded as overflow


@dataclass
class Plan:
    """What one generator process sends; picklable, so it can travel to a spawned process."""

    worker: int
    url: str
    mode: str
    client: str
    timeout_s: float
    max_in_flight: int
    overflow: str
    drain_s: float | None
    index: np.ndarray  # open loop: global request numbers, and their
    scheduled_s: np.ndarray  # send times, and
    texts: list[str] | list[list[str]]  # each request's text(s) (closed loop: a pool to cycle, or empty to use payload)
    users: int = 0  # closed loop from here on
    think_s: float = 0.0
    duration_s: float = math.inf
    max_requests: int | None = None
    payload: Any = None
    seed: int = 0
    probe_url: str | None = None
    probe_interval_s: float | None = None
    new_tokens: np.ndarray | None = None  # mode "generate", open loop: max_new_tokens per request
    lengths: Any = None  # mode "generate", closed loop: a Lengths to draw from as it goes
    stream: bool = True  # generation: ask for server-sent events
    ignore_eos: bool = True  # generation: ask for exactly max_new_tokens
    api: str = "labserver"  # or "openai-completions", "openai-chat", "openai-embeddings" (labserver.load.apis)
    model: str = ""  # OpenAI APIs: the model name every request names
    flows: tuple[Flow, ...] = ()  # a mix's flows (open loop: without payloads, their texts are in texts)
    flow: np.ndarray | None = None  # open loop with a mix: each request's flow, an index into flows
    texts_per_request: int = 1  # above 1: each request a JSON list of this many texts (mode "json")
    headers: dict[str, str] = field(default_factory=dict)  # sent with every request (an API key)

    def mean_gap_s(self) -> float:
        s = self.scheduled_s
        return float(s[-1] - s[0]) / (len(s) - 1) if len(s) > 1 else math.inf

    def rate_per_s(self) -> float:
        return 1.0 / self.mean_gap_s() if self.mean_gap_s() > 0 else math.inf

    def sockets(self) -> int:
        """The most sockets this plan holds open at once: the load's and the probes'."""
        return self.max_in_flight + (PROBES_IN_FLIGHT if self.probe_url else 0)
