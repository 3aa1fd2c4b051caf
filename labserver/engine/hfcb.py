"""transformers' ContinuousBatchingManager as an engine of its own, for ``gen-hf-cb``.

What this is: an adapter (``HFManager``) and the engine that feeds it (``HFEngine``).
transformers (5.23) can run continuous batching itself:
``model.init_continuous_batching(...)`` returns a ``ContinuousBatchingManager`` with its own
generation thread, FIFO scheduler, paged KV cache and chunked prefill. ``HFManager`` hands
it token ids and turns its results into three callbacks per request (``on_tokens``,
``on_done``, ``on_error``), so the serving side never touches transformers.

What this is not: a scheduler. Every decision about who shares a step is the manager's;
labserver only decides how many requests it hands over (the strategy's ``admit``: one at
a time while fewer than ``max_batch_size`` run), and keeps its queue in front, so 503, 504
before the first token and a client that leaves behave as for the other strategies.
There is no step log: the steps happen inside the manager.

Threads. The manager runs one generation thread. It puts a ``GenerationOutput`` on its
output queue at every step of a streaming request (the *cumulative* generated tokens,
a status, an error string); one reader thread of ours (``hfcb-results``) takes them off
with ``get_result`` and calls the callbacks, **on that reader thread**: marshal them onto
an event loop with ``loop.call_soon_threadsafe``. The manager's other delivery route,
``register_result_handler``, needs a running asyncio loop in the submitting thread and
calls the handler on it, and an output that arrives before the handler is registered
falls back to the shared queue; the reader thread is simpler and works from any thread.

What maps (``ContinuousBatchingConfig``):

- ``max_running`` -> ``max_requests_per_batch``: a cap on requests *per forward pass*, not
  on requests admitted. Beyond it the manager still admits requests and serves them in
  later passes, so the caller should also hold back work (``gen-hf-cb`` does).
- ``max_kv_tokens`` -> ``num_blocks = ceil(max_kv_tokens / page_size)``, with
  ``page_size = PAGE_TOKENS``: the cache holds a multiple of the page size, rounded up.
  Left as None, transformers would take 60% of free RAM on a CPU (90% of a GPU's), so
  ``HFEngine`` sizes it as the step engine sizes its pool (``genbase.kv_budget_tokens``:
  ``max_kv_tokens``, or what ``kv_memory_mb`` holds, else ``max_running`` sequences of the
  context, both bounded). While under 15% of
  blocks are free (its ``safety_margin``) it starts at most one new prompt per step, and
  when the cache is full it re-queues a request with its tokens so far as a new prompt
  (CPU offload is off). One request larger than the whole cache would end its generation
  thread ("No requests can be scheduled and no requests can be offloaded"), failing all
  the others, so ``submit`` rejects it first.
- ``max_batch_tokens`` (tokens per forward pass; a longer prompt is prefilled in chunks) is
  not in labserver's limits: it defaults to the model's context, so any prompt fits one
  pass. Memory it costs up front: an SDPA mask of ``max_batch_tokens x (cache + max_batch_tokens)``
  floats.

Memory: as for labserver's own paged pool (``labserver.models.kvcache``), the whole cache
(``num_blocks x page_size`` tokens x layers x K and V) is allocated up front, here in
``start()``: for gpt2-random, 72 KiB a token, so 32 sequences of 1,024 tokens are 2.3 GB
and about 6 s on a 2-core CPU.

Startup: once the manager runs, one token of a one-token prompt goes through it (a probe)
before the server says it is ready. An architecture transformers loads but its manager
cannot page (GPT-NeoX in transformers 5.24) fails there, so the server does not start,
instead of answering every request with a 500.

Decoding is greedy (``do_sample=False``). ``ignore_eos`` passes ``eos_token_id=-1`` for that
request (the manager keeps only non-negative EOS ids). Works on CPU with SDPA attention
(no flash attention, CUDA graphs, async batching or decode fast path there, which the
manager turns off by itself).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..models import InputRejected, ModelError, ModelLoadError, Sampling, on_fresh_thread
from ..strategies import Admission, GenStrategy
from .genbase import GenCounters, GenEngine, kv_budget_tokens
from .ending import FinishReason
from .sequence import Seq

if TYPE_CHECKING:
    from ..models.paged import PagedLM, TransformersOnly

logger = logging.getLogger(__name__)

__all__ = ["PAGE_TOKENS", "HFEngine", "HFManager"]

PAGE_TOKENS = 32  # KV-cache page size, tokens (transformers' default is 256: coarse for small caches)
_DEFAULT_SEQS = 32  # sequences of full context the cache holds when neither cap is given
_POLL_S = 0.05  # the reader's wait for an output before it checks whether to stop, s
_STOP_TIMEOUT_S = 30.0  # longest wait for the generation thread to end, s
_PROBE_TIMEOUT_S = 120.0  # longest wait for the startup probe's one token, s


@dataclass
class _Request:
    limit: int  # tokens it may generate (max_new_tokens, capped by the model's context)
    on_tokens: Callable[[list[int]], None]
    on_done: Callable[[FinishReason], None]
    on_error: Callable[[Exception], None]
    sent: int = 0  # tokens already passed to on_tokens


class HFManager:
    """Submit token ids, get tokens back through callbacks on the ``hfcb-results`` thread."""

    def __init__(self, gen_model: PagedLM | TransformersOnly, *, max_running: int | None, max_kv_tokens: int | None,
                 max_batch_tokens: int | None = None) -> None:
        from transformers import ContinuousBatchingConfig

        if max_running is not None and max_running < 1:
            raise ValueError(f"max_running must be at least 1 (got {max_running}), or None for no cap")
        if max_kv_tokens is not None and max_kv_tokens < PAGE_TOKENS:
            raise ValueError(f"max_kv_tokens must be at least one page ({PAGE_TOKENS} tokens), got {max_kv_tokens}")
        self.hf_model = gen_model.hf_model
        eos_ids = list(gen_model.eos_ids)
        self.eos_id: int | list[int] | None = eos_ids if len(eos_ids) > 1 else gen_model.eos_id  # (every one)
        self.max_context = gen_model.max_context
        kv_tokens = max_kv_tokens if max_kv_tokens is not None else (max_running or _DEFAULT_SEQS) * self.max_context
        batch_tokens = max_batch_tokens or max(self.max_context, max_running or 0)
        self.cb_config = ContinuousBatchingConfig(
            page_size=PAGE_TOKENS,
            num_blocks=math.ceil(kv_tokens / PAGE_TOKENS),
            max_batch_tokens=batch_tokens,
            max_requests_per_batch=min(max_running, batch_tokens) if max_running else None,  # None: 1024
            seed=0,  # greedy anyway; a fixed seed keeps transformers from logging a random one
        )
        self.manager: Any = None  # transformers' ContinuousBatchingManager, once started
        self._requests: dict[str, _Request] = {}  # request id -> callbacks, while it runs
        self._lock = threading.RLock()  # held while calling back: after cancel() returns, silence
        self._closing = threading.Event()
        self._reader: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Create the manager and its paged cache (here, so a failure raises), start its thread and our reader."""
        from transformers import GenerationConfig

        if self.manager is not None:
            raise RuntimeError("HFManager.start() was already called; make a new HFManager")
        generation = GenerationConfig(do_sample=False, eos_token_id=self.eos_id,
                                      pad_token_id=self.hf_model.config.pad_token_id)
        self.manager = self.hf_model.init_continuous_batching(generation_config=generation,
                                                              continuous_batching_config=self.cb_config)
        self.manager.warmup()  # on CPU this only allocates the cache (no CUDA graphs to capture)
        self.manager.start()
        self._reader = threading.Thread(target=self._read, name="hfcb-results", daemon=True)
        self._reader.start()

    def stop(self) -> None:
        """Stop now (not after the work in flight): each unfinished request gets on_error once."""
        if self.manager is None or self._closing.is_set():
            return
        self._closing.set()
        self.manager.stop(block=True, timeout=_STOP_TIMEOUT_S, hard_stop=True)
        self.manager.destroy()
        if self._reader is not None:
            self._reader.join()
        with self._lock:
            left, self._requests = self._requests, {}
        for rid, req in left.items():
            self._call(rid, req.on_error, ModelError("generation stopped before this request finished"))

    @property
    def alive(self) -> bool:
        """Started, not stopped, and the manager's generation thread still runs."""
        return self.manager is not None and not self._closing.is_set() and self.manager.is_running()

    @property
    def kv_tokens(self) -> int:
        """Tokens the paged cache holds once started (num_blocks x page size, after rounding)."""
        processor = self.manager.batch_processor if self.manager is not None else None
        blocks = processor.cache.num_blocks if processor is not None else self.cb_config.num_blocks
        return blocks * PAGE_TOKENS

    # -- requests -----------------------------------------------------------------------------
    def submit(self, seq_id: int, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool,
               on_tokens: Callable[[list[int]], None], on_done: Callable[[FinishReason], None],
               on_error: Callable[[Exception], None]) -> None:
        """Hand one request to the manager. Errors found here call on_error at once, on this thread."""
        rid = str(seq_id)
        # the last generated token is never fed back: a prompt of P tokens leaves room for context - P + 1
        limit = min(max_new_tokens, self.max_context - len(prompt_ids) + 1)
        if not self.alive:
            on_error(ModelError("transformers' continuous batching manager is not running"))
            return
        if not prompt_ids or limit < 1:
            on_error(InputRejected(f"a prompt of {len(prompt_ids)} tokens leaves no room in "
                                   f"{self.max_context} tokens of context"))
            return
        if len(prompt_ids) + limit > self.kv_tokens:  # the manager would fail *every* request and stop
            on_error(InputRejected(f"needs {len(prompt_ids) + limit} KV-cache tokens; the manager's cache holds "
                                   f"{self.kv_tokens}: ask for fewer tokens or raise max_kv_tokens"))
            return
        with self._lock:
            if rid in self._requests:
                raise ValueError(f"sequence {seq_id} is already running in the manager")
            self._requests[rid] = _Request(limit, on_tokens, on_done, on_error)
        accepted = self.manager.add_request(list(prompt_ids), request_id=rid, max_new_tokens=limit,
                                            streaming=True, eos_token_id=-1 if ignore_eos else self.eos_id)
        if accepted is None:  # the manager is stopping or crashed: it dropped the request
            with self._lock:
                mine = self._requests.pop(rid, None) is not None  # (else stop() already answered it)
            if mine:
                on_error(ModelError("transformers' continuous batching manager refused the request (stopping)"))

    def cancel(self, seq_id: int) -> None:
        """Stop decoding it and free its cache. After this returns, none of its callbacks run."""
        rid = str(seq_id)
        with self._lock:
            known = self._requests.pop(rid, None) is not None
        if known and self.manager is not None:
            self.manager.cancel_request(rid)  # a queue put: the generation thread drops it before its next step

    # -- the reader thread ------------------------------------------------------------------
    def _read(self) -> None:
        while not self._closing.is_set():
            out = self.manager.get_result(timeout=_POLL_S)
            if out is not None:
                self._deliver(out)
            elif not self.manager.is_running():  # it crashed: its thread failed what it held (delivered above)
                self._fail_all(self.manager.background_thread_status.fatal_error)
                self._closing.wait(_POLL_S)

    def _deliver(self, out: Any) -> None:
        """One GenerationOutput (cumulative tokens) -> new tokens, then done or error if it ended."""
        from transformers.generation.continuous_batching.requests import RequestStatus

        with self._lock:
            req = self._requests.get(out.request_id)
            if req is None:  # cancelled, or already answered
                return
            if out.is_finished():
                del self._requests[out.request_id]
            new = out.generated_tokens[req.sent:]
            req.sent = len(out.generated_tokens)
            if out.status == RequestStatus.FAILED:
                self._call(out.request_id, req.on_error, ModelError(f"transformers' manager: {out.error}"))
                return
            if new:
                self._call(out.request_id, req.on_tokens, new)
            if out.status == RequestStatus.FINISHED:  # length first, as labserver.engine.step.Seq.emit decides
                self._call(out.request_id, req.on_done,
                           FinishReason.LENGTH if req.sent >= req.limit else FinishReason.EOS)

    def _fail_all(self, error: BaseException | None) -> None:
        with self._lock:
            left, self._requests = self._requests, {}
            for rid, req in left.items():
                self._call(rid, req.on_error, ModelError(f"transformers' manager stopped: {error}"))

    @staticmethod
    def _call(rid: str, callback: Callable[[Any], None], arg: Any) -> None:
        try:
            callback(arg)
        except Exception:  # one bad callback must not end the reader for every other request
            logger.exception("callback for request %s failed", rid)


