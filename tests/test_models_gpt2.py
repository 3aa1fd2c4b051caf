"""Our GPT-2 forward pass over a paged KV cache against transformers' own model (tiny, random weights, CPU)."""

from __future__ import annotations

import pytest
import torch

from labserver.engine.blocks import BlockManager
from labserver.models import MEANINGLESS, Chunk, GenModel, InputRejected, ModelError, load_model
from labserver.models.gpt2 import GPT2Gen, gpt2_random

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
    """Sequences with block tables (small blocks, so they interleave in the pool), each step checked
    against transformers over the sequence's whole context."""

    def __init__(self, gen: GPT2Gen, blocks: int = 64, block_tokens: int = 4, prefix_cache: bool = False) -> None:
        self.gen = gen
        gen.allocate_kv(blocks, block_tokens)
        self.blocks = BlockManager(blocks, block_tokens, prefix_cache=prefix_cache)
        self.ids: dict[int, list[int]] = {}  # seq id -> prompt + tokens so far
        self.done: dict[int, int] = {}  # seq id -> positions computed

    def add(self, sid: int, ids: list[int]) -> int:
        self.ids[sid] = list(ids)
        self.done[sid] = self.blocks.start(sid, ids)
        return self.done[sid]

    def chunk(self, sid: int, n: int | None = None) -> Chunk:
        start = self.done[sid]
        end = len(self.ids[sid]) if n is None else start + n
        assert self.blocks.grow(sid, end)
        return Chunk(sid, self.ids[sid][start:end], start, tuple(self.blocks.tables[sid]),
                     sample=end == len(self.ids[sid]))

    def run(self, work: list[tuple[int, int | None]]) -> None:
        """One call: each (sid, n) computes n of its pending tokens (None: all); checked, then the argmax appended."""
        chunks = [self.chunk(sid, n) for sid, n in work]
        rows = iter(self.gen.logits(chunks))
        for c in chunks:
            self.done[c.sid] = c.end
            self.blocks.computed(c.sid, self.ids[c.sid], c.end)
            if c.sample:
                row = next(rows)
                torch.testing.assert_close(row, hf_next_logits(self.gen, self.ids[c.sid]), atol=ATOL, rtol=0)
                self.ids[c.sid].append(int(row.argmax()))

    def decode(self, sids: list[int]) -> None:
        self.run([(s, None) for s in sids])

    def release(self, sid: int) -> None:
        self.blocks.release(sid)
        self.gen.release([sid])
        del self.ids[sid], self.done[sid]


def test_logits_match_transformers_as_sequences_join_and_leave(gen: GPT2Gen) -> None:
    t = Tracker(gen)
    for sid, ids in ((1, prompt(gen, 5)), (2, prompt(gen, 12, 100)), (3, prompt(gen, 2, 200))):
        t.add(sid, ids)
    t.run([(1, None), (2, None), (3, None)])  # three prompts of three lengths, one call
    for _ in range(3):
        t.decode([1, 2, 3])
    t.release(2)  # its blocks go back and are taken by the next
    for _ in range(2):
        t.decode([3, 1])  # any order
    t.add(4, prompt(gen, 9, 300))
    t.run([(4, None)])  # joins later, shorter than some, longer than others
    for _ in range(3):
        t.decode([4, 1, 3])
    t.decode([3])  # any subset
    tables = [t.blocks.tables[s] for s in (1, 3, 4)]
    assert any(b > a + 1 for table in tables for a, b in zip(table, table[1:]))  # blocks interleave in the pool
    t.blocks.check()


def test_a_prompt_in_pieces_equals_it_whole_and_decodes_ride_along(gen: GPT2Gen) -> None:
    t = Tracker(gen)
    t.add(1, prompt(gen, 6))
    t.run([(1, None)])
    t.add(2, prompt(gen, 23, 500))
    t.run([(1, None), (2, 7)])  # a decode and the first 7 prompt tokens: one call (chunked prefill)
    t.run([(1, None), (2, 9)])  # the next 9: queries attend over the cached 7 and, causally, each other
    t.run([(2, None), (1, None)])  # the last 7, and the first token
    whole = Tracker(gpt2_random(tiny=True, device="cpu"))
    whole.add(2, prompt(gen, 23, 500))
    whole.run([(2, None)])
    assert whole.ids[2][-1] == t.ids[2][23]


