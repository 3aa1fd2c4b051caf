"""The block manager: invariants under random admit/grow/free/preempt sequences, and what each call promises."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from labserver.engine.blocks import BlockManager

B = 4  # tokens per block in these tests: small, so sequences span many blocks


def test_a_table_grows_a_block_at_a_time_and_release_frees_it() -> None:
    m = BlockManager(4, B)
    assert m.start(1, [1, 2, 3]) == 0 and m.tables[1] == []
    assert m.grow(1, 3) and len(m.tables[1]) == 1
    assert m.grow(1, 4) and len(m.tables[1]) == 1  # position 3 still fits the first block
    assert m.grow(1, 5) and len(m.tables[1]) == 2
    assert not m.grow(1, 4 * B + 1)  # 5 blocks: more than the pool
    assert len(m.tables[1]) == 2  # all or nothing
    assert (m.free, m.used, m.cached) == (2, 2, 0)
    m.release(1)
    m.release(99)  # unknown: ignored
    assert (m.free, m.used, m.cached) == (4, 0, 0)
    m.check()


def test_the_block_freed_last_is_reused_first() -> None:
    m = BlockManager(8, B)
    m.start(1, [1])
    m.grow(1, 1)
    m.start(2, [1])
    m.grow(2, 1)
    first = m.tables[1][0]
    m.release(1)
    m.start(3, [1])
    m.grow(3, 1)
    assert m.tables[3] == [first]  # still warm in the CPU's cache


def test_a_shared_prefix_is_computed_once() -> None:
    m = BlockManager(16, B, prefix_cache=True)
    prompt = list(range(10))  # blocks [0..3] [4..7] and a partial [8, 9]
    assert m.start(1, prompt) == 0
    m.grow(1, len(prompt))
    m.computed(1, prompt, len(prompt))
    assert m.match(prompt) == 8  # two whole blocks; the last token's block is never shared
    other = [*range(8), 50, 51, 52]
    assert m.cost(other, len(other)) == 1  # 3 blocks, 2 of them shared with a live table
    assert m.start(2, other) == 8
    assert m.tables[2] == m.tables[1][:2] and m.refs[m.tables[1][0]] == 2
    assert m.match([*range(4), 99, 5, 6, 7, 8]) == 4  # the chain breaks at the second block
    assert m.match(list(range(8))) == 4  # 8 tokens: the block holding the last token is computed anew
    m.check()


def test_registers_says_whether_computed_would_register_a_block() -> None:
    """The scheduler builds a sequence's tokens for ``computed`` only when ``registers`` says a whole block is new."""
    m = BlockManager(16, B, prefix_cache=True)
    tokens = list(range(11))
    m.start(1, tokens[:3])
    m.grow(1, 11)
    assert not m.registers(1, 3)  # no whole block yet
    assert m.registers(1, 4) and m.registers(1, 9)
    m.computed(1, tokens, 9)  # two whole blocks registered
    assert not m.registers(1, 9) and not m.registers(1, 11)
    m.grow(1, 12)
    assert m.registers(1, 12)
    m.computed(1, [*tokens, 11], 12)
    assert not m.registers(1, 99)  # never past the blocks its table holds
    plain = BlockManager(16, B)
    plain.start(1, tokens)
    plain.grow(1, 11)
    assert not plain.registers(1, 11)  # no prefix cache: nothing is ever registered


def test_cached_blocks_outlive_their_table_and_are_evicted_least_recent_first() -> None:
    m = BlockManager(4, B, prefix_cache=True)
    a = list(range(9))  # two whole blocks and one partial
    m.start(1, a)
    m.grow(1, 9)
    m.computed(1, a, 9)
    m.release(1)
    assert (m.free, m.used, m.cached) == (2, 0, 2)  # the partial block is simply free
    assert m.cost(a, 9) == 3  # the two hits stop being evictable: they count too
    assert m.start(2, a) == 8  # reused after its table was gone
    m.release(2)
    m.start(3, [7, 7, 7, 7, 7])
    assert m.grow(3, 5 + 2 * B)  # 4 blocks: the free one, then both cached ones are evicted
    assert m.evicted == 2 and m.match(a) == 0
    m.check()


def test_the_tail_is_evicted_before_the_head() -> None:
    m = BlockManager(4, B, prefix_cache=True)
    a = list(range(13))
    m.start(1, a)
    m.grow(1, 13)
    m.computed(1, a, 13)
    m.release(1)  # three cached blocks, one free
    m.start(2, [9])
    m.grow(2, 2 * B)  # takes the free block and evicts one cached: the last one of the prefix
    assert m.match(a) == 2 * B


def test_without_prefix_caching_nothing_is_shared() -> None:
    m = BlockManager(8, B)
    a = list(range(10))
    m.start(1, a)
    m.grow(1, 10)
    m.computed(1, a, 10)
    assert m.match(a) == 0 and m.start(2, a) == 0
    m.release(1)
    assert m.cached == 0


