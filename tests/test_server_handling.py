"""The one error table (labserver.server.handling.describe): every failure reads the same on every route."""

from __future__ import annotations

import pytest

from labserver import wire
from labserver.engine import Expired, Overloaded, ShuttingDown, WorkerDied
from labserver.models import InputRejected, ModelError, OutOfMemory
from labserver.server.handling import ERROR_TABLE, MODEL_FAILED, WORKER_GONE, ClientError, describe


@pytest.mark.parametrize("exc, kind, message, retry", [
    (ClientError("payload_too_large", "too big"), "payload_too_large", "too big", False),
    (InputRejected("no [MASK]"), "bad_request", "no [MASK]", False),
    (Overloaded("queue is full"), "overloaded", "queue is full", True),
    (Expired("too late"), "timeout", "too late", False),
    (ShuttingDown("stopping"), "shutting_down", "stopping", True),
    (WorkerDied("segfault in /secret/path"), "model_unavailable", WORKER_GONE, False),  # the cause stays in the log
    (ModelError("cuda error at 0x7f"), "model_error", MODEL_FAILED, False),
    (OutOfMemory("batch of 64"), "model_error", MODEL_FAILED, False),  # a subclass takes its parent's row
    (KeyError("a model bug"), "model_error", MODEL_FAILED, False),  # anything else: one failed request
])
def test_each_failure_has_one_kind_one_message(exc: Exception, kind: str, message: str, retry: bool) -> None:
    assert describe(exc) == (kind, message, retry)
    assert kind in wire.ERROR_TYPES


def test_every_row_names_a_known_error_type() -> None:
    assert {kind for _, kind, _, _ in ERROR_TABLE} <= set(wire.ERROR_TYPES)
