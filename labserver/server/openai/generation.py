"""``POST /v1/completions`` and ``POST /v1/chat/completions``: the step engine behind OpenAI's shapes.

The same engine and strategy as ``POST /generate``, and the same way of waiting: one
sequence per prompt is queued, the handler waits for its first token, the client
leaving, or the deadline (``generate.wait_first_token``), so every failure before the
first token is an ordinary error with its status, in OpenAI's shape
(``openai.errors``). Then either one JSON answer, or a stream as the clients parse it:

    data: {chunk}              one per step that made text (chat: the first delta carries the role)
    data: {chunk, choices: []} with stream_options.include_usage: the usage
    data: [DONE]

A failure after the first chunk ends the stream with ``data: {"error": {...}}`` and
``[DONE]``; a client that leaves mid-stream cancels its sequences, which the engine
drops at the next step: the ending is ``/generate``'s (``labserver.server.streaming``).
Text is each sequence's own (``Seq.output``: decoded once, stop strings cut), sent through
``openai.text.TextStream`` (nothing of a stop string streamed).
Each prompt gets ``n`` sequences (choice ``i * n + j``), the later ones submitted with the
first as their ``parent`` so they share its computed prompt blocks; each choice's
log-probabilities go out once each, in OpenAI's shape (``openai.logprobs``). Request
fields: ``openai.params``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import orjson
from starlette.requests import Request
from starlette.responses import Response

from ... import wire
from ...engine import Seq
from ...engine.ending import FinishReason
from ...models import GenModel, Sampling
from ...models.base import prompt_of_ids
from ..handling import ClientError, FastJSON, answer, cache_salt, request_class
from ..runtime import Runtime
from ..streaming import SeqStream, generation_engine, letting_go, wait_all, wait_first_token
from .catalog import check_model, served_name
from .errors import openai_error_body, openai_failure
from .finish import api_word
from .logprobs import chat_logprobs, completion_logprobs, prompt_entries
from .params import COMPLETION_DEFAULT_MAX_TOKENS, GenRequest, ignored_header, parse_request
from .text import TextStream

__all__ = ["post_chat", "post_completions"]

@dataclass
class _Reply:
    """What every chunk and the answer of one request share; each API's shapes are a subclass (``API``)."""

    req: GenRequest
    rid: str
    model: str
    created: int  # unix s
    object: ClassVar[str]  # the answer's "object"
    chunk_object: ClassVar[str]  # a stream chunk's
    id_prefix: ClassVar[str]
    chat: ClassVar[bool] = False  # its request is a conversation (messages, the model's chat template)
    opens_with_role: ClassVar[bool] = False  # the stream's first chunk goes out even with no text (its role)

    @staticmethod
    def default_max_tokens(room: int) -> int:
        """Tokens to generate when the request says nothing (``room``: what the context leaves)."""
        raise NotImplementedError

    def head(self, chunk: bool) -> dict[str, Any]:
        return {"id": self.id_prefix + self.rid, "object": self.chunk_object if chunk else self.object,
                "created": self.created, "model": self.model}

    def choice(self, index: int, text: str, finish: str | None, *, first: bool = False,
               stop_reason: str | None = None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """One choice of a stream chunk."""
        raise NotImplementedError

    def answer(self, index: int, prompt: str, text: str, finish: str, stop_reason: str | None,
               logprobs: dict[str, Any] | None) -> dict[str, Any]:
        """One choice of the one-piece answer."""
        raise NotImplementedError

    def logprobs(self, model: GenModel, entries: list[Any], offset: int) -> dict[str, Any]:
        """Log-probabilities in this API's shape (``offset``: the text offset of the first, completions only)."""
        raise NotImplementedError

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        doc = {**self.head(True), "choices": choices}
        if self.req.include_usage:
            doc["usage"] = usage
        return wire.SSE_DATA + orjson.dumps(doc) + b"\n\n"


class _Completions(_Reply):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl-"

    @staticmethod
    def default_max_tokens(room: int) -> int:
        return COMPLETION_DEFAULT_MAX_TOKENS  # (OpenAI's default)

    def choice(self, index: int, text: str, finish: str | None, *, first: bool = False,
               stop_reason: str | None = None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": stop_reason}

    def answer(self, index: int, prompt: str, text: str, finish: str, stop_reason: str | None,
               logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return self.choice(index, prompt + text if self.req.echo else text, finish, logprobs=logprobs,
                           stop_reason=stop_reason)

    def logprobs(self, model: GenModel, entries: list[Any], offset: int) -> dict[str, Any]:
        return completion_logprobs(model, entries, offset)


class _Chat(_Reply):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    chat = opens_with_role = True

    @staticmethod
    def default_max_tokens(room: int) -> int:
        return room  # (as vLLM: what the context leaves)

    def choice(self, index: int, text: str, finish: str | None, *, first: bool = False,
               stop_reason: str | None = None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def answer(self, index: int, prompt: str, text: str, finish: str, stop_reason: str | None,
               logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": logprobs, "finish_reason": finish}

    def logprobs(self, model: GenModel, entries: list[Any], offset: int) -> dict[str, Any]:
        return chat_logprobs(model, entries)


def usage(seqs: list[Seq]) -> dict[str, Any]:
    """Tokens of the request: each prompt once, however many choices it has (as OpenAI counts)."""
    firsts = [s for s in seqs if s.parent is None]
    prompt = sum(len(s.prompt_ids) for s in firsts)
    completion = sum(len(s.tokens) for s in seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)}}


class _Scores:
    """One choice's log-probabilities, as they are sent: the prompt's first (echo), then each token's once."""

    def __init__(self, reply: _Reply, model: GenModel, seq: Seq, prompt_text: str) -> None:
        self.reply, self.model, self.seq = reply, model, seq
        self.echo = reply.req.echo and reply.req.logprobs is not None  # the prompt's own come first
        self.sent = 0  # of seq.logprobs
        self.offset = len(prompt_text) if reply.req.echo else 0  # text_offset of the next token

    def pending(self) -> dict[str, Any] | None:
        """The log-probabilities not sent yet (None: none asked, or none new)."""
        if self.reply.req.logprobs is None:
            return None
        seq = self.seq
        entries = seq.logprobs[self.sent:]
        offset = self.offset
        if self.echo:
            self.echo, offset = False, 0
            entries = prompt_entries(seq.prompt_ids, seq.prompt_logprobs) + entries
        if not entries:
            return None
        self.sent = len(seq.logprobs)
        out = self.reply.logprobs(self.model, entries, offset)
        if "text_offset" in out:  # (completions: where the next one's text begins)
            self.offset = out["text_offset"][-1] + len(out["tokens"][-1])
        return out


def finish_reason(seq: Seq, text: TextStream) -> str:
    return api_word(FinishReason.STOP if text.stopped else seq.finish_reason)


def chat_template(model: GenModel) -> Callable[[list[dict[str, str]]], str] | None:
    """The tokenizer's own chat template when the model has one (else ``params.render_chat``).

    A template may refuse a conversation (Mistral's: roles must alternate; ``raise_exception``):
    that is a 400 with its words, as the request is the client's to change."""
    tokenizer = model.tokenizer
    if tokenizer is None or not tokenizer.chat_template:
        return None
    from jinja2 import TemplateError  # (transformers renders templates with jinja2)

    def render(messages: list[dict[str, str]]) -> str:
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False,  # type: ignore[no-any-return]
                                                 add_generation_prompt=True)
        except TemplateError as e:
            raise ClientError("bad_request", f"the model's chat template refused these messages: {e}",
                              "messages") from None

    return render


async def _work(rt: Runtime, request: Request, body: bytes, rid: str, t0: float, *, api: type[_Reply]) -> Response:
    engine = generation_engine(rt, f"this server runs the encoder strategy {rt.strategy.name}: it answers "
                                   f"{wire.V1_EMBEDDINGS_PATH}; completions need a gen-* strategy")
    model: GenModel = rt.model  # type: ignore[assignment]
    cfg = rt.config
    req = parse_request(body, chat=api.chat, max_chars=cfg.max_chars, max_tokens_cap=cfg.max_new_tokens,
                        max_prompts=cfg.max_prompts, template=chat_template(model) if api.chat else None)
    check_model(rt, req.model)
    prompts = [model.encode(p) if isinstance(p, str) else prompt_of_ids(model, p) for p in req.prompts]  # (400s)
    priority, tenant = request_class(request, req.priority)
    salt = cache_salt(cfg.cache_isolation, tenant, req.cache_salt)
    grammar = await engine.grammar(req.constraint) if req.constraint is not None else None  # (compiled once: 400s)
    seqs: list[Seq] = []  # choice i is seqs[i]: prompt by prompt, n choices each
    texts: list[str] = []  # the prompt each choice echoes
    with letting_go(seqs):  # whatever fails from the first one queued on (a header too), none is left generating
        for prompt, ids in zip(req.prompts, prompts, strict=True):
            text = prompt if isinstance(prompt, str) else model.text(ids)  # (what echo shows of token ids)
            room = max(1, engine.max_model_len - len(ids))
            limit = req.max_tokens or min(api.default_max_tokens(room), room, cfg.max_new_tokens)
            first = None
            for j in range(req.n):
                seq = engine.submit(ids, limit, ignore_eos=req.ignore_eos, request_id=rid,
                                    sampling=choice_sampling(req.sampling, j), stop=req.stop,
                                    min_tokens=req.min_tokens, priority=priority, tenant=tenant, parent=first,
                                    cache_salt=salt, grammar=grammar)
                first = first or seq
                seqs.append(seq)
                texts.append(text)
        for seq in seqs:
            await wait_first_token(rt, request, seq, t0)
        return await _respond(rt, request, api(req, rid, served_name(rt), int(time.time())), seqs, texts, t0)


async def _respond(rt: Runtime, request: Request, reply: _Reply, seqs: list[Seq], texts: list[str],
                   t0: float) -> Response:
    """Every choice has its first token: the stream, or (once all are answered) the one-piece answer."""
    model: GenModel = rt.model  # type: ignore[assignment]
    req = reply.req
    headers = {wire.HEADER_REQUEST_ID: reply.rid,
               wire.HEADER_QUEUE_MS: f"{(seqs[0].admitted_s - seqs[0].enqueued_s) * 1000:.3f}"}
    if req.ignored:
        headers[wire.HEADER_IGNORED_FIELDS] = ignored_header(req.ignored)
    if seqs[0].replica:
        headers[wire.HEADER_REPLICA] = ",".join(dict.fromkeys(s.replica for s in seqs))  # (n > 1: each its own)
    if req.stream:
        return SeqStream(rt, seqs, reply.rid, t0, _Chunks(reply, seqs, texts, model), headers)
    for seq in seqs:
        await wait_all(request, seq)
    choices = []
    for i, (seq, prompt) in enumerate(zip(seqs, texts, strict=True)):
        text = _text(seq)
        piece = text.push(True)
        reason = finish_reason(seq, text)
        choices.append(reply.answer(i, prompt, piece, reason, _stop_reason(text),
                                    _Scores(reply, model, seq, prompt).pending()))
        if req.return_token_ids:  # (vLLM's: each choice's tokens and its prompt's)
            choices[-1].update(token_ids=list(seq.tokens), prompt_token_ids=list(seq.prompt_ids))
    now = time.perf_counter()
    response = FastJSON({**reply.head(False), "choices": choices, "usage": usage(seqs)},
                        headers={**headers, wire.HEADER_SERVER_MS: f"{(now - t0) * 1000:.3f}"})
    rt.answered(now - t0)
    return response


def choice_sampling(sampling: Sampling | None, j: int) -> Sampling | None:
    """Choice j's sampling: with a seed, seed + j (vLLM's rule), so the choices differ and each is reproducible."""
    if j == 0 or sampling is None or sampling.seed is None:
        return sampling
    return replace(sampling, seed=sampling.seed + j)


def _text(seq: Seq) -> TextStream:
    assert seq.output is not None  # (every engine's submit gives one)
    return TextStream(seq.output)


def _stop_reason(text: TextStream) -> str | None:
    """vLLM's ``stop_reason``: the stop string that ended it, if one did."""
    return text.output.stop_string


class _Chunks:
    """The /v1 stream: a chunk per write with every choice's new text, then usage and ``[DONE]``."""

    def __init__(self, reply: _Reply, seqs: list[Seq], prompts: list[str], model: GenModel) -> None:
        self.reply, self.seqs = reply, seqs
        self.texts = [_text(seq) for seq in seqs]
        self.scores = [_Scores(reply, model, seq, prompt) for seq, prompt in zip(seqs, prompts, strict=True)]
        self.echo = list(prompts) if reply.req.echo else [""] * len(seqs)  # sent before a choice's first text
        self.open_ = set(range(len(seqs)))  # choices not yet finished
        self.ids_sent = [0] * len(seqs)  # return_token_ids: tokens of each choice already sent
        self.first = True

    def pending(self) -> bytes:
        choices = []
        for i in sorted(self.open_):
            seq, text = self.seqs[i], self.texts[i]
            ended = seq.future.done() and not seq.future.cancelled() and seq.future.exception() is None
            piece = text.push(ended)
            reason = finish_reason(seq, text) if ended else None
            scores = self.scores[i].pending()
            if self.echo[i]:
                piece, self.echo[i] = self.echo[i] + piece, ""
            if piece or reason or scores or (self.first and self.reply.opens_with_role):
                choices.append(self.reply.choice(i, piece, reason, first=self.first, logprobs=scores,
                                                 stop_reason=_stop_reason(text) if reason else None))
                if self.reply.req.return_token_ids:  # the tokens made since this choice's last chunk
                    choices[-1]["token_ids"] = seq.tokens[self.ids_sent[i]:]
                    self.ids_sent[i] = len(seq.tokens)
            if ended:
                self.open_.discard(i)
        if not choices:
            return b""
        self.first = False
        return self.reply.chunk(choices)

    def open(self) -> list[Seq]:
        return [self.seqs[i] for i in self.open_]

    def done(self) -> bytes:
        tail = self.reply.chunk([], usage(self.seqs)) if self.reply.req.include_usage else b""
        return tail + wire.SSE_DATA_DONE

    def failed(self, kind: str, message: str, error: BaseException) -> bytes:
        return wire.SSE_DATA + orjson.dumps(openai_error_body(kind, message)) + b"\n\n" + wire.SSE_DATA_DONE


async def post_completions(request: Request) -> Response:
    return await answer(request, lambda *a: _work(*a, api=_Completions), openai_failure)


async def post_chat(request: Request) -> Response:
    return await answer(request, lambda *a: _work(*a, api=_Chat), openai_failure)
