"""A sequence's text as its tokens come: each token decoded once, stop strings found in the new text only.

Every generation engine gives each sequence one ``Detokenizer`` (``GenEngine.submit``);
``Seq.emit`` pushes each token into it, and a stop string it finds ends the sequence
("stop"). The routes read the same text (``server.openai.text.TextStream`` only holds back
what a stop string could still claim), so a token is turned into text once, and the
engine and the route can never disagree about where a stop string begins.

Decoding. A token's text can depend on its neighbours (a WordPiece "##ing" joins the word
before it; a tokenizer may tidy spaces around punctuation), so each new token is decoded
together with the one or two before it, and only the part past the window's previous text
is new: two decodes of a few tokens per token, whatever the answer's length (the
incremental detokenizers of TGI and vLLM work so). A byte-level tokenizer may split one
character over several tokens; while the window's text ends in U+FFFD (half a
character) nothing is added, and the window grows until the character is whole.
``finish`` adds what is left, replacement character included: nothing generated is lost.

Stop strings. Earlier text holds no stop string (it was searched when it was new), so one
can only end inside the new text: the search covers the new text and the
``len(longest stop) - 1`` characters before it. With ``s`` stop strings of length at most
``L``, a token costs O(s x (L + its text)), and a whole answer time linear in its length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["Detokenizer"]


class Detokenizer:
    """One sequence's text, built token by token (see the module docstring)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self.decode = decode  # the model's tokens -> text (special tokens left out)
        self.stop = tuple(s for s in stop if s)
        self.reach = max((len(s) for s in self.stop), default=1) - 1  # characters a stop may reach back
        self.stop_string: str | None = None  # the stop string found: the text ends before it
        self.decoded = 0  # tokens turned into text so far
        self.text = ""  # everything decoded so far (up to a stop string, once found)
        self._window: list[int] = []  # the tokens whose text was last added, then those since
        self._known = 0  # of the window: tokens whose text is in the text already

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def push(self, token: int) -> bool:
        """One more token; True when its text completes a stop string (the text then ends before it)."""
        if self.stopped:
            return True
        self.decoded += 1
        self._window.append(token)
        before = self.decode(self._window[:self._known])
        after = self.decode(self._window)
        if len(after) > len(before) and not after.endswith("\ufffd"):  # (U+FFFD: half a character, wait)
            self._add(after[len(before):])
            self._window = self._window[self._known:]  # the last whole token(s) stay as the next one's context
            self._known = len(self._window)
        return self.stopped

    def finish(self) -> None:
        """No more tokens: a character left half made is added as the tokenizer decodes it."""
        if self.stopped or self._known == len(self._window):
            return
        before = self.decode(self._window[:self._known])
        after = self.decode(self._window)
        if len(after) > len(before):
            self._add(after[len(before):])
        self._known = len(self._window)

    def _add(self, new: str) -> None:
        if self.stop:
            start = max(0, len(self.text) - self.reach)
            span = self.text[start:] + new  # the only place a stop string can end: the new text and a stop's reach
            found = [(at, s) for s in self.stop if (at := span.find(s)) >= 0]
            if found:
                at, self.stop_string = min(found)
                self.text = (self.text + new)[:start + at]  # (it may begin in text already held)
                return
        self.text += new
