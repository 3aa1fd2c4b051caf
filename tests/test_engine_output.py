"""The output processor: a sequence's text token by token, equal to a whole decode; stop strings in the new text."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from labserver.engine.output import Detokenizer


def _pushed(decode: Any, tokens: list[int], stop: tuple[str, ...] = ()) -> Detokenizer:
    out = Detokenizer(decode, stop)
    for token in tokens:
        if out.push(token):
            break
    out.finish()
    return out


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_token_by_token_equals_a_whole_decode(folders: dict[str, Path], family: str) -> None:
    """Byte-level BPE (characters split over tokens), SentencePiece-style and ChatML tokenizers: answers of 300
    tokens decode, one token at a time, to the tokenizer's decode of them all: text with characters of 2 to 4
    bytes, and random tokens (specials included; those that are bytes of no whole character left out: a run of
    them may decode to a different count of U+FFFD in a window than in the whole)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folders[family])

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)  # type: ignore[no-any-return]

    rng = random.Random(0)
    text = "Caf\u00e9 na\u00efve \u4e2d\u6587 \U0001f600 the quick brown fox, jumps! over 12 lazy dogs."
    whole = [i for i in range(tok.vocab_size) if "\ufffd" not in decode([i])]
    for trial in range(5):
        words = text.split()
        ids = tok.encode(" ".join(rng.choice(words) for _ in range(120)), add_special_tokens=False)[:300]
        if trial:
            ids = [rng.choice(whole) for _ in range(300)]
        assert _pushed(decode, ids).text == decode(ids), (family, trial)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_a_models_text_is_its_tokenizers_decode(folders: dict[str, Path], family: str) -> None:
    """``TokenizerText.text`` calls the Rust tokenizer directly where transformers' ``decode`` would only wrap it
    (no spaces tidied): the same text for any ids, specials included; a tokenizer that tidies spaces is asked
    through ``decode`` itself."""
    from transformers import AutoTokenizer

    from labserver.models.paged import TokenizerText

    tok = AutoTokenizer.from_pretrained(folders[family])
    rng = random.Random(1)
    runs = [[rng.randrange(len(tok)) for _ in range(rng.randint(0, 5))] for _ in range(2000)]
    direct = TokenizerText(tok)
    assert direct._rust_decode is not None
    assert [direct.text(ids) for ids in runs] == [tok.decode(ids, skip_special_tokens=True) for ids in runs]
    tok.clean_up_tokenization_spaces = True
    tidied = TokenizerText(tok)
    assert tidied._rust_decode is None
    assert [tidied.text(ids) for ids in runs[:200]] == [tok.decode(ids, skip_special_tokens=True) for ids in runs[:200]]


def _words(ids: list[int]) -> str:
    return " ".join(f"w{t}" for t in ids)


def test_a_stop_string_ends_the_text_before_it_even_across_tokens() -> None:
    out = _pushed(_words, [1, 2, 3, 4, 5], stop=("w3 w", "w9"))
    assert out.stopped and out.stop_string == "w3 w" and out.text == "w1 w2 " and out.decoded == 4
    assert _pushed(_words, [1, 2, 3], stop=("w9",)).text == "w1 w2 w3"  # none found: all of it
    first = _pushed(_words, [1, 2, 3, 4], stop=("w3", "w2 w3", "w4"))  # several: the one that begins first
    assert first.stop_string == "w2 w3" and first.text == "w1 "


def test_each_token_is_decoded_once_in_a_window_that_does_not_grow() -> None:
    """The work per token does not depend on the answer's length: two decodes of a short window."""
    calls: list[int] = []

    def decode(ids: list[int]) -> str:
        calls.append(len(ids))
        return _words(ids)

    out = _pushed(decode, list(range(5000)), stop=tuple(f"x{i}" for i in range(16)))
    assert out.text == _words(list(range(5000)))
    assert len(calls) <= 2 * 5000 and max(calls) <= 2
