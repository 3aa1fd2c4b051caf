"""What a verification costs: a decode step of k + 1 tokens a sequence against a step of one, by batch, on any device.

    python benchmarks/specverify.py --out results/specperf/verify-cpu.json                # smollm2, ~2 min
    python benchmarks/specverify.py --device cuda --models gpt2-random --shape-of FOLDER \\
        --out results/gpu/specverify.json                                                 # a GPU, ~1 min
    python benchmarks/specverify.py --smoke --out /tmp/specverify.json

Speculative decoding pays when a verification's extra rows are cheap: at one stream a step
reads every weight for one token, and k more rows ride along; as the batch grows the rows
cost what they compute. For each model, each batch (``--seqs``) and each k (``--ks``): the
model's ``forward`` on b decode chunks of k + 1 tokens (``Chunk.draft``) at ``--context``
tokens, against the same b chunks of one token (medians of ``--repeats``), and the ratio:
the ``verify_cost`` Leviathan et al.'s speedup divides by
(``labserver.analysis.theory.speculative_speedup``). No goal: a table of what it costs here.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from genperf import Checks, exit_status, row, write_results

from labserver.experiments.runs import machine_info
from labserver.experiments.speculative import verify_cost
from labserver.models import load_model
from labserver.models.folders import random_of_shape


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--models", default="smollm2")
    p.add_argument("--shape-of", help="a model folder whose config (with random weights) is measured too")
    p.add_argument("--seqs", default="1,4,16")
    p.add_argument("--ks", default="1,2,4,8")
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--smoke", action="store_true", help="gpt2-tiny-random, small; checks only")
    p.add_argument("--out", default="results/specperf/verify-cpu.json")
    args = p.parse_args()
    if args.smoke:
        args.models, args.seqs, args.ks, args.repeats = "gpt2-tiny-random", "1,2", "1,4", 3
    started = time.perf_counter()
    numbers: dict[str, Any] = {"machine": machine_info(args.device), "args": vars(args), "models": []}
    with tempfile.TemporaryDirectory() as tmp:
        specs = [(s, s) for s in args.models.split(",") if s]
        if args.shape_of:
            specs.append((str(random_of_shape(args.shape_of, Path(tmp) / "shape")),
                          f"{Path(args.shape_of).name} shape, random weights"))
        for spec, label in specs:
            gen = load_model(spec, device=args.device, kind="generate")
            costs = [verify_cost(gen, k, b, args.context, args.repeats)
                     for b in map(int, args.seqs.split(",")) for k in map(int, args.ks.split(","))]
            numbers["models"].append({"model": label, "dtype": str(gen.kv.dtype), "costs": costs})
            print(f"{label}: done", file=sys.stderr)
    rows = [row(f"{m['model']}: {c['seqs']} seq, k = {c['k']}: step of k + 1 tokens / of 1", c["ratio"], "(info)",
                None, f"{c['verify_ms']:.2f} vs {c['one_ms']:.2f} ms") for m in numbers["models"] for c in m["costs"]]
    device = numbers["machine"].get("cuda") or f"{numbers['machine']['cpu_count']} CPU cores"
    footer = (f"({(time.perf_counter() - started) / 60:.1f} min on {device}; each step: the model's forward on decode "
              f"chunks at a context of {args.context}, median of {args.repeats}; dtype "
              f"{', '.join(sorted({m['dtype'] for m in numbers['models']}))})")
    numbers["rows"] = rows
    write_results(args.out, numbers, rows, footer, width=72)
    return exit_status(args, numbers, rows, smoke_checks)


def smoke_checks(numbers: dict[str, Any], args: argparse.Namespace) -> Checks:
    check = Checks()
    for m in numbers["models"]:
        for c in m["costs"]:
            check(c["one_ms"] > 0 and c["verify_ms"] > 0, f"{m['model']}: a step took no time")
    return check


if __name__ == "__main__":
    sys.exit(main())
