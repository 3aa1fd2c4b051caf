"""Reading an OpenAI completions or chat request: what is honoured, what is refused, what is ignored.

Three kinds of field, as the benchmark clients need them to be (they send fields a
server may not use, and break on a server that rejects them):

- honoured: ``model``, ``prompt`` (a string, a list of strings, token ids: a list of
  integers or a list of such lists, as vLLM takes them) / ``messages``,
  ``max_tokens`` (chat: ``max_completion_tokens`` first), ``stream``,
  ``stream_options.include_usage``, ``temperature``, ``top_p``, ``seed``, ``stop``,
  ``n`` (choices per prompt; with a seed, choice j draws with seed + j, as vLLM does),
  ``best_of`` equal to ``n``, ``logprobs`` (completions: 0 to 5 alternatives; chat:
  true, with ``top_logprobs`` 0 to 20), ``echo`` (completions: the prompt before the
  answer; with ``logprobs``, the prompt's log-probabilities too), and vLLM's
  ``ignore_eos``, ``min_tokens``, ``cache_salt`` (a non-empty string of at most
  ``MAX_CACHE_SALT_CHARS``: only requests with the same salt share prefix-cache blocks) and
  ``return_token_ids`` (each choice's ``token_ids``, and the prompt's ``prompt_token_ids``),
  and the answer's shape: ``response_format`` (``json_object``, ``json_schema``) and vLLM's
  ``structured_outputs`` (``openai.structured``);
- refused with a 400 that says why: a value that asks for what this server cannot do
  (``best_of`` other than ``n``, ``suffix``, ``logit_bias``, tools, a ``structural_tag``
  shape, images);
- ignored: everything else (``user``, ``frequency_penalty``, ``presence_penalty``,
  ``repetition_penalty``, ``top_k`` ...): accepted, and named in the answer's
  ``x-ignored-fields`` header and in the log (at debug level: nothing a client names is
  kept). A field name that is not printable ASCII, or is over ``MAX_FIELD_CHARS``, is a
  400 naming it, before anything is kept or echoed.

A ``temperature`` above 0 and below ``MIN_TEMPERATURE`` is raised to it (vLLM's clamp:
dividing the scores by 1e-300 makes infinities); ``top_p`` 0 is greedy (a nucleus of the
most likely token alone); ``stop`` strings are at most ``MAX_STOP_CHARS`` long. What OpenAI's
published schema allows is honoured or refused with a 400, never a 500: an integer may be
written ``2.0`` (JSON Schema's ``integer``), a message may have ``function``, ``tool``'s
deprecated role (tests/test_openapi_fuzz.py draws requests from that schema).

``temperature`` left out means greedy here (OpenAI's own default is 1; transformers'
generation config for these models does not sample). Messages become one prompt
through the tokenizer's chat template when the model has one, else through
``CHAT_TEMPLATE`` (``"{role}: {content}\\n"`` per message, then ``"assistant:"``).

Nothing here touches the engine: ``parse_request`` returns a ``GenRequest``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from ...models import Sampling
from ...models.base import MAX_LOGPROBS
from ...models.grammar import Constraint
from ..handling import ClientError, check_text, parse_json
from .structured import parse_constraint

logger = logging.getLogger(__name__)

__all__ = ["CHAT_TEMPLATE", "COMPLETION_DEFAULT_MAX_TOKENS", "MAX_CACHE_SALT_CHARS", "MAX_FIELD_CHARS",
           "MAX_STOP_CHARS", "MIN_TEMPERATURE", "GenRequest", "check_field_names", "ignored_header", "parse_request",
           "render_chat"]

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_TEMPLATE = "{role}: {content}\n"  # per message; the prompt then ends with "assistant:"
MAX_STOPS = 16
MAX_STOP_CHARS = 512  # characters per stop string
MAX_FIELD_CHARS = 256  # characters per field name
MAX_CACHE_SALT_CHARS = 256  # characters of a cache_salt
MIN_TEMPERATURE = 0.01  # a smaller positive temperature is raised to this (vLLM's clamp)
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's cap for /v1/completions' "logprobs" (chat's "top_logprobs": MAX_LOGPROBS)

_COMMON = {"model", "max_tokens", "stream", "stream_options", "temperature", "top_p", "seed", "stop", "n",
           "ignore_eos", "min_tokens", "priority", "cache_salt", "logprobs", "logit_bias", "best_of",
           "response_format", "return_token_ids", "structured_outputs"}
_USED = {False: _COMMON | {"prompt", "echo", "suffix"},
         True: _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                          "function_call"}}
_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # function: tool's deprecated name


@dataclass
class GenRequest:
    """One completions or chat request, checked."""

    chat: bool
    prompts: list[str | list[int]]  # one per prompt: text (chat: the rendered conversation) or token ids; each gets
    #   n choices
    n: int = 1  # choices per prompt
    echo: bool = False  # completions: the prompt's text (and log-probabilities) before the answer's
    logprobs: int | None = None  # alternatives per token with each token's log-probability (None: no logprobs)
    model: str | None = None  # None: whatever this server serves
    max_tokens: int | None = None  # None: the default of the route
    stream: bool = False
    include_usage: bool = False
    sampling: Sampling | None = None  # None: greedy
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int | None = None  # vLLM's: a lower value is served first (None: the x-priority header, or 0)
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks are shared only under the same salt (None: none)
    return_token_ids: bool = False  # vLLM's: the answer carries its token ids and its prompt's
    constraint: Constraint | None = None  # the shape of the answer (response_format, structured_outputs); None: any
    ignored: list[str] = field(default_factory=list)  # fields accepted but not used


def _refuse(message: str, param: str | None) -> ClientError:
    return ClientError("bad_request", message, param)


def _typed(doc: dict[str, Any], name: str, kinds: type | tuple[type, ...], what: str) -> Any:
    """``doc[name]`` if present and not null, checked against ``kinds`` (bool is not a number here).

    An integer may come as a float with no fraction (``2.0``): JSON Schema's ``integer`` is a
    number whose value is whole, however it is written, and OpenAI's schema says ``integer``."""
    value = doc.get(name)
    if value is None:
        return None
    if kinds is int and isinstance(value, float) and value.is_integer():
        return int(value)
    numeric = kinds in (int, float) or kinds == (int, float)
    if not isinstance(value, kinds) or (numeric and isinstance(value, bool)):
        raise _refuse(f'"{name}" must be {what}, got {type(value).__name__}', name)
    if isinstance(value, float) and not math.isfinite(value):
        raise _refuse(f'"{name}" must be a finite number', name)
    return value


