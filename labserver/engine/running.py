"""The running batch as a strategy's rule sees it: the sequences admitted and not yet done, and their KV blocks.

``RunningSeqs`` implements ``labserver.strategies.generate.Running``: what a rule may ask
about the batch before it admits or preempts (how many run, the tokens and blocks they hold
and may need, the blocks free), and ``without`` to ask the same of a plan. The scheduler
(``labserver.engine.scheduler``) keeps one and changes it; nothing here decides.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from .blocks import BlockManager
from .sequence import Seq

__all__ = ["RunningSeqs"]


class RunningSeqs:
    """The sequences admitted and not yet done, and the KV blocks they hold: what a rule sees as ``Running``
    (``labserver.strategies.generate.Running``, the protocol this implements)."""

    def __init__(self, blocks: BlockManager, seqs: Sequence[Seq] = (), released: Sequence[Seq] = ()) -> None:
        self.seqs: list[Seq] = list(seqs)  # in admission order: the last one is the newest
        self.blocks = blocks
        self._released = {s.sid for s in released}  # planned preemptions: their blocks counted as given back

    def without(self, seqs: Sequence[Seq]) -> RunningSeqs:
        """The batch as it would be with these preempted: a plan, nothing moves until the scheduler acts on it."""
        gone = {s.sid for s in seqs}
        return RunningSeqs(self.blocks, [s for s in self.seqs if s.sid not in gone], [*seqs])

    def __len__(self) -> int:
        return len(self.seqs)

    def __iter__(self) -> Iterator[Seq]:
        return iter(self.seqs)

    @property
    def reserved(self) -> int:
        return sum(s.reserve for s in self.seqs)

    @property
    def kv_tokens(self) -> int:
        return sum(s.kv_tokens for s in self.seqs)

    @property
    def total_blocks(self) -> int:
        return self.blocks.total

    @property
    def free_blocks(self) -> int:
        """Blocks a sequence could take now (the prefix cache's unreferenced ones included)."""
        return self.blocks.available + self.blocks.freed_by(self._released)

    @property
    def reserved_blocks(self) -> int:
        return sum(self.blocks_for(s.reserve) for s in self.seqs)

    def blocks_for(self, tokens: int) -> int:
        return self.blocks.blocks_for(tokens)

    def blocks_needed(self, seqs: Sequence[Seq]) -> int:
        """Blocks these waiting sequences take if admitted now: their context and the token they make next,
        less what a prefix cache shares with the running ones."""
        return sum(self.blocks.cost(s.context, s.kv_tokens + 1, self._released, s.cache_salt) for s in seqs)