def _check_transformers() -> None:
    """The manager's configuration as ``HFManager`` writes it (``page_size``: transformers 5.24 takes it;
    5.17's has no such field), else a startup error that says which transformers this is."""
    import transformers
    from transformers import ContinuousBatchingConfig

    try:
        ContinuousBatchingConfig(page_size=PAGE_TOKENS, num_blocks=1, max_batch_tokens=PAGE_TOKENS, seed=0)
    except TypeError as e:
        raise ModelLoadError(f"gen-hf-cb drives transformers' continuous batching manager as transformers 5.24 "
                             f"configures it; this transformers ({transformers.__version__}) does not take that "
                             f"configuration ({e}): upgrade transformers, or serve gen-continuous") from None


class HFEngine(GenEngine):
    """``gen-hf-cb``: queued sequences handed to transformers' manager, as many as the strategy admits."""

    def __init__(self, strategy: GenStrategy, model: PagedLM | TransformersOnly, **kwargs: Any) -> None:
        _check_transformers()  # at startup: a manager that cannot be built would fail the worker later
        if strategy.limits.speculative:
            raise ModelLoadError(f"{strategy.name} runs transformers' own manager, which verifies no guesses: "
                                 "speculative decoding runs on labserver's step engine (gen-continuous, gen-paged)")
        super().__init__(strategy, model, GenCounters(), **kwargs)
        self._kv_tokens = kv_budget_tokens(self.limits, model)  # (ModelLoadError at startup: kv_memory_mb unknowable)
        self.in_flight: list[Seq] = []  # handed over and not yet answered: the running ones
        self._room = asyncio.Event()  # set whenever one leaves
        self._started = asyncio.Event()  # set once the manager has made its probe's token, or failed to
        self._start_error: ModelLoadError | None = None
        self._manager: HFManager | None = None  # once started: the manager the sequences are handed to

    @property
    def running(self) -> list[Seq]:
        return self.in_flight

    scores = False  # transformers' manager hands back tokens, not their scores

    def check(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling | None,
              stop: Sequence[str], min_tokens: int) -> None:
        super().check(prompt_ids, max_new_tokens, sampling, stop, min_tokens)
        for name, asked in (("temperature", sampling is not None and not sampling.greedy), ("stop", bool(stop)),
                            ("min_tokens", min_tokens > 0)):
            if asked:
                raise InputRejected(f'"{name}": {self.strategy.name} runs transformers\' continuous batching '
                                    "manager, which decodes greedily to EOS or max_tokens; serve with "
                                    "gen-continuous for sampling, stop strings and min_tokens", param=name)

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        manager = HFManager(self.model, max_running=self.limits.max_batch_size,
                            max_kv_tokens=self._kv_tokens)  # (the step engine's budget: tokens, bytes or context)
        # warm-up takes seconds, off the loop; on a thread that ends, so the manager's generation thread
        # is the only one left with an OpenMP team (models.on_fresh_thread says why that matters)
        try:
            await asyncio.to_thread(on_fresh_thread, manager.start)
            await self._probe(manager, loop)
        except Exception as e:  # at startup: the server does not start (Runtime awaits ready())
            self._start_error = e if isinstance(e, ModelLoadError) else ModelLoadError(
                f"transformers' continuous batching manager cannot run {self.model.name}: {type(e).__name__}: {e}")
            manager.stop()
            return
        finally:
            self._started.set()
        try:
            while True:
                joining, reason, _ = Admission(*await self.strategy.admit(self.queue, self.running, self.clock))  # type: ignore[attr-defined]
                if not joining:
                    self._room.clear()
                    await self._room.wait()
                    continue
                for seq in self.live(joining, self.clock(), "no first token before timeout_ms"):
                    self.counters.prefill_reasons[reason] += 1
                    self._hand_over(manager, loop, seq)
        finally:
            manager.stop()

    async def ready(self) -> None:
        """Once the manager has started and made one token: an architecture it cannot page fails here."""
        await self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    async def _probe(self, manager: HFManager, loop: asyncio.AbstractEventLoop) -> None:
        """One token of one prompt through the manager (sequence 0; requests count from 1), before any request."""
        answer: asyncio.Future[Exception | None] = loop.create_future()

        def finish(error: Exception | None) -> None:
            loop.call_soon_threadsafe(lambda: answer.done() or answer.set_result(error))

        manager.submit(0, [self.model.eos_id or 0], 1, True, lambda tokens: None, lambda reason: finish(None), finish)
        error = await asyncio.wait_for(answer, _PROBE_TIMEOUT_S)
        if error is not None:
            raise ModelLoadError(f"transformers' continuous batching manager cannot run {self.model.name}: {error}")

    def _hand_over(self, manager: HFManager, loop: asyncio.AbstractEventLoop, seq: Seq) -> None:
        def on_tokens(tokens: list[int]) -> None:
            loop.call_soon_threadsafe(self._tokens, seq, tokens)

        def on_done(reason: FinishReason) -> None:
            loop.call_soon_threadsafe(self._done, seq, reason, None)

        def on_error(err: Exception) -> None:
            loop.call_soon_threadsafe(self._done, seq, None, err)

        def left(_: object) -> None:  # the client gone (its future cancelled): it ends here too
            self._done(seq, None, None)

        seq.admitted_s = self.clock()
        self._manager = manager
        self.in_flight.append(seq)
        self.counters.requests_prefilled += 1
        seq.future.add_done_callback(left)
        manager.submit(seq.sid, seq.prompt_ids, seq.max_new_tokens, seq.ignore_eos, on_tokens, on_done, on_error)

    def _tokens(self, seq: Seq, tokens: list[int]) -> None:
        now = self.clock()
        for token in tokens:
            if seq.finished or seq.future.done():
                return
            self.emit(seq, token, now)
            self.counters.tokens_generated += 1

    def _done(self, seq: Seq, reason: FinishReason | None, error: BaseException | None) -> None:
        """The manager finished it (``reason``) or failed on it (``error``), or its client left (neither)."""
        if seq.settled:
            return
        if error is not None:
            self.counters.items_failed += 1
            self.end(seq, FinishReason.ERROR, error)
        elif reason is not None or seq.finished:
            self.end(seq, seq.finish_reason if seq.finished else reason)  # type: ignore[arg-type]
        else:
            self.counters.left_while_generating += 1
            self.end(seq, FinishReason.ABORT)

    def let_go(self, seq: Seq) -> None:
        """Out of the running batch; the manager stops decoding one it was still making (left, cut short)."""
        if seq in self.in_flight:
            self.in_flight.remove(seq)
            if not seq.finished and self._manager is not None:
                self._manager.cancel(seq.sid)
        self._room.set()