def parse_request(body: bytes, *, chat: bool, max_chars: int, max_tokens_cap: int, max_prompts: int,
                  template: Any = None) -> GenRequest:
    """The request's fields, checked. ``template(messages) -> str`` renders a chat (default ``render_chat``)."""
    example = ('{"model": "...", "messages": [{"role": "user", "content": "Hello"}]}' if chat
               else '{"model": "...", "prompt": "Once upon a time", "max_tokens": 16}')
    doc = parse_json(body, example)
    if not isinstance(doc, dict):
        raise _refuse(f"expected a JSON object, e.g. {example}", None)
    check_field_names(doc)
    _refuse_unhonourable(doc, chat)
    req = GenRequest(chat=chat, prompts=[])
    req.model = _typed(doc, "model", str, "a string")
    req.n = _choices(doc)
    if chat:
        messages = doc.get("messages")
        req.prompts = [(template or render_chat)(_messages(messages))]
    else:
        req.prompts = _prompts(doc.get("prompt"), max_prompts)
        req.echo = bool(_typed(doc, "echo", bool, "true or false"))
    if len(req.prompts) * req.n > max_prompts:
        raise _refuse(f"{len(req.prompts)} prompt(s) x n={req.n} is {len(req.prompts) * req.n} sequences, over the "
                      f"limit of {max_prompts} per request", "n")
    req.logprobs = _logprobs(doc, chat)
    for i, prompt in enumerate(req.prompts):
        if isinstance(prompt, str):
            check_text('"messages"' if chat else ('"prompt"' if len(req.prompts) == 1 else f'"prompt"[{i}]'),
                       prompt, max_chars)
    limit = _typed(doc, "max_completion_tokens", int, "an integer") if chat else None
    name = "max_completion_tokens" if limit is not None else "max_tokens"
    limit = limit if limit is not None else _typed(doc, "max_tokens", int, "an integer")
    if limit is not None and not 1 <= limit <= max_tokens_cap:
        raise _refuse(f'"{name}" must be between 1 and {max_tokens_cap} (the server\'s cap), got {limit}', name)
    req.max_tokens = limit
    req.stream = bool(_typed(doc, "stream", bool, "true or false"))
    options = _typed(doc, "stream_options", dict, "an object")
    if options is not None:
        req.include_usage = bool(_typed(options, "include_usage", bool, "true or false"))
        req.ignored += [f"stream_options.{k}" for k in sorted(set(options) - {"include_usage"})]
    req.sampling = _sampling(doc, req.logprobs, req.echo)
    req.stop = _stops(doc.get("stop"))
    req.ignore_eos = bool(_typed(doc, "ignore_eos", bool, "true or false"))
    req.min_tokens = _typed(doc, "min_tokens", int, "an integer") or 0
    req.priority = _typed(doc, "priority", int, "an integer (lower is served first)")
    req.cache_salt = _cache_salt(doc)
    req.return_token_ids = bool(_typed(doc, "return_token_ids", bool, "true or false"))
    req.constraint = parse_constraint(doc)
    if req.min_tokens < 0 or (limit is not None and req.min_tokens > limit):
        raise _refuse(f'"min_tokens" must be between 0 and {name} ({limit}), got {req.min_tokens}', "min_tokens")
    req.ignored = sorted(set(doc) - _USED[chat]) + req.ignored
    if req.ignored:
        logger.debug("accepted and ignored request field(s) %s (named in the x-ignored-fields header)", req.ignored)
    return req


