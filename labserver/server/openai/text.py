"""A completion's text as it grows: token by token into text, stop strings cut, nothing sent twice.

``TextStream.push(tokens, finished)`` is called with a sequence's tokens so far and
returns the text to send now. The stream and the one-piece answer are built the same
way (the one-piece answer pushes everything once), so their texts are equal.

Detokenizing. A token's text can depend on its neighbours (a WordPiece "##ing" joins
the word before it; a tokenizer may tidy spaces around punctuation), so each new token
is decoded together with the one or two before it (``model.text`` over a short window)
and only the part past the window's previous text is new: a cost per token that does
not grow with the output, as in the incremental detokenizers of TGI and vLLM. Special
tokens (EOS) decode to nothing.

Stop strings. The engine stops a sequence once its text contains a stop string; OpenAI
answers the text *before* the stop string. While a stop string could still be forming,
the last ``len(longest stop) - 1`` characters are held back, so no piece of a stop
string is ever streamed. If the text here shows a stop string first (a window decodes
a little differently from the whole), ``stopped`` says so and the route ends the
sequence itself.

Half characters. A byte-level tokenizer (GPT-2, Qwen2) may split one character over
several tokens; until the last of them arrives the text ends in U+FFFD and is held back.
An answer that ends mid-character sends what the tokenizer decodes it to, replacement
character included: nothing a sequence generated is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["TextStream"]


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self.decode = decode  # the model's tokens -> text (special tokens left out)
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # characters a stop could still claim
        self.text = ""  # all decoded so far
        self.sent = 0  # characters of text already returned
        self.stopped = False  # a stop string was found: text ends before it
        self._done = 0  # tokens decoded
        self._prefix = 0  # window start
        self._read = 0  # window end of the previous token

    def push(self, tokens: list[int], finished: bool) -> str:
        """The text to send now for ``tokens`` (all so far); everything left once ``finished``."""
        while self._done < len(tokens) and not self.stopped:
            self._done += 1
            self._advance(tokens[: self._done])
        if finished and not self.stopped and self._read < len(tokens):
            self._advance(tokens, last=True)  # a character left half made: what the tokenizer makes of it
        end = len(self.text)
        self.sent = min(self.sent, end)
        if not (finished or self.stopped):
            end = max(self.sent, end - self.hold)
        piece = self.text[self.sent:end]
        self.sent = end
        return piece

    def _advance(self, tokens: list[int], last: bool = False) -> None:
        before = self.decode(tokens[self._prefix:self._read])
        after = self.decode(tokens[self._prefix:])
        # a trailing U+FFFD is half a multi-byte character: wait for the rest, unless no more will come
        if len(after) > len(before) and (last or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(tokens)
        if self.stop:
            cut = min((at for at in (self.text.find(s) for s in self.stop) if at >= 0), default=-1)
            if cut >= 0:
                self.text, self.stopped = self.text[:cut], True
