"""Several kinds of traffic in one run: flows and their mix.

A ``Flow`` is one kind of request: its share of the arrivals, the priority class and
tenant it is sent under (``x-priority`` / ``x-tenant`` headers, ``labserver.wire``; the
OpenAI APIs also get ``"priority"`` in the body, as vLLM reads it), the latency targets
its own goodput is judged by, and optionally its own prompts and output lengths
(interactive questions with short answers beside long batch jobs). A ``Mix`` is a list
of flows whose shares are normalised; each scheduled request is dealt to a flow by a
seeded draw of its own (``assign``), so the same seed deals the same flows whatever the
arrival times are.

On the command line a mix is a compact string (``parse_mix``)::

    interactive:0.2:priority=0:ttft=500,batch:0.8:priority=1:tokens=uniform:200:400

Nothing here sends anything (``labserver.loadgen`` does) or judges records
(``labserver.analysis.flows`` does).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import wire
from .lengths import (ConstantLength, GeometricLength, LengthsLike, UniformLength, make_lengths, parse_lengths,
                      take_lengths)
from .payloads import Inputs, PayloadLike, take_requests

__all__ = ["Flow", "Mix", "MixLike", "make_mix", "parse_mix"]

_MIX_STREAM = 3  # the seed's third stream: arrivals use seed, payloads [seed, 1], lengths [seed, 2]

# compact-string keys -> Flow fields
_KEYS = {"priority": "priority", "tenant": "tenant", "slo": "slo_ms", "ttft": "ttft_slo_ms",
         "tpot": "tpot_slo_ms", "tokens": "new_tokens"}
_SPEC_HELP = ("a mix is flows separated by ',', each NAME:SHARE then any of :priority=INT :tenant=NAME "
              ":slo=MS :ttft=MS :tpot=MS :tokens=LENGTHS, e.g. "
              "'interactive:0.2:priority=0:ttft=500,batch:0.8:priority=1'")


@dataclass(frozen=True)
class Flow:
    """One kind of request in a mix."""

    name: str
    share: float = 1.0  # of the arrivals, relative to the other flows' (normalised in Mix)
    priority: int | None = None  # sent as x-priority (lower is served first); None: not sent
    tenant: str | None = None  # sent as x-tenant; None: not sent
    slo_ms: float | None = None  # goodput: latency within this, ms (encoders)
    ttft_slo_ms: float | None = None  # generation goodput: time to first token within this, ms
    tpot_slo_ms: float | None = None  # generation goodput: time per output token within this, ms
    payload: PayloadLike | None = field(default=None, compare=False)  # own texts; None: the run's payload
    new_tokens: LengthsLike | None = None  # generation: own output lengths; None: the run's new_tokens

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or any(c in self.name for c in ",:="):
            raise ValueError(f"a flow's name must be a non-empty str without ',', ':' or '=', got {self.name!r}")
        if not (isinstance(self.share, (int, float)) and math.isfinite(self.share) and self.share > 0):
            raise ValueError(f"flow {self.name!r}: share must be a number > 0, got {self.share!r}")
        if self.priority is not None and (isinstance(self.priority, bool)
                                          or not isinstance(self.priority, (int, np.integer))):
            raise ValueError(f"flow {self.name!r}: priority must be an int (lower is served first), "
                             f"got {self.priority!r}")
        if self.tenant is not None and (not isinstance(self.tenant, str) or not self.tenant.isprintable()
                                        or "," in self.tenant or ":" in self.tenant):
            raise ValueError(f"flow {self.name!r}: tenant must be a printable str without ',' or ':', "
                             f"got {self.tenant!r}")
        for name in ("slo_ms", "ttft_slo_ms", "tpot_slo_ms"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"flow {self.name!r}: {name} must be a number of ms > 0, got {value!r}")
        if self.new_tokens is not None:
            make_lengths(self.new_tokens)  # fails now, naming what to pass

    def headers(self) -> dict[str, str]:
        """The headers every request of this flow carries (empty when it sets neither)."""
        out = {}
        if self.priority is not None:
            out[wire.HEADER_PRIORITY] = str(int(self.priority))
        if self.tenant is not None:
            out[wire.HEADER_TENANT] = self.tenant
        return out

    def targets(self) -> dict[str, float | None]:
        """Its goodput targets, as ``analysis.summarize`` takes them."""
        return {"slo_ms": self.slo_ms, "ttft_slo_ms": self.ttft_slo_ms, "tpot_slo_ms": self.tpot_slo_ms}

    def bare(self) -> Flow:
        """This flow without its payload (what a generator process needs once texts are drawn)."""
        return Flow(self.name, self.share, self.priority, self.tenant, self.slo_ms, self.ttft_slo_ms,
                    self.tpot_slo_ms, None, self.new_tokens)


@dataclass(frozen=True)
class Mix:
    """Flows sent side by side in one run; ``shares`` are theirs, normalised to sum to 1."""

    flows: tuple[Flow, ...]

    def __post_init__(self) -> None:
        flows = tuple(self.flows)
        if not flows or not all(isinstance(f, Flow) for f in flows):
            raise ValueError(f"a Mix needs one or more Flow, got {self.flows!r}")
        names = [f.name for f in flows]
        if len(set(names)) != len(names):
            raise ValueError(f"flow names must differ, got {names}")
        object.__setattr__(self, "flows", flows)

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.flows]

    @property
    def shares(self) -> np.ndarray:
        raw = np.array([f.share for f in self.flows], dtype=float)
        return raw / raw.sum()

    def flow(self, name: str) -> Flow:
        for f in self.flows:
            if f.name == name:
                return f
        raise KeyError(f"no flow {name!r} in this mix (flows: {', '.join(self.names)})")

    def assign(self, n: int, seed: int | Sequence[int] = 0) -> np.ndarray:
        """The flow (an index into ``flows``) of each of ``n`` requests, drawn with ``seed``.

        Its own stream of the seed, so arrival times, payloads and lengths do not move it.

        >>> np.bincount(Mix((Flow("a", 1), Flow("b", 3))).assign(4000, seed=0)).tolist()
        [1045, 2955]
        """
        seq = [seed] if isinstance(seed, (int, np.integer)) else list(seed)
        return self.rng(seq).choice(len(self.flows), size=n, p=self.shares)

    def rng(self, seed: Sequence[int]) -> np.random.Generator:
        """The generator the flows are drawn from (closed loop: per process, as it goes)."""
        return np.random.default_rng([*seed, _MIX_STREAM])

    def bare(self) -> Mix:
        return Mix(tuple(f.bare() for f in self.flows))

    def check(self, generative: bool) -> None:
        """Fail now, saying why, on what a load of this kind cannot send."""
        own = [f.name for f in self.flows if f.new_tokens is not None]
        if own and not generative:
            raise ValueError(f"flow(s) {', '.join(own)} set new_tokens, but this load generates no tokens "
                             "(use mode='generate' or an OpenAI completions/chat api)")

    def place_own(self, flow: np.ndarray, texts: list[Inputs], sizes: np.ndarray | None, seed: int,
                  per_request: int = 1) -> None:
        """Put each flow's own payload and lengths, where it has them, in its requests' places (in place):
        flow k's texts are drawn with ``[seed, 1, k]`` (``per_request`` to a request), its lengths with
        ``[seed, 2, k]``."""
        for k, f in enumerate(self.flows):
            where = np.flatnonzero(flow == k)
            if f.payload is not None and len(where):
                own = take_requests(f.payload, len(where), per_request, seed=[seed, 1, k])
                for j, text in zip(where.tolist(), own):
                    texts[j] = text
            if f.new_tokens is not None and sizes is not None and len(where):
                sizes[where] = take_lengths(f.new_tokens, len(where), seed=[seed, 2, k])

    def __str__(self) -> str:
        """The compact string; ``parse_mix`` reads it back (payloads and replayed lengths aside)."""
        return ",".join(_flow_spec(f) for f in self.flows)


MixLike = Mix | Sequence[Flow] | str


def make_mix(mix: MixLike | None) -> Mix | None:
    """A ``Mix`` from a Mix, a list of ``Flow`` (or of dicts of Flow fields), or a compact string."""
    if mix is None or isinstance(mix, Mix):
        return mix
    if isinstance(mix, str):
        return parse_mix(mix)
    if isinstance(mix, Flow):
        return Mix((mix,))
    if isinstance(mix, Iterable):
        items = list(mix)
        return Mix(tuple(Flow(**f) if isinstance(f, Mapping) else f for f in items))
    raise TypeError(f"mix must be a Mix, a list of Flow or a string; {_SPEC_HELP}; got {mix!r}")


def parse_mix(text: str) -> Mix:
    """A mix from its compact string: flows separated by ``,``, each ``NAME:SHARE`` then
    ``:KEY=VALUE`` pieces, KEY one of ``priority``, ``tenant``, ``slo`` (latency target, ms),
    ``ttft``, ``tpot`` (generation targets, ms) and ``tokens`` (the flow's output lengths as
    ``--new-tokens`` takes them; a value may hold colons, as in ``tokens=uniform:16:64``).

    >>> m = parse_mix("interactive:0.2:priority=0:ttft=500,batch:0.8:priority=1:tokens=uniform:200:400")
    >>> m.names, m.shares.tolist(), m.flow("interactive").ttft_slo_ms, m.flow("batch").new_tokens
    (['interactive', 'batch'], [0.2, 0.8], 500.0, UniformLength(lo=200, hi=400))
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"empty mix: {_SPEC_HELP}")
    flows = tuple(_parse_flow(part.strip(), text) for part in text.split(","))
    try:
        return Mix(flows)
    except ValueError as e:
        raise ValueError(f"bad mix {text!r}: {e}") from None


