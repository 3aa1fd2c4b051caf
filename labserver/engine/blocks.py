"""KV-cache memory as fixed-size blocks: who holds which block, and nothing else.

A generating sequence keeps the keys and values of every token it has seen, at every
layer: its KV cache. Here that memory is a pool of ``total`` blocks of ``block_tokens``
positions each (the pages of vLLM's PagedAttention, SOSP '23). A sequence's *block
table* lists its blocks in order: position p lives in block ``table[p // block_tokens]``
at offset ``p % block_tokens``. Blocks are taken as a sequence grows and given back
when it finishes, fails, leaves or is preempted, so memory follows what sequences hold,
not what they might one day need.

With prefix caching, a block whose positions are all computed is registered under a key
made of the previous block's key and its own tokens. Two prompts that begin with the
same tokens (one system prompt, one document) reach the same keys, so the second shares
the first's blocks (a reference count each) instead of computing them again. A
registered block that no table references stays *cached* until its memory is wanted;
then the least recently released goes first (a sequence's tail before its head, so a
shared prefix outlives the suffixes hung on it).

Every block is in exactly one state, and ``free + used + cached == total`` always::

    free     holds nothing worth keeping
    used     in at least one table (its reference count is how many)
    cached   in no table, but registered: a later prompt may reuse it

A request for several choices of one prompt (``n`` > 1) shares the same way without a
cache: ``fork`` starts a choice's table with the first choice's whole computed prompt
blocks, each referenced once more.

Only whole blocks strictly before a prompt's last token are ever shared: the last token
is always computed (its scores give the next token), so nobody writes into a shared block.

A *salt* (a request's ``cache_salt``, or its tenant under tenant isolation) is the root of
a table's chain: its first block's parent is the salt instead of nothing, so every key after
it differs too, and only tables started with the same salt reach the same keys. A salt is a
string and a key an int, so no salted chain can meet an unsalted one even on a hash
collision; the empty salt is no salt, and hashes exactly as before salts existed.

This module only counts blocks: pure Python, no torch. Who may take memory is a
strategy's rule (``labserver.strategies``), where keys and values sit is the model's
(``labserver.models.kvcache``), and the step engine joins the two.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Collection, Sequence

__all__ = ["BlockManager"]

Key = int  # a registered block's name: hash of (previous block's key, its tokens)
Parent = Key | str | None  # a first block's parent is its table's salt, or None (no salt)


class BlockManager:
    """Block tables per owner (the engine's sequence ids) over a pool of ``total`` blocks."""

    def __init__(self, total: int, block_tokens: int, *, prefix_cache: bool = False) -> None:
        if total < 1 or block_tokens < 1:
            raise ValueError(f"need at least one block of at least one token, got {total} x {block_tokens}")
        self.total, self.block_tokens, self.prefix_cache = total, block_tokens, prefix_cache
        self.tables: dict[int, list[int]] = {}  # owner -> its blocks, in position order
        self.refs = [0] * total  # block -> tables holding it
        self._free = list(range(total - 1, -1, -1))  # a stack: the block freed last is reused first (warm)
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced registered blocks, oldest first
        self._block_of: dict[Key, int] = {}  # prefix cache: key -> block
        self._key_of: dict[int, tuple[Key, Parent, tuple[int, ...]]] = {}  # block -> (key, parent, tokens)
        self._keys: dict[int, list[Key]] = {}  # owner -> keys of its leading full, computed blocks
        self._roots: dict[int, str | None] = {}  # owner -> its salt (None: none), the parent of its first block
        self._forked: set[int] = set()  # blocks shared by fork (registered or not), until they are free
        self.evicted = 0  # cached blocks whose memory was taken for something else

    # -- counts -----------------------------------------------------------------------------
    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def cached(self) -> int:
        return len(self._cached)

    @property
    def used(self) -> int:
        return self.total - self.free - self.cached

    @property
    def available(self) -> int:
        """Blocks a sequence could take now: the free ones and the cached ones (evicted when taken)."""
        return self.free + self.cached

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_tokens)

    # -- the prefix cache -------------------------------------------------------------------
    def _walk(self, tokens: Sequence[int], salt: str = "") -> list[tuple[Key, int]]:
        """(key, block) of the leading whole blocks of ``tokens`` found in the cache under ``salt``, before its last
        token."""
        found: list[tuple[Key, int]] = []
        if not self.prefix_cache:
            return found
        parent: Parent = salt or None
        b = self.block_tokens
        for i in range((len(tokens) - 1) // b):
            piece = tuple(tokens[i * b:(i + 1) * b])
            key = hash((parent, piece))
            block = self._block_of.get(key)
            if block is None or self._key_of[block][1:] != (parent, piece):  # (a hash collision is a miss)
                break
            found.append((key, block))
            parent = key
        return found

    def match(self, tokens: Sequence[int], salt: str = "") -> int:
        """Tokens at the start of ``tokens`` whose KV the cache already holds under ``salt`` (whole blocks)."""
        return len(self._walk(tokens, salt)) * self.block_tokens

    def cost(self, tokens: Sequence[int], positions: int, without: Collection[int] = (), salt: str = "") -> int:
        """Blocks taken from ``available`` by a new table for ``tokens`` that covers ``positions``.

        A hit on a block another table holds costs nothing; a hit on a cached block costs
        one (it stops being evictable); every other block is new. ``without``: as if these
        owners' tables were released first (a preemption planned, not yet made). Only hits under
        ``salt`` count.
        """
        dropped = self._dropped(without)
        shared = sum(1 for _, block in self._walk(tokens, salt) if self.refs[block] > dropped[block])
        return self.blocks_for(positions) - shared

    def freed_by(self, owners: Collection[int]) -> int:
        """Blocks that releasing these owners' tables would make available (those no other table holds)."""
        return sum(1 for block, n in self._dropped(owners).items() if self.refs[block] == n)

    def _dropped(self, owners: Collection[int]) -> Counter[int]:
        """Block -> references these owners' tables hold."""
        return Counter(block for owner in owners for block in self.tables.get(owner, ()))

    # -- a table's life ---------------------------------------------------------------------
    def start(self, owner: int, tokens: Sequence[int], salt: str = "") -> int:
        """A new table for ``owner``, holding the cached blocks its ``tokens`` begin with under ``salt`` (the root of
        every key it registers); returns their tokens."""
        if owner in self.tables:
            raise ValueError(f"owner {owner} already has a block table")
        hits = self._walk(tokens, salt)
        for _, block in hits:
            if not self.refs[block]:
                del self._cached[block]
            self.refs[block] += 1
        self.tables[owner] = [block for _, block in hits]
        self._keys[owner] = [key for key, _ in hits]
        self._roots[owner] = salt or None
        return len(hits) * self.block_tokens

    def fork(self, owner: int, parent: int, positions: int) -> int:
        """A new table for ``owner`` holding ``parent``'s whole blocks among its first ``positions`` positions
        (their KV computed: the caller's word), under ``parent``'s salt; returns their tokens."""
        if owner in self.tables:
            raise ValueError(f"owner {owner} already has a block table")
        shared = self.tables[parent][:positions // self.block_tokens]
        for block in shared:
            self.refs[block] += 1
        self._forked.update(shared)
        self.tables[owner] = list(shared)
        self._keys[owner] = self._keys[parent][:len(shared)]
        self._roots[owner] = self._roots[parent]
        return len(shared) * self.block_tokens

    def grow(self, owner: int, positions: int) -> bool:
        """Blocks for ``owner``'s first ``positions`` positions; False (and nothing taken) if too few are available."""
        table = self.tables[owner]
        need = self.blocks_for(positions) - len(table)
        if need > self.available:
            return False
        for _ in range(need):
            table.append(self._take())
        return True

    def shrink(self, owner: int, positions: int) -> None:
        """Give back ``owner``'s blocks past its first ``positions`` positions (guesses a verification rejected:
        ``labserver.engine.speculation``), as ``release`` gives back a whole table."""
        table = self.tables[owner]
        while len(table) > self.blocks_for(positions):
            self._drop(table.pop())

    def _drop(self, block: int) -> None:
        """One reference to ``block`` fewer; unreferenced, it is cached (registered) or free."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._forked.discard(block)
            if block in self._key_of:
                self._cached[block] = None
            else:
                self._free.append(block)

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # evict the least recently released cached block
            block, _ = self._cached.popitem(last=False)
            del self._block_of[self._key_of.pop(block)[0]]
            self.evicted += 1
        self.refs[block] = 1
        return block

    def registers(self, owner: int, positions: int) -> bool:
        """Whether ``computed(owner, ..., positions)`` would register a block (one more whole block computed): the
        caller builds the tokens only then (once per ``block_tokens`` decode steps)."""
        return self.prefix_cache and len(self._keys[owner]) < min(positions // self.block_tokens,
                                                                   len(self.tables[owner]))

    def computed(self, owner: int, tokens: Sequence[int], positions: int) -> None:
        """``owner``'s first ``positions`` positions hold KV now: register its whole blocks among them."""
        if not self.prefix_cache:
            return
        keys, table, b = self._keys[owner], self.tables[owner], self.block_tokens
        for i in range(len(keys), min(positions // b, len(table))):
            piece = tuple(tokens[i * b:(i + 1) * b])
            parent = keys[-1] if keys else self._roots[owner]
            key = hash((parent, piece))
            keys.append(key)
            block = table[i]
            if key not in self._block_of and block not in self._key_of:  # else: an equal block is cached already
                self._block_of[key] = block
                self._key_of[block] = (key, parent, piece)

    def release(self, owner: int) -> None:
        """Drop ``owner``'s table (finished, failed, left or preempted); unknown owners are ignored."""
        table = self.tables.pop(owner, None)
        self._keys.pop(owner, None)
        self._roots.pop(owner, None)
        for block in reversed(table or []):  # tail first: it is evicted before the head
            self._drop(block)

    def check(self) -> None:
        """Assert the invariants: exact reference counts, one state per block, no block twice in a table."""
        counted = [0] * self.total
        for owner, table in self.tables.items():
            assert len(set(table)) == len(table), f"owner {owner} holds a block twice: {table}"
            for block in table:
                counted[block] += 1
        assert counted == self.refs, "reference counts differ from the tables"
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "a block is free twice"
        assert not free & cached, "a block is both free and cached"
        for block in range(self.total):
            states = (block in free) + (block in cached) + (self.refs[block] > 0)
            assert states == 1, f"block {block} is in {states} states"
            if self.refs[block] > 1:
                assert block in self._key_of or block in self._forked, f"block {block} is shared but was never " \
                                                                        "registered or forked"
        assert all(block in self._key_of for block in cached), "an unregistered block is cached"
        assert all(self._block_of[key] == block for block, (key, *_) in self._key_of.items())
        assert self.free + self.used + self.cached == self.total
