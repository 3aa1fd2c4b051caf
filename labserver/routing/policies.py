"""Routing policies: which replica takes a request. Plain Python, no Ray, no clock.

A policy sees the request (its prompt and, for multi-turn chat, a session id) and the
replicas as two parallel lists, their ids and their loads (requests each holds, queued or
running, as last reported: possibly stale), and returns the index of its choice. The same
objects decide in ``simulate_cluster`` (many replicas on a virtual clock) and inside the
live request routers, so what the simulation teaches is what runs.

- ``random``: uniform. Each replica is an independent M/M/1 queue at the cluster's load.
- ``round-robin``: in turn. Even counts, blind to how long each request takes.
- ``pow2``: the less loaded of two drawn at random (Mitzenmacher's power of two choices;
  Ray Serve's default). Its queue tail falls doubly exponentially instead of geometrically.
- ``least-loaded``: the least loaded of all, ties broken at random. Best with fresh loads;
  with stale ones every router sends its traffic to the same replica (herding).
- ``prefix-hash``: consistent hashing of the session id, or of the prompt's first
  characters: one replica per key, so its cache holds that key's prefix; blind to load.
  Adding a replica moves about 1/N of the keys.
- ``prefix-aware``: SGLang's cache-aware rule. While loads are balanced, the replica whose
  routed prompts share the longest prefix with this one (if the match covers at least
  ``match_threshold`` of the prompt; else the replica that has been sent the least text, so
  the most cache room); once the loads' spread passes both ``balance_abs`` and
  ``balance_rel`` x the smallest, the least loaded.

The two cache-aware policies key on a request's salt (its ``cache_salt``, or its tenant
under tenant isolation) with its prefix: a salted key is a keyed hash, the salt the key,
so equal prompts under two salts are two keys. A replica's cache shares nothing across
salts, and where a salted request goes says nothing about another salt's prompts (only
the loads, which every request moves, are common to all). No salt hashes as before.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from ..registry import registrar

__all__ = ["POLICIES", "LeastLoaded", "Policy", "PrefixAware", "PrefixHash", "Pow2", "RandomChoice", "RoundRobin",
           "Route", "make_policy", "policy_names", "register_policy"]


@dataclass(frozen=True)
class Route:
    """What a policy may read of a request."""

    prompt: str = ""
    session: str | None = None  # a conversation's id: its turns share their beginnings
    salt: str = ""  # its prefix-cache salt: only requests with the same salt share cached blocks ("": none)


class Policy:
    """One routing rule. ``choose`` returns an index into ``ids``/``loads``; never called with no replicas."""

    name: ClassVar[str] = ""

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    def choose(self, route: Route, ids: Sequence[str], loads: Sequence[float]) -> int:
        raise NotImplementedError


POLICIES: dict[str, Callable[..., Policy]] = {}


register_policy = registrar(POLICIES, "routing policy")  # by its ``name`` (``make_policy``, ``--router``)


def policy_names() -> list[str]:
    return sorted(POLICIES)


def make_policy(name: str, **options: object) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown router {name!r}: use one of {', '.join(policy_names())}") from None
    return factory(**options)


def _least(loads: Sequence[float], among: Sequence[int], rng: random.Random) -> int:
    """The least loaded of ``among``; a tie is broken at random (never always the first)."""
    low = min(loads[i] for i in among)
    tied = [i for i in among if loads[i] == low]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


@register_policy
class RandomChoice(Policy):
    name = "random"

    def choose(self, route: Route, ids: Sequence[str], loads: Sequence[float]) -> int:
        return self.rng.randrange(len(ids))


@register_policy
class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(seed)
        self.turn = 0

    def choose(self, route: Route, ids: Sequence[str], loads: Sequence[float]) -> int:
        self.turn += 1
        return (self.turn - 1) % len(ids)


@register_policy
class Pow2(Policy):
    name = "pow2"

    def choose(self, route: Route, ids: Sequence[str], loads: Sequence[float]) -> int:
        if len(ids) == 1:
            return 0
        return _least(loads, self.rng.sample(range(len(ids)), 2), self.rng)


@register_policy
class LeastLoaded(Policy):
    name = "least-loaded"

    def choose(self, route: Route, ids: Sequence[str], loads: Sequence[float]) -> int:
        return _least(loads, range(len(ids)), self.rng)


def _hash(text: str, salt: str = "") -> int:
    """64 bits of BLAKE2b of ``text``; with a salt, keyed by the salt's digest (never equal to an unsalted hash's
    input, nor to another salt's)."""
    key = hashlib.blake2b(salt.encode(), digest_size=32).digest() if salt else b""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8, key=key).digest(), "big")


