"""One OpenAI completions or chat answer as the load generator reads it off the socket.

``OpenAIAnswer`` has the face of ``labserver.load.sse.Answer`` (``begin``, ``feed``,
``outcome``, ``token_s``, ``timing``), so the sending loop treats both alike. It reads
the stream as OpenAI's clients do: ``data: {chunk}`` events, ``data: {"error": ...}``,
and ``data: [DONE]``; a chunk's content is ``choices[].text`` (completions) or
``choices[].delta.content`` (chat), and the usage chunk's ``completion_tokens`` is the
output length whenever the server sends one.

What is measured, from the client's clock of the socket read each chunk came in:

- the first token: the first chunk *with content* (a chat stream's role-only first chunk
  is not one), so TTFT is what a user waits for;
- one time per output token (``token_s``), from which ITL is taken. A chunk may carry
  several tokens (a server that streams every few tokens, or a slow reader): when the
  usage says N tokens came in C < N chunks, each chunk is given a share of the N in
  proportion to its characters (at least one each), all at that chunk's time, so the
  gaps inside a chunk are 0 and the mean gap is still (last - first) / (N - 1). Without
  usage, each chunk with content counts as one token.

A stream that ends without ``[DONE]`` but with a finish reason and no error counts as
complete (some servers leave ``[DONE]`` out). Nothing here sends anything.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import orjson

__all__ = ["OpenAIAnswer", "spread"]

_SEP = b"\n\n"
_DONE = b"[DONE]"


class OpenAIAnswer:
    """Status, headers, content chunk times, usage and the end of one OpenAI answer."""

    __slots__ = ("status", "headers", "event_stream", "chunk_s", "chunk_chars", "end", "usage", "finish",
                 "error", "_rest", "_body", "_doc")

    def __init__(self) -> None:
        self.status = 0
        self.headers: Mapping[str, str] = {}
        self.event_stream = False
        self.chunk_s: list[float] = []  # client clock of each chunk with content
        self.chunk_chars: list[int] = []  # characters of content in each of them
        self.end = ""  # "done" after [DONE], "error" after an error event
        self.usage: dict[str, Any] | None = None
        self.finish = ""  # the last finish_reason seen
        self.error: dict[str, Any] | None = None
        self._rest = b""
        self._body: list[bytes] = []
        self._doc: dict[str, Any] | None = None

    def begin(self, status: int, headers: Mapping[str, str]) -> None:
        self.status, self.headers = status, headers
        self.event_stream = headers.get("content-type", "").startswith("text/event-stream")

    def feed(self, data: bytes, t_s: float) -> None:
        if not self.event_stream:
            self._body.append(data)
            return
        buf = self._rest + data if self._rest else data
        buf = buf.replace(b"\r\n", b"\n") if b"\r" in buf else buf
        *events, self._rest = buf.split(_SEP)
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._data(line[5:].strip(), t_s)

    def _data(self, payload: bytes, t_s: float) -> None:
        if payload == _DONE:
            self.end = self.end or "done"
            return
        try:
            doc = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return  # not ours to judge: a comment or keep-alive a server may send
        if not isinstance(doc, dict):
            return
        if doc.get("error"):
            self.end, self.error = "error", doc["error"] if isinstance(doc["error"], dict) else {"message": doc}
            return
        chars = self._choices(doc.get("choices") or ())
        if chars:
            self.chunk_s.append(t_s)
            self.chunk_chars.append(chars)
        if isinstance(doc.get("usage"), dict):
            self.usage = doc["usage"]

    def _choices(self, choices: Any) -> int:
        chars = 0
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(text, str):
                chars += len(text)
            if choice.get("finish_reason"):
                self.finish = str(choice["finish_reason"])
        return chars

    def result(self) -> dict[str, Any] | None:
        """A one-piece answer's JSON (None when it is not a JSON object)."""
        if self._doc is None:
            try:
                doc = orjson.loads(b"".join(self._body))
            except orjson.JSONDecodeError:
                doc = None
            self._doc = doc if isinstance(doc, dict) else {}
        return self._doc or None

    def completion_tokens(self) -> int | None:
        tokens = (self.usage or {}).get("completion_tokens")
        return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None

    def outcome(self, done_s: float, t0: float = 0.0) -> tuple[str, float, int, str]:
        """(error kind, first token time, output tokens, finish reason), as ``sse.Answer.outcome``."""
        if self.event_stream:
            first_s = self.chunk_s[0] - t0 if self.chunk_s else math.nan
            complete = self.end == "done" or (self.end == "" and bool(self.finish))
            error = "" if complete else ("stream_error" if self.end == "error" else "stream_incomplete")
            n = self.completion_tokens()
            return error, first_s, n if n is not None else len(self.chunk_s), self.finish
        if not 200 <= self.status < 300:
            return "", math.nan, 0, ""
        doc = self.result()
        if doc is None or not isinstance(doc.get("choices"), list):
            return "bad_answer", math.nan, 0, ""
        self.usage = doc.get("usage") if isinstance(doc.get("usage"), dict) else None
        self._choices(doc["choices"])
        n = self.completion_tokens()
        return "", done_s, n if n is not None else len(doc["choices"]), self.finish

    @property
    def token_s(self) -> list[float]:
        """One client-clock time per output token of a stream (see the module docstring)."""
        n = self.completion_tokens()
        if n is None or n <= len(self.chunk_s) or not self.chunk_s:  # (no chunk with text: an answer that is
            return list(self.chunk_s)  # only EOS has a token but no time to give it)
        return [t for t, k in zip(self.chunk_s, spread(n, self.chunk_chars)) for _ in range(k)]

    def timing(self) -> dict[str, Any]:
        return {}  # OpenAI answers carry no server timing body; labserver's headers are read by name


def spread(n: int, weights: list[int]) -> list[int]:
    """``n`` split over ``len(weights)`` parts in proportion to ``weights``, at least 1 each when n allows
    (largest remainder)."""
    parts, total = len(weights), sum(weights)
    if n <= parts:
        return [1] * n + [0] * (parts - n)
    if total <= 0:
        weights, total = [1] * parts, parts
    shares = [n * w / total for w in weights]
    counts = [max(1, int(x)) for x in shares]
    while sum(counts) < n:  # the largest remainders get the rest
        i = max(range(parts), key=lambda j: shares[j] - counts[j])
        counts[i] += 1
    while sum(counts) > n:  # a part lifted to 1 took one from the largest
        i = max(range(parts), key=lambda j: counts[j] - shares[j] if counts[j] > 1 else -parts)
        counts[i] -= 1
    return counts
