"""Stop strings in time linear in the answer: what one token's text costs, by answer length and stop strings.

    python benchmarks/stopperf.py --out results/stopperf/cpu.json      # ~1 minute

Every sequence's tokens become text in ``labserver.engine.output.Detokenizer`` as they come
(``Seq.emit`` pushes each one, on the event loop), and stop strings are searched for there.
This times that work per token on the real model's tokenizer (``smollm2``), for answers of a
real text's tokens, with stop strings that never occur (the worst case: every stop is
searched for at every token, to the end):

- 8,000 tokens against 1,000, with 16 stop strings: goal within 1.5x per token (linear:
  a token costs the same at any length);
- 2,000 tokens with 16 stop strings against none: goal within 2x;
- the rule it replaced (the whole answer decoded again for each stop string at every token,
  ``any(s in text(tokens) for s in stop)``) at 1,000 tokens, for scale (INFO).

Each figure is the fastest of ``--rounds`` runs (the least disturbed by other work).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from labserver.engine.output import Detokenizer  # noqa: E402
from labserver.load.prompts import QUESTIONS  # noqa: E402

STOPS = tuple(f"<never-{i}>" for i in range(16))


def _tokenizer(smoke: bool) -> Any:
    from transformers import AutoTokenizer

    if smoke:  # a tiny folder's (no conversion needed)
        import tempfile

        from labserver.models.folders import write_tiny

        return AutoTokenizer.from_pretrained(write_tiny("llama", Path(tempfile.mkdtemp()) / "tiny"))
    from labserver.models.smollm2 import folder

    return AutoTokenizer.from_pretrained(folder())


def _answer(tok: Any, n: int) -> list[int]:
    """``n`` tokens of real text: the built-in questions, over and over."""
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(" ".join(QUESTIONS), add_special_tokens=False)
    return ids[:n]


def per_token_us(decode: Any, ids: list[int], stops: tuple[str, ...], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        out = Detokenizer(decode, stops)
        t0 = time.perf_counter()
        for token in ids:
            out.push(token)
        out.finish()
        best = min(best, time.perf_counter() - t0)
        assert out.text == decode(ids) and not out.stopped
    return best / len(ids) * 1e6


def before_us(decode: Any, ids: list[int], stops: tuple[str, ...]) -> float:
    """The rule it replaced: every stop string looked for in the whole answer, decoded again, at every token."""
    t0 = time.perf_counter()
    for k in range(1, len(ids) + 1):
        any(s in decode(ids[:k]) for s in stops)
    return (time.perf_counter() - t0) / len(ids) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", help="write the figures as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny: a tiny folder's tokenizer, short answers")
    args = p.parse_args()
    tok = _tokenizer(args.smoke)

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)  # type: ignore[no-any-return]

    long, short, mid, old = (800, 100, 200, 50) if args.smoke else (8000, 1000, 2000, 1000)
    fig = {
        "long_16": per_token_us(decode, _answer(tok, long), STOPS, args.rounds),
        "short_16": per_token_us(decode, _answer(tok, short), STOPS, args.rounds),
        "mid_16": per_token_us(decode, _answer(tok, mid), STOPS, args.rounds),
        "mid_0": per_token_us(decode, _answer(tok, mid), (), args.rounds),
        "old_16": before_us(decode, _answer(tok, old), STOPS),
        "old_short_16": per_token_us(decode, _answer(tok, old), STOPS, args.rounds),
    }
    rows = [
        (f"per token, {long:,} / {short:,} tokens, 16 stop strings", "<= 1.5", fig["long_16"] / fig["short_16"],
         f"{fig['long_16']:.2f} vs {fig['short_16']:.2f} us", fig["long_16"] / fig["short_16"] <= 1.5),
        (f"per token, {mid:,} tokens, 16 stop strings / none", "<= 2", fig["mid_16"] / fig["mid_0"],
         f"{fig['mid_16']:.2f} vs {fig['mid_0']:.2f} us", fig["mid_16"] / fig["mid_0"] <= 2),
        (f"per token, {old:,} tokens, 16 stops: the rule it replaced / this", "(info)",
         fig["old_16"] / fig["old_short_16"], f"{fig['old_16']:.2f} vs {fig['old_short_16']:.2f} us", None),
    ]
    print(f"tokenizer: {'a tiny llama folder' if args.smoke else 'smollm2'}; fastest of {args.rounds} rounds\n")
    print("| target | goal | measured | |\n|---|---|---|---|")
    for name, goal, ratio, detail, ok in rows:
        verdict = "INFO" if ok is None else "PASS" if ok else "FAIL"
        print(f"| {name} | {goal} | **{ratio:.2f}** ({detail}) | {verdict} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"figures_us": fig, "rounds": args.rounds, "smoke": args.smoke},
                                             indent=1))
    return 0 if all(0 < v < float("inf") for v in fig.values()) else 1  # (measured, not: met)


if __name__ == "__main__":
    sys.exit(main())
