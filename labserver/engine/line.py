"""The waiting line: one FIFO per priority class, the best class first, a discipline within it.

Every queue an engine reads (the live ``ItemQueue`` and the virtual clock's queues) keeps
its waiting requests here, so that the same code decides who goes next in both. A
request's class is its ``priority`` (lower first, 0 when it has none); within the best
class that has anyone waiting, the strategy's discipline (``labserver.strategies.queueing``)
picks who goes next and sheds whoever it refuses, at the moment a request is handed out or
the waiting are read. The line remembers when it was last empty: what tells a standing
queue from a passing burst.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from ..strategies.queueing import FIFO, Discipline, priority_of

__all__ = ["Line"]


class Line:
    """Requests waiting, by class; ``pop`` hands out the discipline's pick and sheds its refusals."""

    def __init__(self, discipline: Discipline | None = None, on_shed: Callable[[Any, str], None] = lambda item, why: None,
                 now: float = 0.0) -> None:
        self.discipline = discipline if discipline is not None else FIFO()
        self._on_shed = on_shed  # a request the discipline refused: answer it (503) and count it
        self._classes: dict[int, deque[Any]] = {}
        self.last_empty_s = now  # the last time nobody waited

    def __len__(self) -> int:
        return sum(len(line) for line in self._classes.values())

    def __iter__(self) -> Iterator[Any]:
        """Every waiting request: the best class first, arrival order within one."""
        for key in sorted(self._classes):
            yield from self._classes[key]

    def _line(self, item: Any) -> deque[Any]:
        return self._classes.setdefault(priority_of(item), deque())

    def put(self, item: Any) -> None:
        if not len(self):  # nobody waited until this one came
            self.last_empty_s = max(self.last_empty_s, getattr(item, "enqueued_s", self.last_empty_s))
        self._line(item).append(item)

    def putback(self, item: Any) -> None:
        """To the head of its class: it goes first next time."""
        self._line(item).appendleft(item)

    def take(self, items: list[Any]) -> None:
        chosen = {id(item) for item in items}
        for key, line in self._classes.items():
            self._classes[key] = deque(item for item in line if id(item) not in chosen)
        self._tidy()

    def remove_if(self, dead: Callable[[Any], bool]) -> list[Any]:
        """Drop every request ``dead`` says is gone; those dropped."""
        dropped: list[Any] = []
        for key, line in self._classes.items():
            if any(dead(item) for item in line):
                dropped += [item for item in line if dead(item)]
                self._classes[key] = deque(item for item in line if not dead(item))
        self._tidy()
        return dropped

    def prune_ends(self, dead: Callable[[Any], bool]) -> list[Any]:
        """Drop the gone from both ends of every class (where the next pick comes from); those dropped.

        Cheap enough for every hand-out; ``remove_if`` scans the whole line."""
        dropped: list[Any] = []
        for line in self._classes.values():
            while line and dead(line[0]):
                dropped.append(line.popleft())
            while line and dead(line[-1]):
                dropped.append(line.pop())
        if dropped:
            self._tidy()
        return dropped

    def drain(self) -> list[Any]:
        items = list(self)
        self._classes = {}
        return items

    def mark(self, now: float) -> None:
        """Note the time whenever nobody waits (call before reading a standing queue)."""
        if not len(self):
            self.last_empty_s = now

    def shed(self, now: float) -> None:
        """Refuse whoever the discipline sheds now, in every class."""
        standing = self.discipline.standing(now, self.last_empty_s)
        refused_any = False
        for key, line in self._classes.items():
            refused = self.discipline.shed(line, now, standing)
            if refused:
                refused_any = True
                gone = {id(item) for item in refused}
                if all(id(line[k]) in gone for k in range(len(refused))):  # a prefix (codel's): pop it
                    for _ in refused:
                        line.popleft()
                else:
                    self._classes[key] = deque(item for item in line if id(item) not in gone)
                for item in refused:
                    self._on_shed(item, self.discipline.name)
        if refused_any:
            self._tidy()

    def pop(self, now: float) -> Any | None:
        """The discipline's pick from the best class with anyone waiting (after its sheds); None if empty."""
        self.mark(now)
        self.shed(now)
        for key in sorted(self._classes):
            line = self._classes[key]
            if line:
                standing = self.discipline.standing(now, self.last_empty_s)
                index = self.discipline.pick(line, standing)
                item = line[index]
                del line[index]
                self.mark(now)
                return item
        return None

    def _tidy(self) -> None:
        self._classes = {key: line for key, line in self._classes.items() if line}
