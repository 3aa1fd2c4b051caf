"""What OpenAI's published schema allows in a request, and the shapes it admits in an answer, checked alone.

Each of these once answered otherwise than the schema says (tests/test_openapi_fuzz.py fuzzes
the whole of it on a real server): values the schema allows were refused, and a completion's
echoed log-probabilities held nulls where the schema has numbers.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from labserver.models import Logprob, SyntheticGen
from labserver.server.handling import ClientError
from labserver.server.openai.generation import chat_template
from labserver.server.openai.logprobs import UNLIKELY, completion_logprobs, prompt_entries
from labserver.server.openai.params import GenRequest, parse_request


def parse(doc: dict[str, Any], chat: bool = False) -> GenRequest:
    return parse_request(json.dumps(doc).encode(), chat=chat, max_chars=100, max_tokens_cap=50, max_prompts=8)


def test_an_integer_may_be_written_with_a_zero_fraction() -> None:
    """JSON Schema's ``integer`` is a whole number however it is written: 4.0 is one (it was a 400)."""
    req = parse({"prompt": "x", "max_tokens": 4.0, "n": 2.0, "best_of": 2.0, "seed": 3.0, "temperature": 1,
                 "logprobs": 1.0})
    assert req.max_tokens == 4 and req.n == 2 and req.logprobs == 1
    assert req.sampling is not None and req.sampling.seed == 3
    assert all(type(v) is int for v in (req.max_tokens, req.n, req.logprobs, req.sampling.seed))
    chat = parse({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3.0, "logprobs": True,
                  "top_logprobs": 2.0}, chat=True)
    assert chat.max_tokens == 3 and chat.logprobs == 2
    for name, value in (("max_tokens", 2.5), ("n", True), ("seed", float("inf"))):
        with pytest.raises(ClientError) as e:
            parse({"prompt": "x", "temperature": 1, name: value})
        assert e.value.param == name


def test_top_p_zero_is_the_most_likely_token_alone() -> None:
    """The schema's top_p is 0 to 1; a nucleus of mass 0 holds the most likely token: greedy (it was a 400)."""
    assert parse({"prompt": "x", "temperature": 1.5, "top_p": 0}).sampling is None
    scored = parse({"prompt": "x", "temperature": 1.5, "top_p": 0.0, "logprobs": 2}).sampling
    assert scored is not None and scored.greedy and scored.logprobs == 2
    with pytest.raises(ClientError) as e:
        parse({"prompt": "x", "top_p": 1.5})
    assert e.value.param == "top_p" and "between 0 and 1" in str(e.value)


def test_the_function_role_is_a_message_like_any_other() -> None:
    """The schema's deprecated function message (a function's result, named), as vLLM takes it (it was a 400)."""
    req = parse({"messages": [{"role": "user", "content": "add 40 and 2"},
                              {"role": "function", "name": "add", "content": "42"}]}, chat=True)
    assert req.prompts == ["user: add 40 and 2\nfunction: 42\nassistant:"]


def test_an_echoed_prompts_first_token_has_numbers_not_nulls() -> None:
    """Nothing predicts a prompt's first token; OpenAI's answer has null there, its schema numbers and objects
    only, so it is UNLIKELY, with itself as its one alternative, and every list keeps one entry per token."""
    model = SyntheticGen(0, 0)
    entries = prompt_entries([5, 6], [Logprob(6, -1.5, ((7, -0.5), (6, -1.5)))])
    out = completion_logprobs(model, entries, 0)
    assert out["tokens"] == [" t5", " t6"] and out["text_offset"] == [0, 3]
    assert out["token_logprobs"] == [UNLIKELY, -1.5]
    assert out["top_logprobs"] == [{" t5": UNLIKELY}, {" t7": -0.5, " t6": -1.5}]


class _StrictTemplate:
    """A tokenizer whose chat template refuses what it was not written for, as Mistral's does."""

    chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> str:
        from jinja2 import TemplateError

        raise TemplateError("roles must alternate user/assistant")


def test_a_conversation_the_models_template_refuses_is_a_400() -> None:
    """Schema-valid messages a model's own template will not render were a 500 (the template's exception)."""
    model = SyntheticGen(0, 0)
    model.tokenizer = _StrictTemplate()
    with pytest.raises(ClientError) as e:
        parse_request(b'{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}',
                      chat=True, max_chars=100, max_tokens_cap=50, max_prompts=8, template=chat_template(model))
    assert e.value.kind == "bad_request" and e.value.param == "messages"
    assert "roles must alternate" in str(e.value) and "chat template" in str(e.value)