def test_a_fork_shares_the_whole_computed_blocks_without_a_cache() -> None:
    m = BlockManager(8, B)  # no prefix cache: only a fork shares
    m.start(1, list(range(10)))
    m.grow(1, 11)  # a prompt of 10 and its next token: 3 blocks
    assert m.fork(2, 1, 9) == 8 and m.tables[2] == m.tables[1][:2]  # positions 0-7: two whole blocks
    assert [m.refs[b] for b in m.tables[1]] == [2, 2, 1]
    assert m.grow(2, 11) and m.tables[2][2] != m.tables[1][2]  # its own third block
    m.check()
    m.release(1)  # the first choice finishes first: the shared blocks stay, held by the second
    assert (m.used, m.free) == (3, 5)
    m.check()
    m.release(2)
    assert (m.used, m.free, m.cached) == (0, 8, 0)
    m.check()


def test_a_planned_release_counts_what_the_real_one_frees() -> None:
    """``freed_by`` and ``cost(..., without=)`` plan a preemption: they must agree with releasing for real,
    shared blocks included (a victim's block another table holds frees nothing; a hit on a block only
    victims hold costs one once they let it go)."""
    import copy

    m = BlockManager(16, B, prefix_cache=True)
    shared = list(range(1, 2 * B + 1))  # two whole blocks every table begins with
    for owner, tail in ((1, [90, 91]), (2, [80]), (3, [70, 71, 72, 73, 74])):
        m.start(owner, shared + tail)
        m.grow(owner, len(shared) + len(tail) + 1)
        m.computed(owner, shared + tail, len(shared) + len(tail))
    newcomer = shared + [60]
    for victims in ([1], [1, 2], [1, 2, 3], [3]):
        after = copy.deepcopy(m)
        for v in victims:
            after.release(v)
        assert m.available + m.freed_by(victims) == after.available, victims
        assert m.cost(newcomer, len(newcomer) + 1, victims) == after.cost(newcomer, len(newcomer) + 1), victims
    assert m.freed_by([1]) == 1 and m.freed_by([1, 2, 3]) == 2 + 1 + 1 + 2  # the shared two only with all three
    assert m.cost(newcomer, len(newcomer) + 1) == 1 and m.cost(newcomer, len(newcomer) + 1, [1, 2, 3]) == 3


def computed_table(m: BlockManager, owner: int, tokens: list[int], salt: str = "") -> int:
    """A table for ``tokens`` under ``salt``, its every position computed; returns the prefix cache's hit."""
    hit = m.start(owner, tokens, salt)
    m.grow(owner, len(tokens))
    m.computed(owner, tokens, len(tokens))
    return hit


def test_only_tables_with_the_same_salt_share_cached_blocks() -> None:
    m = BlockManager(16, B, prefix_cache=True)
    prompt = list(range(10))  # two whole blocks before its last token
    assert computed_table(m, 1, prompt, "tenant-a") == 0
    assert m.match(prompt, "tenant-b") == 0 and m.match(prompt) == 0  # no other salt, and no salt, reaches them
    assert m.cost(prompt, len(prompt), salt="tenant-b") == 3
    assert computed_table(m, 2, prompt, "tenant-b") == 0
    assert not set(m.tables[1]) & set(m.tables[2])  # the same tokens, two copies
    assert m.match(prompt, "tenant-a") == 8 and m.cost(prompt, len(prompt), salt="tenant-a") == 1
    assert computed_table(m, 3, prompt, "tenant-a") == 8 and m.tables[3][:2] == m.tables[1][:2]
    m.check()


def test_no_salt_keys_blocks_as_before_salts_existed() -> None:
    """The empty salt is no salt: the first block's parent is None, every key hash((parent, tokens)), as always."""
    m = BlockManager(8, B, prefix_cache=True)
    prompt = list(range(10))
    computed_table(m, 1, prompt, "")
    first = hash((None, tuple(prompt[:B])))
    assert m._key_of[m.tables[1][0]][0] == first
    assert m._key_of[m.tables[1][1]][0] == hash((first, tuple(prompt[B:2 * B])))
    assert m.match(prompt) == 8


def test_a_fork_and_a_preempted_table_keep_their_salt() -> None:
    m = BlockManager(16, B, prefix_cache=True)
    prompt = list(range(10))
    computed_table(m, 1, prompt, "s")
    m.fork(2, 1, len(prompt) - 1)
    m.grow(2, len(prompt) + B)
    longer = prompt + [50, 51, 52, 53, 54]
    m.computed(2, longer, len(longer))  # the fork registers its own third block under the first's salt
    assert m.match(longer, "s") == 12 and m.match(longer) == 0
    m.release(1)
    m.release(2)  # preempted: its blocks cached under "s", found again when it is admitted again
    assert m.start(2, longer, "s") == 12 and m.match(longer, "t") == 0
    m.check()