def check_field_names(doc: dict[str, Any]) -> None:
    """A 400 for a field name no client of this API sends: not printable ASCII (a header cannot echo it), or long."""
    names = list(doc)
    if isinstance(doc.get("stream_options"), dict):
        names += [f"stream_options.{k}" for k in doc["stream_options"]]
    for name in names:
        if len(name) > MAX_FIELD_CHARS or not (name.isascii() and name.isprintable()):
            shown = name[:40].encode("unicode_escape").decode("ascii")
            raise _refuse(f"field name {shown!r}{'...' if len(name) > 40 else ''}: field names are printable ASCII "
                          f"of at most {MAX_FIELD_CHARS} characters", None)


def ignored_header(names: list[str], most: int = 32) -> str:
    """``x-ignored-fields``: the first ``most`` names, and how many more (a header stays short)."""
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown} (+{len(names) - most} more)"


def _refuse_unhonourable(doc: dict[str, Any], chat: bool) -> None:
    """A 400 for every field whose value asks for what this server cannot do."""
    best_of = _typed(doc, "best_of", int, "an integer")
    n = _choices(doc)
    if best_of is not None and best_of not in (1, n):
        raise _refuse(f'"best_of" must equal "n" here (got best_of={best_of}, n={n}): every choice made is '
                      "returned; none is chosen by score", "best_of")
    if chat and doc.get("echo") not in (None, False):
        raise _refuse('"echo" is for /v1/completions: a chat answer holds the assistant\'s message only', "echo")
    if doc.get("suffix") not in (None, ""):
        raise _refuse('"suffix" (insertion) is not supported', "suffix")
    if doc.get("logit_bias") not in (None, {}):
        raise _refuse('"logit_bias" is not supported; leave it out or send {}', "logit_bias")
    for name in ("tools", "functions"):
        if doc.get(name) not in (None, []):
            raise _refuse(f'"{name}": this server does not call tools or functions', name)
    for name in ("tool_choice", "function_call"):
        if doc.get(name) not in (None, "none"):
            raise _refuse(f'"{name}": this server does not call tools or functions', name)


def _choices(doc: dict[str, Any]) -> int:
    n = _typed(doc, "n", int, "an integer")
    if n is not None and n < 1:
        raise _refuse(f'"n" must be at least 1, got {n}', "n")
    return n or 1


