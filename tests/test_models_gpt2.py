"""Our GPT-2 forward pass and slot KV cache against transformers' own model (tiny, random weights, CPU)."""

from __future__ import annotations

import pytest
import torch

from labserver.models import GenModel, load_model
from labserver.models.gpt2 import GPT2Gen, gpt2_random
from labserver.models import MEANINGLESS, InputRejected, ModelError

ATOL = 1e-4  # float32; the logits themselves are ~0.16 wide (random weights)


@pytest.fixture
def gen() -> GPT2Gen:
    return gpt2_random(tiny=True, device="cpu")


def hf_next_logits(gen: GPT2Gen, ids: list[int]) -> torch.Tensor:
    """transformers' logits for the token after ``ids``: the reference."""
    with torch.inference_mode():
        return gen.hf_model(torch.tensor([ids])).logits[0, -1]


def prompt(gen: GPT2Gen, n: int, offset: int = 0) -> list[int]:
    """[CLS] and n - 1 ordinary word pieces (ids 2000.. are plain vocabulary)."""
    return [gen.tokenizer.cls_token_id, *range(2000 + offset, 2000 + offset + n - 1)]


class Tracker:
    """Sequences by id, each checked against transformers at every step."""

    def __init__(self, gen: GPT2Gen) -> None:
        self.gen = gen
        self.ids: dict[int, list[int]] = {}  # seq id -> prompt + tokens so far

    def prefill(self, seqs: list[tuple[int, list[int]]]) -> None:
        logits = self.gen.prefill_logits(seqs)
        for (sid, ids), row in zip(seqs, logits, strict=True):
            torch.testing.assert_close(row, hf_next_logits(self.gen, ids), atol=ATOL, rtol=0)
            self.ids[sid] = [*ids, int(row.argmax())]

    def decode(self, sids: list[int]) -> None:
        logits = self.gen.decode_logits([(s, self.ids[s][-1]) for s in sids])
        for sid, row in zip(sids, logits, strict=True):
            torch.testing.assert_close(row, hf_next_logits(self.gen, self.ids[sid]), atol=ATOL, rtol=0)
            self.ids[sid].append(int(row.argmax()))


def test_logits_match_transformers_as_sequences_join_and_leave(gen: GPT2Gen) -> None:
    t = Tracker(gen)
    t.prefill([(1, prompt(gen, 5)), (2, prompt(gen, 12, 100)), (3, prompt(gen, 2, 200))])  # one padded batch
    for _ in range(3):
        t.decode([1, 2, 3])
    t.gen.release([2])  # the middle row leaves: the last row (3) moves into it
    assert gen.cache.ids == [1, 3] and gen.cache.row == {1: 0, 3: 1}
    for _ in range(2):
        t.decode([3, 1])  # the caller's order need not be the rows' order
    t.prefill([(4, prompt(gen, 9, 300))])  # joins later, shorter than some, longer than others
    for _ in range(3):
        t.decode([4, 1, 3])
    t.decode([3])  # a subset: read by gather instead of the [:n] view
    t.decode([1, 3, 4])
    assert gen.cached == 3
    assert gen.calls[:2] == [("prefill", (1, 2, 3)), ("decode", (1, 2, 3))]


def test_cache_grows_past_its_first_size(gen: GPT2Gen) -> None:
    t = Tracker(gen)
    t.prefill([(1, prompt(gen, 3))])
    first = gen.cache.k[0].shape
    for _ in range(10):  # 3 -> 13 positions: at least two doublings
        t.decode([1])
    t.prefill([(2, prompt(gen, 4, 50)), (3, prompt(gen, 6, 90))])  # 1 -> 3 slots
    t.decode([1, 2, 3])
    assert gen.cache.k[0].shape[0] >= 3 > first[0] and gen.cache.k[0].shape[2] >= 14 > first[2]


def greedy(gen: GPT2Gen, sid: int, ids: list[int], n: int) -> list[int]:
    tokens = gen.prefill([(sid, ids)])
    while len(tokens) < n:
        tokens += gen.decode([(sid, tokens[-1])])
    return tokens