def key_of(route: Route, chars: int) -> str:
    """What affinity keys on: the session, else the prompt's first ``chars`` characters."""
    return f"session:{route.session}" if route.session is not None else route.prompt[:chars]


@register_policy
class PrefixHash(Policy):
    """Consistent hashing: each replica owns ``points`` points on a ring; a key goes to the next point clockwise."""

    name = "prefix-hash"

    def __init__(self, seed: int | None = None, chars: int = 256, points: int = 100) -> None:
        super().__init__(seed)
        self.chars, self.points = chars, points
        self._ring: tuple[tuple[str, ...], list[tuple[int, str]]] = ((), [])

    def ring(self, ids: Sequence[str]) -> list[tuple[int, str]]:
        """The ring for these replicas (rebuilt only when they change)."""
        if self._ring[0] != tuple(ids):
            self._ring = (tuple(ids), sorted((_hash(f"{r}#{p}"), r) for r in ids for p in range(self.points)))
        return self._ring[1]

    def owner(self, key: str, ids: Sequence[str], salt: str = "") -> str:
        ring = self.ring(ids)
        at = bisect.bisect(ring, (_hash(key, salt), "")) % len(ring)
        return ring[at][1]

    def choose(self, route: Route, ids: Sequence[str], loads: Sequence[float]) -> int:
        return list(ids).index(self.owner(key_of(route, self.chars), ids, route.salt))


class PrefixIndex:
    """Which prompts went to one replica, as hashes of their first 1, 2, 3... blocks of ``block`` characters
    (keyed by their salt).

    The longest prefix two prompts share, to a block, is the most blocks whose hashes
    match: what a replica's prefix cache would hold of this prompt if it kept everything
    sent to it. Oldest entries beyond ``capacity`` blocks are forgotten first (as the
    replica's cache would evict them).
    """

    def __init__(self, block: int, capacity: int) -> None:
        self.block, self.capacity = block, capacity
        self.entries: OrderedDict[int, None] = OrderedDict()
        self.sent_chars = 0

    def keys(self, text: str, salt: str = "") -> list[int]:
        return [_hash(text[:end], salt) for end in range(self.block, len(text) + 1, self.block)]

    def match(self, keys: list[int]) -> int:
        """Blocks of the prompt (given by its ``keys``) already sent here."""
        n = 0
        for k in keys:
            if k not in self.entries:
                break
            n += 1
        return n

    def add(self, keys: list[int], chars: int) -> None:
        for k in keys:
            self.entries[k] = None
            self.entries.move_to_end(k)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
        self.sent_chars += chars


@register_policy
class PrefixAware(Policy):
    """SGLang's cache-aware routing: cache affinity while balanced, shortest queue once not."""

    name = "prefix-aware"

    def __init__(self, seed: int | None = None, block: int = 64, capacity: int = 100_000,
                 match_threshold: float = 0.5, balance_abs: float = 32, balance_rel: float = 1.5) -> None:
        super().__init__(seed)
        self.block, self.capacity = block, capacity
        self.match_threshold, self.balance_abs, self.balance_rel = match_threshold, balance_abs, balance_rel
        self.index: dict[str, PrefixIndex] = {}
        self.last: dict[str, object] = {}  # the last decision's reason, for the notebook and tests

    def balanced(self, loads: Sequence[float]) -> bool:
        low, high = min(loads), max(loads)
        return not (high - low > self.balance_abs and high > low * self.balance_rel)

    def choose(self, route: Route, ids: Sequence[str], loads: Sequence[float]) -> int:
        for gone in set(self.index) - set(ids):
            del self.index[gone]
        indexes = [self.index.setdefault(r, PrefixIndex(self.block, self.capacity)) for r in ids]
        text = route.prompt  # (a session's turns resend the conversation: its prefix is in the prompt)
        keys = indexes[0].keys(text, route.salt)
        if not self.balanced(loads):
            pick, reason = _least(loads, range(len(ids)), self.rng), "imbalanced: least loaded"
        else:
            matches = [ix.match(keys) for ix in indexes]
            best = max(matches)
            if keys and best / len(keys) >= self.match_threshold:
                longest = [i for i, m in enumerate(matches) if m == best]
                pick, reason = _least(loads, longest, self.rng), "longest prefix"
            else:
                sent = [ix.sent_chars for ix in indexes]
                pick = _least(sent, range(len(ids)), self.rng)
                reason = "no match: most cache room"
        indexes[pick].add(keys, len(text))
        self.last = {"reason": reason, "replica": ids[pick]}
        return pick
