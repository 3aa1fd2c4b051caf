"""Is a folder served right? labserver's forward pass against transformers' on the same weights.

    python benchmarks/foldercheck.py                          # a tiny random folder of each family (~15 s)
    python benchmarks/foldercheck.py ~/models/Qwen2.5-0.5B    # your own folder(s), real weights
    python benchmarks/foldercheck.py smollm2 --questions 16 --tokens 64   # the embedded model, 16 chat prompts

For each folder: the largest difference between labserver's next-token scores and
transformers' (``model(ids).logits``, then a token a step on its own KV cache) over the prompt's
prefill and ``--tokens`` decode steps, one sequence in the paged pool; and whether the greedy tokens labserver chooses
(``generate_alone``: a prefill, then decode steps) equal transformers' ``generate`` on the
same prompt, EOS ignored by both. A row passes when the largest difference is at most
``--atol`` (float32 on a CPU: 1e-4; a deep real model in float16 on a GPU needs more) and the
tokens are equal, or first differ at a near-tie: where they part, transformers' two top
scores are within ``--tie`` (1e-3), so either choice is the argmax to within rounding (in the
spirit of vLLM's ``check_logprobs_close``). ``--questions N`` checks the first N built-in
chat questions (``labserver.load.prompts.QUESTIONS``), each rendered by the model's own chat
template, instead of ``--prompt``. The tests check the same on tiny folders and, teacher-forced,
on ``smollm2``; this is for a folder of yours and for full lengths.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from labserver.models import Chunk, load_model
from labserver.models.base import generate_alone
from labserver.load.prompts import QUESTIONS
from labserver.models.folders import FAMILIES, write_tiny


def check(folder: str, prompt: str, n: int, device: str, model: Any = None) -> dict[str, Any]:
    model = model or load_model(folder, device=device, kind="generate")
    ids = model.encode(prompt)
    hf = model.hf_model
    block = 16
    table = tuple(range(-(-(len(ids) + n) // block)))
    model.allocate_kv(len(table), block)
    worst = {"prefill": 0.0, "decode": 0.0}
    seq = list(ids)
    scores = model.logits([Chunk(1, ids, 0, table)])[0]
    with torch.inference_mode():  # transformers' own scores, its own KV cache carried from step to step
        out = hf(torch.tensor([seq], device=hf.device), use_cache=True)
    for step in range(n):
        want = out.logits[0, -1]
        kind = "prefill" if step == 0 else "decode"
        worst[kind] = max(worst[kind], float((scores.float() - want.float()).abs().max()))
        seq.append(int(scores.argmax()))
        scores = model.logits([Chunk(1, [seq[-1]], len(seq) - 1, table)])[0]
        with torch.inference_mode():
            out = hf(torch.tensor([seq[-1:]], device=hf.device), cache=out.cache, use_cache=True)
    model.release([1])
    ours = generate_alone(model, ids, n)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids], device=hf.device), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    theirs = out[0, len(ids):].tolist()
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), n)
    gap = None  # where they part: transformers' top score less its score of our token there
    if same < n:
        with torch.inference_mode():
            at = hf(torch.tensor([ids + theirs[:same]], device=hf.device)).logits[0, -1].float()
        gap = float(at[theirs[same]] - at[ours[same]])
    return {"folder": folder, "family": model.family, "prompt_tokens": len(ids), "kv_bytes_per_token":
            model.kv_bytes_per_token, "max_diff_prefill": worst["prefill"], "max_diff_decode": worst["decode"],
            "greedy_tokens_equal": same, "tokens": n, "tie_gap": gap, "text": model.text(ours)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="*", help="model folders (default: a tiny random one of each family)")
    p.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog, and then")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens to compare (default: %(default)s)")
    p.add_argument("--atol", type=float, default=1e-4, help="largest score difference that passes")
    p.add_argument("--tie", type=float, default=1e-3,
                   help="greedy tokens may part only where transformers' two top scores are this close")
    p.add_argument("--questions", type=int, default=0,
                   help="check the first N built-in chat questions through the model's chat template")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="labserver-foldercheck-") as root:
        folders = args.folders or [str(write_tiny(family, Path(root) / family)) for family in FAMILIES]
        rows = []
        for f in folders:
            if not args.questions:
                rows.append(check(f, args.prompt, args.tokens, args.device))
                continue
            model = load_model(f, device=args.device, kind="generate")
            for q in QUESTIONS[:args.questions]:
                chat = model.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                           add_generation_prompt=True)
                rows.append({**check(f, chat, args.tokens, args.device, model), "question": q})
    print(f"{'family':7} {'prefill diff':>12} {'decode diff':>12} {'greedy equal':>12} {'tie gap':>8}  result  "
          "folder")
    ok = True
    for r in rows:
        close = max(r["max_diff_prefill"], r["max_diff_decode"]) <= args.atol
        tie = r["tie_gap"] is not None and r["tie_gap"] <= args.tie
        passed = close and (r["greedy_tokens_equal"] == r["tokens"] or tie)
        ok &= passed
        r["result"] = "PASS" if passed else "FAIL"
        gap = "" if r["tie_gap"] is None else f"{r['tie_gap']:.1e}"
        print(f"{r['family']:7} {r['max_diff_prefill']:12.1e} {r['max_diff_decode']:12.1e} "
              f"{r['greedy_tokens_equal']:>5} of {r['tokens']:<4} {gap:>8}  {r['result']:6}  {r['folder']}"
              + (f"  {r['question']!r}" if "question" in r else ""))
    if args.out:
        Path(args.out).write_text(json.dumps({"atol": args.atol, "rows": rows}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