def test_a_cached_prefix_is_read_not_computed(gen: GPT2Gen) -> None:
    t = Tracker(gen, prefix_cache=True)
    shared = prompt(gen, 13, 700)  # three whole blocks of 4 and one token
    t.add(1, shared + [3000, 3001])
    t.run([(1, None)])
    assert t.add(2, shared + [3100, 3101, 3102]) == 12  # 12 positions read from 1's blocks
    assert t.blocks.tables[2] == t.blocks.tables[1][:3]
    t.run([(2, None)])  # computes 4 tokens at positions 12..15 over the shared 12
    t.decode([1, 2])
    t.release(1)
    t.decode([2])  # the shared blocks outlive the sequence that computed them


def test_tokens_do_not_depend_on_batch_companions(gen: GPT2Gen) -> None:
    target = prompt(gen, 7, 500)
    alone = Tracker(gen)
    alone.add(11, target)
    alone.run([(11, None)])
    for _ in range(9):
        alone.decode([11])
    company = Tracker(gen)
    for sid, ids in ((10, prompt(gen, 20, 40)), (11, target), (12, prompt(gen, 2, 70))):
        company.add(sid, ids)
    company.run([(10, None), (11, None), (12, None)])
    for step in range(9):
        if step == 3:  # one joins: its first 10 prompt tokens ride along with the decodes, the rest next step
            company.add(13, prompt(gen, 30, 90))
            company.run([(13, 10), (11, None), (10, None), (12, None)])
            continue
        if step == 5:
            company.release(10)
        company.decode([s for s in (10, 11, 12, 13) if s in company.ids])
    assert company.ids[11] == alone.ids[11]


def test_decode_needs_a_prefill_and_release_forgets(gen: GPT2Gen) -> None:
    gen.allocate_kv(8, 4)
    chunk = Chunk(1, [5, 6], 0, (0,))
    assert len(gen.forward([chunk])) == 1 and gen.cached == 1
    gen.release([1, 99])  # 99 was never there: ignored
    assert gen.cached == 0
    with pytest.raises(ModelError, match="no cache"):
        gen.forward([Chunk(1, [7], 2, (0,), decode=True)])


def test_blocks_that_do_not_hold_the_positions_are_refused(gen: GPT2Gen) -> None:
    gen.allocate_kv(4, 4)
    with pytest.raises(ModelError, match="do not hold"):
        gen.forward([Chunk(1, list(range(2000, 2006)), 0, (0,))])  # 6 positions, one block of 4
    with pytest.raises(ModelError, match="do not hold"):
        gen.forward([Chunk(1, [2000], 0, (9,))])  # no block 9 in a pool of 4
    assert gen.cached == 0


def test_the_context_limit_is_kept(gen: GPT2Gen) -> None:
    gen.allocate_kv(gen.max_context // 16 + 1, 16)
    table = tuple(range(gen.max_context // 16 + 1))
    last = gen.forward([Chunk(1, prompt(gen, gen.max_context - 1), 0, table)])[0]
    assert last is not None and len(gen.forward([Chunk(1, [last], gen.max_context - 1, table, decode=True)])) == 1
    with pytest.raises(ModelError, match="context limit"):
        gen.forward([Chunk(1, [last], gen.max_context, table, decode=True)])


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
    assert gen.kv.bytes_per_token == 2 * 2 * 64 * 4  # K and V, 2 layers, 64 wide, float32


def test_full_size_loads_and_steps() -> None:
    gen = load_model("gpt2-random", device="cpu")
    assert isinstance(gen, GPT2Gen)
    config = gen.hf_model.config
    assert (config.n_layer, config.n_embd, config.n_head, config.vocab_size, gen.max_context) == (12, 768, 12, 30522,
                                                                                                  1024)
    t = Tracker(gen, blocks=8, block_tokens=16)
    t.add(1, gen.encode("a short prompt"))
    t.run([(1, None)])
    t.decode([1])
