"""Answers in a shape: a grammar's mask over the vocabulary at every step (xgrammar), and its compiled grammars.

A ``Constraint`` is what a request asks for, as plain data (it crosses processes to a
replica): a JSON schema, any JSON object, a regular expression, one of a list of strings,
or an EBNF grammar (vLLM's ``structured_outputs`` kinds). ``Grammars`` compiles it once
against one model's vocabulary, on a thread of its own (xgrammar lets go of the GIL), bounded
by ``timeout_s``, and keeps the last ``CACHE_SIZE`` compiled grammars by constraint: a second
request with the same schema costs no compile. Each sequence gets a ``Matcher`` of its own.

At every step, before a token is chosen, ``apply_masks`` fills one bitmask row per
constrained sequence (a bit per token: may it come next?) and sets the scores of every
token the grammar forbids to -inf, for the whole batch in one call; greedy or sampled, the
choice is then among the allowed tokens only. The engine advances a sequence's matcher with
every token it emits (``Seq.emit``); once the grammar has ended (it allows nothing but an end
token, and that was chosen), so does the answer. A preempted sequence keeps its tokens and
so its matcher: its recompute resumes where the grammar stands.

What this is not: tool calling, or a check of answers after the fact; the mask alone keeps
an answer in the grammar's language (a budget that ends first leaves a prefix of one).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .base import InputRejected

__all__ = ["CACHE_SIZE", "COMPILE_TIMEOUT_S", "KINDS", "Constraint", "Grammar", "Grammars", "Matcher",
           "apply_masks"]

KINDS = ("json", "json_object", "regex", "choice", "grammar")  # vLLM's structured_outputs kinds served here
CACHE_SIZE = 64  # compiled grammars kept per model (the least recently used goes first)
COMPILE_TIMEOUT_S = 10.0  # a compile not done by then is refused (it runs on; its thread is one of COMPILERS)
COMPILERS = 2  # threads that compile: slow compiles never hold more than these (requests meanwhile: refused)
_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")  # xgrammar's "[time] file:line: "


@dataclass(frozen=True)
class Constraint:
    """What shape an answer must take; plain, hashable data (the compiled-grammar cache's key)."""

    kind: str  # one of KINDS
    spec: str = ""  # json: the schema as JSON text; regex: the pattern; choice: the choices as a JSON list;
    #   grammar: EBNF; json_object: ""
    any_whitespace: bool = True  # json: whitespace between tokens as the model likes (vLLM's disable_any_whitespace)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")


@dataclass
class Grammar:
    """A constraint compiled for one vocabulary (``compiled`` None: a router's, compiled by the replica)."""

    constraint: Constraint
    compiled: Any = None  # an xgrammar CompiledGrammar
    owner: Grammars | None = field(default=None, repr=False)  # counts the masks its matchers fill

    def matcher(self) -> Matcher | None:
        return None if self.compiled is None else Matcher(self)


class Matcher:
    """One sequence's place in its grammar: which tokens may come next, advanced by each token emitted."""

    def __init__(self, grammar: Grammar) -> None:
        import xgrammar as xgr

        self.grammar = grammar
        self._m = xgr.GrammarMatcher(grammar.compiled)
        self.vocab_size: int = grammar.compiled.tokenizer_info.vocab_size
        self.rejected = 0  # tokens emitted that the grammar did not allow (none, when the mask was applied)

    @property
    def ended(self) -> bool:
        """The grammar is done: its end token was accepted, nothing may follow."""
        return bool(self._m.is_terminated())

    def accept(self, token: int) -> bool:
        """Advance past ``token``; True when that ended the grammar (the answer is complete)."""
        if self.ended:
            return True
        if not self._m.accept_token(token):
            self.rejected += 1
        return self.ended

    def fill(self, bitmask: Any, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def allowed(self) -> list[int]:
        """The tokens the grammar allows next, in id order (what the mask leaves; for lessons and fakes)."""
        import torch
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.fill(bitmask, 0)
        bits = (bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [words, 32], low bit first
        return [int(t) for t in bits.flatten()[:self.vocab_size].nonzero()[:, 0]]


def apply_masks(scores: Any, matchers: Sequence[Matcher | None]) -> None:
    """Row i of ``scores`` [rows, vocab] keeps only what ``matchers[i]`` allows (-inf elsewhere), in place, all rows
    in one call; a row without a matcher (or whose grammar has ended) is left as it is."""
    rows = [i for i, m in enumerate(matchers) if m is not None and not m.ended]
    if not rows:
        return
    import xgrammar as xgr

    start = time.perf_counter()
    first = matchers[rows[0]]
    assert first is not None
    bitmask = xgr.allocate_token_bitmask(len(matchers), first.vocab_size)
    for i in rows:
        matchers[i].fill(bitmask, i)  # type: ignore[union-attr]
    xgr.apply_token_bitmask_inplace(scores, bitmask, vocab_size=min(first.vocab_size, scores.shape[-1]),
                                    indices=rows)
    owner = first.grammar.owner
    if owner is not None:
        owner.masked(time.perf_counter() - start, len(rows))


class Grammars:
    """One model's compiled grammars, cached by constraint; compiles off the event loop and off the model thread."""

    def __init__(self, model: Any, *, timeout_s: float = COMPILE_TIMEOUT_S, cache_size: int = CACHE_SIZE) -> None:
        self.model, self.timeout_s, self.cache_size = model, timeout_s, cache_size
        self._cache: OrderedDict[Constraint, Grammar] = OrderedDict()
        self._compiling: dict[Constraint, asyncio.Future[Grammar]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: Any = None
        self._lock = threading.Lock()  # (the compiler is made once, by whichever thread asks first)
        self.compiles = 0  # grammars compiled
        self.hits = 0  # requests whose grammar was in the cache (or being compiled for another)
        self.refused = 0  # constraints refused: malformed, or not compiled within timeout_s
        self.compile_s = 0.0  # spent compiling, s (the vocabulary's preparation, once, included)
        self.mask_s = 0.0  # spent filling and applying masks, s (on the model thread)
        self.mask_rows = 0  # rows masked

    def masked(self, seconds: float, rows: int) -> None:
        self.mask_s += seconds
        self.mask_rows += rows

    async def compile(self, constraint: Constraint) -> Grammar:
        """The constraint's grammar: cached, or compiled now on a compiling thread. InputRejected (a 400) for one the
        compiler refuses (its words) or that is not compiled within ``timeout_s``."""
        grammar = self._cache.get(constraint)
        if grammar is not None:
            self._cache.move_to_end(constraint)
            self.hits += 1
            return grammar
        pending = self._compiling.get(constraint)
        if pending is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(COMPILERS, thread_name_prefix="labserver-grammar")
            loop = asyncio.get_running_loop()
            pending = asyncio.wrap_future(self._pool.submit(self._compile, constraint), loop=loop)
            self._compiling[constraint] = pending
            pending.add_done_callback(lambda f: self._done(constraint, f))
        else:
            self.hits += 1
        try:
            return await asyncio.wait_for(asyncio.shield(pending), self.timeout_s)
        except TimeoutError:
            self.refused += 1
            raise InputRejected(f"this {constraint.kind} was not compiled within {self.timeout_s:g} s; simplify it "
                                "(fewer properties, smaller repetition counts)", "response_format") from None

    def _done(self, constraint: Constraint, future: asyncio.Future[Grammar]) -> None:
        """A compile finished (in time or not): kept in the cache if it compiled, forgotten if not."""
        self._compiling.pop(constraint, None)
        if future.cancelled() or future.exception() is not None:
            if not future.cancelled() and isinstance(future.exception(), InputRejected):
                self.refused += 1
            return
        self._cache[constraint] = future.result()
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def _compile(self, c: Constraint) -> Grammar:
        """On a compiling thread: the compiler's own words for what it refuses."""
        start = time.perf_counter()
        try:
            compiler = self._compiler_for_model()
            if c.kind in ("json", "json_object"):
                separators = None if c.any_whitespace else (",", ":")
                compiled = compiler.compile_json_schema(c.spec or '{"type": "object"}',
                                                        any_whitespace=c.any_whitespace, separators=separators)
            elif c.kind == "regex":
                compiled = compiler.compile_regex(c.spec)
            elif c.kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(json.loads(c.spec)))
            else:
                compiled = compiler.compile_grammar(c.spec)
        except RuntimeError as e:
            raise InputRejected(f"the {c.kind} does not compile: {_PREFIX.sub('', str(e)).strip()}",
                                "response_format") from None
        finally:
            self.compile_s += time.perf_counter() - start
        self.compiles += 1
        return Grammar(c, compiled, self)

    def _compiler_for_model(self) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:  # (installed by make install, without its declared dependencies)
                    raise InputRejected("structured outputs need xgrammar, which is not installed here: pip install "
                                        "--no-deps -r requirements-model.txt", "response_format") from None
                self._compiler = xgr.GrammarCompiler(tokenizer_info(self.model), max_threads=1, cache_enabled=False)
            return self._compiler


def tokenizer_info(model: Any) -> Any:
    """xgrammar's view of a model's vocabulary: every token's bytes, and the tokens that end an answer."""
    import xgrammar as xgr

    if model.tokenizer is not None:
        return xgr.TokenizerInfo.from_huggingface(model.tokenizer, vocab_size=model.vocab_size,
                                                  stop_token_ids=list(model.eos_ids))
    return xgr.TokenizerInfo([model.token_bytes(t) for t in range(model.vocab_size)], xgr.VocabType.RAW,
                             vocab_size=model.vocab_size, stop_token_ids=list(model.eos_ids))


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF for exactly one of ``choices`` (vLLM's rule: each an escaped string literal, joined by ``|``)."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}

    def literal(s: str) -> str:
        return "".join(escapes.get(ch, f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch) for ch in s)

    return "root ::= " + " | ".join(f'"{literal(c)}"' for c in choices)