def test_bad_pools_and_a_second_table_are_refused() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, B)
    m = BlockManager(2, B)
    m.start(1, [1])
    with pytest.raises(ValueError, match="already"):
        m.start(1, [1])


class Sequences(RuleBasedStateMachine):
    """Random sequences admitted, grown a token at a time, computed, finished or preempted.

    Beside the manager, a pool of what each block *holds* (token ids where the model would
    keep keys and values, each with the salt of the sequence that wrote it) is written as a
    model would write it. Reading every sequence back through its table must give its own
    tokens under its own salt: a shared block holds exactly what each sharer would have
    computed, no one's blocks were handed to someone else, and no salt reads another's.
    """

    def __init__(self) -> None:
        super().__init__()
        self.m = BlockManager(12, B, prefix_cache=True)
        self.pool: dict[int, list[tuple[str, int] | None]] = {}
        self.seqs: dict[int, list[int]] = {}  # owner -> its tokens
        self.salts: dict[int, str] = {}  # owner -> its salt
        self.done: dict[int, int] = {}  # owner -> positions computed
        self.next_owner = 1

    def write(self, owner: int, upto: int) -> None:
        table, tokens = self.m.tables[owner], self.seqs[owner]
        for p in range(self.done[owner], upto):
            slot = self.pool.setdefault(table[p // B], [None] * B)
            slot[p % B] = (self.salts[owner], tokens[p])
        self.done[owner] = upto
        self.m.computed(owner, tokens, upto)

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
          rest=st.lists(st.integers(1, 3), min_size=1, max_size=9), salt=st.sampled_from(["", "a", "b"]))
    def admit(self, prefix: list[int], rest: list[int], salt: str) -> None:
        tokens, owner = prefix + rest, self.next_owner
        self.next_owner += 1
        need, available = self.m.cost(tokens, len(tokens), salt=salt), self.m.available
        hit = self.m.match(tokens, salt)
        assert self.m.start(owner, tokens, salt) == hit and hit < len(tokens)
        if not self.m.grow(owner, len(tokens)):  # refused exactly when the cost was over what was available
            assert need > available
            self.m.release(owner)
            return
        assert need <= available and self.m.available == available - need
        self.seqs[owner], self.done[owner], self.salts[owner] = tokens, hit, salt
        self.write(owner, len(tokens))  # the prefill: only the tokens after the hit are computed

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(1, 3))
    def decode(self, data: st.DataObject, token: int) -> None:
        owner = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens = self.seqs[owner]
        tokens.append(token)
        if self.m.grow(owner, len(tokens)):
            self.write(owner, len(tokens))
        else:  # no block for it: preempted, as the paged strategy does
            self.m.release(owner)
            del self.seqs[owner], self.done[owner]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), rest=st.lists(st.integers(1, 3), min_size=1, max_size=6))
    def fork(self, data: st.DataObject, rest: list[int]) -> None:
        """Another choice of a running sequence's first ``k`` tokens (n > 1): its whole computed blocks shared."""
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        k = data.draw(st.integers(1, self.done[parent]))
        tokens, owner = self.seqs[parent][:k] + rest, self.next_owner
        self.next_owner += 1
        shared = self.m.fork(owner, parent, k - 1)
        assert shared == (k - 1) // B * B and self.m.tables[owner] == self.m.tables[parent][:shared // B]
        if not self.m.grow(owner, len(tokens)):
            self.m.release(owner)
            return
        self.seqs[owner], self.done[owner], self.salts[owner] = tokens, shared, self.salts[parent]
        self.write(owner, len(tokens))  # only what follows the shared blocks is computed

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish_or_leave(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(self.seqs)))
        self.m.release(owner)
        del self.seqs[owner], self.done[owner]

    @invariant()
    def counts_are_exact(self) -> None:
        self.m.check()
        assert self.m.used == len({b for t in self.m.tables.values() for b in t})

    @invariant()
    def every_sequence_reads_back_its_own_tokens(self) -> None:
        for owner, tokens in self.seqs.items():
            table = self.m.tables[owner]
            assert len(table) == self.m.blocks_for(len(tokens))
            read = [self.pool[table[p // B]][p % B] for p in range(self.done[owner])]
            assert read == [(self.salts[owner], t) for t in tokens[:self.done[owner]]]

    def teardown(self) -> None:
        for owner in list(self.seqs):
            self.m.release(owner)
        self.m.check()
        assert self.m.used == 0  # every block free or cached once every sequence is gone


def test_random_admit_grow_free_preempt() -> None:
    """The machine run as a plain test, made by a function: hypothesis digests the class it is handed by its
    source, which CPython 3.11.7 finds with ``ast.parse``, and that can fail once other tests have run in the
    process ("AST constructor recursion depth mismatch", as ``test_layout`` says); a function's source it finds
    without parsing."""
    run_state_machine_as_test(lambda: Sequences(),  # (a function, not the class: see above)
                              settings=settings(max_examples=150, stateful_step_count=40, deadline=None))
