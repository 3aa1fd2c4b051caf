"""Serving strategies: the rule that decides who is computed next, swappable by name, one registry.

- encoders (``kind = "encode"``): ``collect(queue, clock)`` takes items from a queue with
  one waiting primitive, ``await queue.get(timeout_s)`` (None on timeout), plus
  ``queue.empty()``, and returns the batch and why it left. One model call answers it.
- generation (``kind = "generate"``, ``gen-*``): ``admit(queue, running, clock)`` returns
  the sequences that join the running batch at this step boundary (one model call per token),
  ``order`` in what order the waiting are considered, ``fits`` how much KV memory a sequence
  must find to join, ``compose`` the model calls of a step, ``victim`` whom to preempt and
  ``leaving`` who leaves after a call. The engine's scheduler asks; it decides nothing itself.

One room: ``base`` (``Limits``, ``Strategy``, the registry), ``encode`` and ``generate`` (the
rules), ``steps`` (how a generation step is composed: the prefill rules, one class each),
``overload`` (who goes first under overload); everything is importable from here.

The rest (dropping the gone, running the model, answering) is the engine's, so a rule
is testable on a virtual clock without HTTP or torch (``labserver.engine.virtual``).
``offload = True`` runs the model on a dedicated thread instead of the event loop.
Adding a strategy: subclass ``Strategy`` (or a ``GenStrategy``), set ``name``, write
``collect`` (or override the one rule that differs: ``admit``, ``order``, ...), decorate it
with ``@register``. Nothing else changes.
"""

from __future__ import annotations

from .base import (STRATEGIES, Admission, Batch, Clock, Limits, Queue, Strategy, describe, make_strategy, register,
                   strategy_names)
from .queueing import BatchCost
from .steps import PREFILLS, Call, PrefillRule, register_prefill
from .encode import SLO, Adaptive, Deadline, Naive, PerFetch, Thread, Tokens
from .generate import GenContinuous, GenHFContinuous, GenNaive, GenPaged, GenStatic, GenStrategy, Running

__all__ = ["SLO", "STRATEGIES", "Adaptive", "Admission", "Batch", "BatchCost", "Call", "Clock", "Deadline", "GenContinuous",
           "GenHFContinuous", "GenNaive", "GenPaged", "GenStatic", "GenStrategy", "Limits", "Naive", "PerFetch", "Queue",
           "PREFILLS", "PrefillRule", "Running", "Strategy", "Thread", "Tokens", "describe", "make_strategy", "register",
           "register_prefill", "strategy_names"]
