"""Extraction tasks whose answers have a shape: a short text, a question, and the JSON schema the answer must fit.

What structured outputs are asked for in practice (pull fields out of a text, classify it),
small enough for a 135M model to answer well: four schemas (a person, a place, a review, a
meeting) and four texts for each. ``ShapedTasks.take(n, rng)`` draws ``n`` of them, and
``fits(text, schema)`` says whether an answer is JSON that validates against its schema
(``jsonschema``, the test extras': strict JSON, a fenced or prefaced answer does not fit).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["SCHEMAS", "ShapedTask", "ShapedTasks", "fits", "response_format"]

_TEXT = {"type": "string", "maxLength": 40}
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {"name": _TEXT, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 130}, "city": _TEXT},
               "required": ["name", "age", "city"], "additionalProperties": False},
    "place": {"type": "object", "properties": {"country": _TEXT, "capital": _TEXT},
              "required": ["country", "capital"], "additionalProperties": False},
    "review": {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                                "stars": {"type": "integer", "minimum": 1, "maximum": 5}},
               "required": ["sentiment", "stars"], "additionalProperties": False},
    "meeting": {"type": "object", "properties": {"topic": _TEXT, "day": {"enum": [
        "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]}, "hour": {
        "type": "integer", "minimum": 0, "maximum": 23}}, "required": ["topic", "day", "hour"],
        "additionalProperties": False},
}
_ASK = {"person": "the person's name, age and city",
        "place": "the country and its capital",
        "review": "the review's sentiment (positive, negative or neutral) and its stars (1 to 5)",
        "meeting": "the meeting's topic, day of the week and hour (0 to 23)"}
_TEXTS = {
    "person": ["Maria Lopez, 34, moved from Madrid to Lisbon last spring.",
               "At 71, retired teacher John Carter still lives in Boston.",
               "Our new intern is Aiko Tanaka; she is 22 and comes from Osaka.",
               "Peter Novak (45) runs a bakery in Prague."],
    "place": ["I spent a week in Kenya and loved Nairobi, its capital.",
              "The capital of Canada is Ottawa, not Toronto.",
              "Canberra surprised me: few people know it is Australia's capital.",
              "We flew to Peru and landed in Lima, the capital."],
    "review": ["Terrible battery, it died after two days. One star.",
               "Works exactly as described, five stars from me!",
               "It is fine. Nothing special, nothing broken. Three stars.",
               "Great sound and comfortable, but pricey. Four stars."],
    "meeting": ["Let's review the budget on Tuesday at 14:00.",
                "The team standup moves to Friday, 9 in the morning.",
                "Planning session for the launch: Monday at 16h.",
                "Can we discuss hiring on Thursday at 11?"],
}


@dataclass(frozen=True)
class ShapedTask:
    schema: str  # a key of SCHEMAS
    prompt: str  # the user's message

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.prompt}]


def _task(schema: str, text: str) -> ShapedTask:
    keys = ", ".join(f'"{k}"' for k in SCHEMAS[schema]["properties"])
    return ShapedTask(schema, f"Extract {_ASK[schema]} from the text below. Answer with a JSON object with the keys "
                              f"{keys}.\n\nText: {text}")


class ShapedTasks:
    """Every (schema, text) pair as a task, drawn without replacement (then again) in a seeded order."""

    def __init__(self) -> None:
        self.tasks = [_task(s, t) for s, texts in _TEXTS.items() for t in texts]

    def take(self, n: int, rng: np.random.Generator) -> list[ShapedTask]:
        order: list[int] = []
        while len(order) < n:
            order += list(rng.permutation(len(self.tasks)))
        return [self.tasks[i] for i in order[:n]]


def response_format(schema: str) -> dict[str, Any]:
    """OpenAI's ``response_format`` for one of ``SCHEMAS``."""
    return {"type": "json_schema", "json_schema": {"name": schema, "schema": SCHEMAS[schema], "strict": True}}


def fits(text: str, schema: str) -> bool:
    """The answer is JSON (the whole text) that validates against ``SCHEMAS[schema]``."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMAS[schema])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