def _logprobs(doc: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives come with each token's log-probability; None: no log-probabilities asked."""
    if not chat:
        k = _typed(doc, "logprobs", int, f"an integer from 0 to {MAX_COMPLETION_LOGPROBS}")
        if k is not None and not 0 <= k <= MAX_COMPLETION_LOGPROBS:
            raise _refuse(f'"logprobs" must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {k}', "logprobs")
        return k  # type: ignore[no-any-return]
    wanted = bool(_typed(doc, "logprobs", bool, "true or false"))
    top = _typed(doc, "top_logprobs", int, "an integer")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise _refuse(f'"top_logprobs" must be between 0 and {MAX_LOGPROBS}, got {top}', "top_logprobs")
    if top and not wanted:
        raise _refuse('"top_logprobs" needs "logprobs": true', "top_logprobs")
    return (top or 0) if wanted else None


def _cache_salt(doc: dict[str, Any]) -> str | None:
    salt = _typed(doc, "cache_salt", str, "a non-empty string")
    if salt is not None and not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise _refuse(f'"cache_salt" must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, got '
                      f"{len(salt)}", "cache_salt")
    return salt  # type: ignore[no-any-return]


def _prompts(prompt: Any, max_prompts: int) -> list[str | list[int]]:
    """One prompt or several: text, or token ids (the model's vocabulary is checked when they are encoded)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        return [[int(t) for t in prompt]]
    several = isinstance(prompt, list) and prompt and (
        all(isinstance(p, str) for p in prompt)
        or all(isinstance(p, list) and p and all(_is_id(t) for t in p) for p in prompt))
    if not several:
        raise _refuse('"prompt" must be a string, a non-empty list of strings, a non-empty list of token ids '
                      "(integers) or a non-empty list of such lists", "prompt")
    if len(prompt) > max_prompts:
        raise _refuse(f"{len(prompt)} prompts is over the limit of {max_prompts} per request", "prompt")
    return [p if isinstance(p, str) else [int(t) for t in p] for p in prompt]


def _is_id(t: Any) -> bool:
    """A token id as JSON may carry one: an integer (``5.0`` too, as JSON Schema's ``integer``), not a bool."""
    return (isinstance(t, int) and not isinstance(t, bool)) or (isinstance(t, float) and t.is_integer())


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise _refuse('"messages" must be a non-empty list of {"role": ..., "content": ...}', "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _refuse(f'"messages"[{i}] must be an object with a "role" and a "content"', "messages")
        if m["role"] not in _ROLES:
            raise _refuse(f'"messages"[{i}]: unknown role {m["role"]!r}; use one of {", ".join(_ROLES)}', "messages")
        out.append({"role": m["role"], "content": _content(m.get("content"), i)})
    return out


def _content(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _refuse(f'"messages"[{i}]: content part {kind!r} is not supported (text only)', "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise _refuse(f'"messages"[{i}]["content"] must be a string or a list of text parts', "messages")


def render_chat(messages: list[dict[str, str]]) -> str:
    """``CHAT_TEMPLATE`` for models without a chat template of their own."""
    return "".join(CHAT_TEMPLATE.format(**m) for m in messages) + "assistant:"


def _sampling(doc: dict[str, Any], logprobs: int | None, echo: bool) -> Sampling | None:
    temperature = _typed(doc, "temperature", (int, float), "a number")
    top_p = _typed(doc, "top_p", (int, float), "a number")
    seed = _typed(doc, "seed", int, "an integer")
    if temperature is not None and not 0 <= temperature <= 2:
        raise _refuse(f'"temperature" must be between 0 and 2, got {temperature}', "temperature")
    if top_p is not None and not 0 <= top_p <= 1:
        raise _refuse(f'"top_p" must be between 0 and 1, got {top_p}', "top_p")
    scores = {"logprobs": logprobs, "prompt_logprobs": logprobs if echo else None}
    if not temperature or top_p == 0:  # greedy (top_p 0: a nucleus of the most likely token alone)
        return None if logprobs is None else Sampling(**scores)
    return Sampling(temperature=max(float(temperature), MIN_TEMPERATURE), top_p=float(1.0 if top_p is None else top_p),
                    seed=seed, **scores)


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not stops or not all(isinstance(s, str) and s for s in stops):
        raise _refuse('"stop" must be a non-empty string or a non-empty list of them', "stop")
    if len(stops) > MAX_STOPS:
        raise _refuse(f'"stop" has {len(stops)} strings, over the limit of {MAX_STOPS}', "stop")
    if max(len(s) for s in stops) > MAX_STOP_CHARS:
        raise _refuse(f'"stop" strings are at most {MAX_STOP_CHARS} characters', "stop")
    return tuple(stops)