def test_tokens_do_not_depend_on_batch_companions(gen: GPT2Gen) -> None:
    target = prompt(gen, 7, 500)
    alone = greedy(gen, 1, target, 10)
    gen.release([1])
    # in company: a longer and a shorter one prefilled with it, one joining mid-way, one leaving
    out = gen.prefill([(10, prompt(gen, 20, 40)), (11, target), (12, prompt(gen, 2, 70))])
    last = dict(zip((10, 11, 12), out))
    mine = [last[11]]
    for step in range(9):
        if step == 3:
            last[13] = gen.prefill([(13, prompt(gen, 30, 90))])[0]
        if step == 5:
            gen.release([10])
            del last[10]
        outs = gen.decode(list(last.items()))
        last = dict(zip(last, outs))
        mine.append(last[11])
    assert mine == alone


def test_release_frees_and_forgets(gen: GPT2Gen) -> None:
    gen.prefill([(1, prompt(gen, 4)), (2, prompt(gen, 6))])
    gen.release([1, 99])  # 99 was never there: ignored
    assert gen.cached == 1
    gen.release([2])
    assert gen.cached == 0 and gen.cache.k[0].numel() == 0  # idle: the memory went back
    with pytest.raises(ModelError, match="no cache"):
        gen.decode([(1, 5)])


def test_prefill_is_all_or_nothing(gen: GPT2Gen) -> None:
    gen.prefill([(7, prompt(gen, 3))])
    too_long = [5] * (gen.max_context + 1)
    with pytest.raises(ModelError, match="prompt lengths"):
        gen.prefill([(1, prompt(gen, 4)), (2, too_long)])
    with pytest.raises(ModelError, match="already cached"):
        gen.prefill([(3, prompt(gen, 4)), (7, prompt(gen, 4))])
    assert gen.cached == 1 and gen.cache.ids == [7]  # none of 1, 2, 3 kept anything
    assert len(gen.prefill([(1, prompt(gen, 4)), (3, prompt(gen, 5))])) == 2  # the same ids are free to use


def test_decode_stops_at_the_context_limit(gen: GPT2Gen) -> None:
    gen.prefill([(1, prompt(gen, gen.max_context - 1))])
    token = gen.decode([(1, 5)])[0]  # the last free position
    with pytest.raises(ModelError, match="context limit"):
        gen.decode([(1, token)])


def test_encode_and_text(gen: GPT2Gen) -> None:
    ids = gen.encode("Hello, wonderful world")
    assert ids[0] == gen.tokenizer.cls_token_id and len(ids) > 3
    assert gen.text(ids) == "hello, wonderful world"
    assert gen.token_text(gen.tokenizer.convert_tokens_to_ids("##ing")) == "ing"
    assert gen.token_text(gen.tokenizer.convert_tokens_to_ids("hello")) == " hello"
    assert gen.token_text(gen.eos_id) == "[SEP]"  # type: ignore[arg-type]
    with pytest.raises(InputRejected, match="no tokens"):
        gen.encode("   ")
    with pytest.raises(InputRejected, match="shorten"):
        gen.encode("word " * gen.max_context)


def test_load_by_spec() -> None:
    gen = load_model("gpt2-tiny-random", device="cpu")
    assert isinstance(gen, GPT2Gen) and isinstance(gen, GenModel)
    assert (gen.name, gen.note, gen.max_context) == ("gpt2-tiny-random", MEANINGLESS, 512)
    assert gen.eos_id == gen.tokenizer.sep_token_id == gen.hf_model.config.eos_token_id
    again = gpt2_random(tiny=True, device="cpu")  # the same seed: the same weights
    assert torch.equal(gen.hf_model.lm_head.weight, again.hf_model.lm_head.weight)


def test_full_size_loads_and_steps() -> None:
    gen = load_model("gpt2-random", device="cpu")
    assert isinstance(gen, GPT2Gen)
    config = gen.hf_model.config
    assert (config.n_layer, config.n_embd, config.n_head, config.vocab_size, gen.max_context) == (12, 768, 12, 30522,
                                                                                                  1024)
    t = Tracker(gen)
    t.prefill([(1, gen.encode("a short prompt"))])
    t.decode([1])