def _parse_flow(part: str, text: str) -> Flow:
    pieces = part.split(":")
    if len(pieces) < 2 or not pieces[0] or "=" in pieces[0] or "=" in pieces[1]:
        raise ValueError(f"bad mix {text!r}: flow {part!r} must start with NAME:SHARE; {_SPEC_HELP}")
    name, share_text = pieces[0].strip(), pieces[1].strip()
    try:
        share = float(share_text)
    except ValueError:
        raise ValueError(f"bad mix {text!r}: flow {name!r}: share {share_text!r} is not a number") from None
    options: dict[str, str] = {}
    last = None
    for piece in pieces[2:]:
        if "=" not in piece:
            if last is None:
                raise ValueError(f"bad mix {text!r}: {piece!r} in flow {name!r} is not KEY=VALUE; {_SPEC_HELP}")
            options[last] += ":" + piece  # a value with colons: tokens=uniform:16:64
            continue
        key, _, value = piece.partition("=")
        key = key.strip()
        if key not in _KEYS:
            raise ValueError(f"bad mix {text!r}: flow {name!r} has an unknown key {key!r} "
                             f"(known: {', '.join(_KEYS)})")
        if key in options:
            raise ValueError(f"bad mix {text!r}: flow {name!r} gives {key!r} twice")
        options[key], last = value.strip(), key
    fields: dict[str, Any] = {}
    for key, value in options.items():
        try:
            if key == "priority":
                fields["priority"] = int(value)
            elif key == "tenant":
                fields["tenant"] = value
            elif key == "tokens":
                fields["new_tokens"] = parse_lengths(value)
            else:
                fields[_KEYS[key]] = float(value)
        except ValueError as e:
            raise ValueError(f"bad mix {text!r}: flow {name!r}: {key}={value!r}: {e}") from None
    try:
        return Flow(name, share, **fields)
    except ValueError as e:
        raise ValueError(f"bad mix {text!r}: {e}") from None


def _flow_spec(f: Flow) -> str:
    parts = [f.name, f"{f.share:g}"]
    for key, name in _KEYS.items():
        value = getattr(f, name)
        if value is not None and key != "tokens":
            parts.append(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}")
    if f.new_tokens is not None:
        parts.append(f"tokens={_lengths_spec(f.new_tokens)}")
    return ":".join(parts)


def _lengths_spec(lengths: LengthsLike) -> str:
    """Lengths as ``parse_lengths`` reads them back (a replayed list only described)."""
    source = make_lengths(lengths)
    if isinstance(source, ConstantLength):
        return str(source.n)
    if isinstance(source, UniformLength):
        return f"uniform:{source.lo}:{source.hi}"
    if isinstance(source, GeometricLength):
        return f"geometric:{source.mean_tokens:g}:{source.lo}:{source.hi}"
    return repr(source)
