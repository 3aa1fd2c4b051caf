"""What travels on the wire between a labserver server and any client.

The server writes these headers on every answered request so that a client (the
load generator, curl, a notebook) can split a request's latency into the server's
own parts. The load generator reads them by name and knows nothing else of the
server: it can load any URL, and simply finds the headers missing on a peer.

Error bodies always have the shape ``{"error": {"type": ..., "message": ...,
"request_id": ...}}``; the ``type`` values are listed in ``ERROR_TYPES``.
"""

from __future__ import annotations

import os
import sys

API_KEY_ENV = "LABSERVER_API_KEY"  # comma-separated keys: a server started without its own takes them, a client sends
#   the first


def env_api_keys() -> tuple[str, ...]:
    """The keys in ``LABSERVER_API_KEY`` (comma-separated), for a server started without its own."""
    return tuple(k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip())


def env_api_key() -> str | None:
    """The first of them, which a client in the same environment sends; None without any."""
    keys = env_api_keys()
    return keys[0] if keys else None


HEADER_REQUEST_ID = "x-request-id"
HEADER_QUEUE_MS = "x-queue-ms"  # time from enqueue to its batch's dispatch, ms
HEADER_COMPUTE_MS = "x-compute-ms"  # model time of the batch it rode in, ms
HEADER_BATCH_SIZE = "x-batch-size"  # items in that batch
HEADER_BATCH_ID = "x-batch-id"  # server-wide batch counter, for timelines
HEADER_DISPATCH = "x-dispatch-reason"  # why that batch left: full, deadline, idle, ...
HEADER_SERVER_MS = "x-server-ms"  # the handler's start (before the body is read) to the response, ms
HEADER_REPLICA = "x-replica"  # behind a router (labserver serve --replicas N): the replica that answered
HEADER_REASON = "x-reason"  # on a 503 or 504: why it was refused or shed (queue-full, codel, deadline, expired, ...)
HEADER_INPUT_TOKENS = "x-input-tokens"  # encoders: tokens the model computes for the request's texts (its count)
# sent by a client: the request's priority class (lower is served first, as vLLM's "priority"; default 0)
# and its tenant (fair shares are kept per tenant; default "")
HEADER_PRIORITY = "x-priority"
HEADER_TENANT = "x-tenant"

SERVER_HEADERS = (
    HEADER_REQUEST_ID,
    HEADER_QUEUE_MS,
    HEADER_COMPUTE_MS,
    HEADER_BATCH_SIZE,
    HEADER_BATCH_ID,
    HEADER_DISPATCH,
    HEADER_SERVER_MS,
    HEADER_REPLICA,
    HEADER_REASON,
    HEADER_INPUT_TOKENS,
)

# error "type" -> HTTP status it travels with
ERROR_TYPES: dict[str, int] = {
    "bad_request": 400,
    "unauthorized": 401,  # no valid API key (--api-key)
    "forbidden": 403,  # a Host this loopback server does not answer to
    "not_found": 404,
    "method_not_allowed": 405,
    "payload_too_large": 413,
    "unsupported_media_type": 415,  # a POST to /predict, /generate or /v1/* that is not JSON
    "model_error": 500,
    "internal": 500,
    "model_unavailable": 503,
    "overloaded": 503,
    "shutting_down": 503,
    "timeout": 504,
}

# -- generation: POST /generate ---------------------------------------------------------
# Request: JSON {"prompt": str, "max_new_tokens": int, "stream": bool, "ignore_eos": bool}
# (only "prompt" is required). Without "stream" the answer is one JSON object:
#   {"text", "tokens": [ids], "finish_reason": "length" | "eos", "prompt_tokens",
#    "generated_tokens", "timing": {...}, "note"?}
# With "stream": true the answer is text/event-stream. Its headers (status 200) go out
# with the first token, so anything that fails before it (400, 413, 503, 504, a prompt
# the model fails on) is an ordinary JSON error with its status. Then one event per
# token and one final event:
#   event: token\ndata: {"index": k, "id": id, "text": "..."}\n\n
#   event: done\ndata: {same fields as the JSON answer}\n\n
# or, if the model fails after the first token, a final
#   event: error\ndata: {"error": {"type", "message", "request_id"}}\n\n
GENERATE_PATH = "/generate"
SSE_TOKEN = b"event: token\n"
SSE_DONE = b"event: done\n"
SSE_ERROR = b"event: error\n"
# "timing" in the JSON answer and in the done event (server clock, ms from the handler's start):
TIMING_FIELDS = ("queue_ms", "ttft_ms", "server_ms", "decode_calls", "mean_decode_batch", "cached_tokens", "preemptions",
                 "prefilled_ms", "transfer_ms")  # (the last two: disaggregated serving's TTFT split, else null)

# -- the OpenAI-compatible API: /v1/* ----------------------------------------------------
# The same engines behind the paths and shapes the `openai` SDK, vLLM's `bench serve` and
# guidellm speak (docs/openai.md). A stream is server-sent events without event names:
#   data: {chunk}\n\n ... [data: {chunk with "choices": [] and "usage"}\n\n] data: [DONE]\n\n
# and a failure after the first chunk is  data: {"error": {...}}\n\n  then  data: [DONE]\n\n.
# Errors are {"error": {"message", "type", "param", "code"}} with the statuses of ERROR_TYPES.
V1_MODELS_PATH = "/v1/models"
V1_COMPLETIONS_PATH = "/v1/completions"
V1_CHAT_PATH = "/v1/chat/completions"
V1_EMBEDDINGS_PATH = "/v1/embeddings"
SSE_DATA = b"data: "
SSE_DATA_DONE = b"data: [DONE]\n\n"
HEADER_IGNORED_FIELDS = "x-ignored-fields"  # request fields accepted but not used, comma-separated


def allow_open_files(n: int) -> int:
    """Raise this process's soft limit on open files to ``n`` where the hard limit allows; the soft limit now.

    Each open connection is a file on both ends: a server holding ``max_connections`` and a
    load generator keeping ``max_in_flight`` requests out need that many, and a desktop's
    usual soft limit of 1,024 would fail them first (EMFILE), in the middle of a run.
    """
    if sys.platform == "win32":
        return n  # (no such limit)
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        want = n if hard == resource.RLIM_INFINITY else min(n, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return n if soft == resource.RLIM_INFINITY else soft
