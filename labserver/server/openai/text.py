"""What of a completion's text to send now: everything decoded, less what a stop string could still claim.

The text itself is the sequence's (``labserver.engine.output.Detokenizer``: each token
decoded once, stop strings found there, the text cut before the one found). OpenAI answers
the text *before* a stop string, so while one could still be forming, the last
``len(longest stop) - 1`` characters are held back: no piece of a stop string is ever
streamed. The stream and the one-piece answer read the same text, so they are equal.
"""

from __future__ import annotations

from ...engine.output import Detokenizer

__all__ = ["TextStream"]


class TextStream:
    def __init__(self, output: Detokenizer) -> None:
        self.output = output
        self.sent = 0  # characters of its text already returned

    @property
    def stopped(self) -> bool:
        return self.output.stopped

    def push(self, finished: bool) -> str:
        """The text to send now; everything left once ``finished`` (or stopped)."""
        text = self.output.text
        end = len(text)
        if not (finished or self.output.stopped):
            end = max(self.sent, end - self.output.reach)
        piece = text[self.sent:end]
        self.sent = end
        return piece
