"""The model alone, timed: no server, no client, only the model's own calls.

``capacity`` is what a model sustains at one batch size (with the conditions it depended
on), ``time_batches`` its cost at several, ``padded_cost`` its cost by batch size and padded
length (what a token budget rests on). The notebooks compare a served strategy with these.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ..lab.claims import pct, spread
from ..load.arrivals import WORDS
from ..models.base import device_label

__all__ = ["Capacity", "PaddedCost", "capacity", "padded_cost", "time_batches"]


@dataclass
class Capacity:
    """What a model sustains alone (no server, no client), with the conditions it depended on."""

    items_per_s: float
    ms_per_call: float
    batch: int
    device: str  # "cpu (2 threads)", "cuda (NVIDIA H100 ...)"
    tokens: str  # the texts' length in tokens: "9-17 tokens (median 12)"
    calls: int  # timed calls; the median is kept
    spread: float  # relative spread of those calls, (max - min) / median

    def __str__(self) -> str:
        return (f"{self.items_per_s:.1f} texts/s alone ({self.ms_per_call:.1f} ms per call): batch {self.batch}, "
                f"{self.device}, texts of {self.tokens}, median of {self.calls} calls (spread {pct(self.spread)})")


def capacity(model: Any, texts: Sequence[str], *, batch: int = 1, calls: int = 20, warm: int = 3) -> Capacity:
    """The model's standalone capacity at ``batch`` texts per call, printed with its conditions.

    One definition for every lesson that needs a capacity: the median of ``calls`` timed calls
    over consecutive batches of ``texts`` (after ``warm`` untimed ones). A served capacity is
    lower by what the server, the event loop and the load generator take from the same cores;
    notebooks that serve the model say by how much.
    """
    pool = list(texts)
    for k in range(warm):
        model(pool[k * batch % len(pool):][:batch] or pool[:batch])
    took = []
    for k in range(calls):
        start = k * batch % len(pool)
        chunk = (pool[start:] + pool)[:batch]
        t = time.perf_counter()
        model(chunk)
        took.append((time.perf_counter() - t) * 1000)
    ms = float(np.median(took))
    tokenizer = getattr(model, "tokenizer", None) or getattr(getattr(model, "pipe", None), "tokenizer", None)
    if tokenizer is not None:
        lengths = np.array([len(tokenizer(text)["input_ids"]) for text in pool])
        tokens = f"{lengths.min()}-{lengths.max()} tokens (median {np.median(lengths):.0f})"
    else:
        words = np.array([len(text.split()) for text in pool])
        tokens = f"{words.min()}-{words.max()} words (median {np.median(words):.0f})"
    dev = getattr(model, "device", None) or getattr(getattr(model, "pipe", None), "device", None)  # (fill-mask)
    return Capacity(items_per_s=batch * 1000 / ms, ms_per_call=ms, batch=batch,
                    device=device_label(str(dev)) if dev is not None else device_label("cpu"), tokens=tokens,
                    calls=calls, spread=spread(took))


def time_batches(model: Any, sizes: Sequence[int], texts: Sequence[str], *, repeats: int = 3,
                 warm: int = 2) -> pd.DataFrame:
    """Time ``model`` on its own (no server) at each batch size: the cost batching works with.

    Each size is called ``repeats`` times on the first ``size`` texts (cycled when
    too few); columns ``size``, ``ms`` (median per call), ``ms_per_item`` and
    ``items_per_s``. ``warm`` untimed calls first: a fresh model's first calls are slow.
    """
    pool = list(texts) or list(WORDS[:8])
    for _ in range(warm):
        model(pool[:1])
    rows = []
    for size in sizes:
        batch = [pool[k % len(pool)] for k in range(size)]
        took = []
        for _ in range(repeats):
            t = time.perf_counter()
            model(batch)
            took.append((time.perf_counter() - t) * 1000)
        ms = float(np.median(took))
        rows.append({"size": size, "ms": ms, "ms_per_item": ms / size, "items_per_s": size * 1000 / ms})
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class PaddedCost:
    """A model's measured cost of a padded batch: ``n`` texts padded to ``longest`` tokens.

    ``table`` holds the timings (columns ``size``, ``tokens``, ``ms``: the median of the calls);
    ``a + b * n * longest + c * n * longest**2`` is fitted to them by least squares on relative errors
    (the last term: attention, quadratic in the length), the cost the virtual clock charges a batch.
    """

    a: float
    b: float
    c: float
    table: pd.DataFrame

    def __call__(self, n: int, longest: int) -> float:
        return self.a + self.b * n * longest + self.c * n * longest**2

    def worst_error(self) -> float:
        """The largest relative gap between the fit and a timing."""
        fit = np.array([self(n, t) for n, t in zip(self.table["size"], self.table["tokens"])])
        return float(np.max(np.abs(fit - self.table["ms"]) / self.table["ms"]))

    def __str__(self) -> str:
        return (f"cost(n, longest) = {self.a:.2f} + {self.b * 1000:.3f} n*longest us + {self.c * 1e6:.3f} "
                f"n*longest^2 ns (ms; fitted to {len(self.table)} timings, worst gap {pct(self.worst_error())})")


def padded_cost(model: Any, sizes: Sequence[int] = (1, 8, 32), lengths: Sequence[int] = (8, 32, 128, 256), *,
                repeats: int = 3) -> PaddedCost:
    """Time ``model`` on batches of ``n`` texts of exactly ``tokens`` tokens each (built-in words, one token each,
    plus the model's two special tokens), at every pair, and fit ``PaddedCost`` to the timings."""
    rows = []
    model([WORDS[0]])  # warm
    for tokens in lengths:
        text = " ".join(WORDS[k % len(WORDS)] for k in range(max(1, tokens - 2)))
        for n in sizes:
            took = []
            for _ in range(repeats):
                t = time.perf_counter()
                model([text] * n)
                took.append((time.perf_counter() - t) * 1000)
            rows.append({"size": n, "tokens": tokens, "ms": float(np.median(took))})
    table = pd.DataFrame(rows)
    x = np.column_stack([np.ones(len(table)), table["size"] * table["tokens"], table["size"] * table["tokens"] ** 2])
    ms = table["ms"].to_numpy()
    # relative errors (each row over its own time): a plain fit would serve the big batches and miss the small
    a, b, c = np.linalg.lstsq(x / ms[:, None], np.ones(len(ms)), rcond=None)[0]
    return PaddedCost(max(0.0, float(a)), max(0.0, float(b)), max(0.0, float(c)), table)
