"""lm-evaluation-harness against labserver: its ``local-completions`` with default settings beside its transformers
backend on the same folder, on two small tasks written here (nothing is downloaded).

    python benchmarks/lmevalcheck.py --url http://127.0.0.1:8000 --folder ~/.cache/labserver/SmolLM2-135M-Instruct-f32

``peers.py`` runs it against the labserver it starts. lm-eval is a peer tool: it lives in
its own venv (``benchmarks/.peers/lmeval``, made on first use, torch pinned beside it).
Its ``local-completions`` sends prompts as token ids by default (``tokenized_requests``),
asks for log-probabilities with ``echo`` and ``max_tokens: 1`` to score a continuation,
and plain greedy completions with ``stop`` strings to generate. The two tasks:

- ``labserver_mc``: 80 multiple-choice items (sums, the day or month after another, capitals),
  four choices each, scored by log-likelihood (``acc``);
- ``labserver_gen``: 20 of labserver's built-in questions in the model's chat template,
  answered greedily up to a newline or 32 tokens (``exact_match`` against a fixed word:
  the score is not the point, the answers are).

``compare`` reads both runs' per-sample logs: equal scores, the log-likelihoods' largest
difference, the generations that are equal.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from labserver.experiments.peers import peer_venv
from labserver.load.prompts import QUESTIONS

PEERS = Path(__file__).resolve().parents[1] / "benchmarks" / ".peers"
TASKS = ("labserver_mc", "labserver_gen")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
CAPITALS = {"France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
            "Egypt": "Cairo", "Canada": "Ottawa", "Russia": "Moscow", "Greece": "Athens", "Portugal": "Lisbon",
            "Norway": "Oslo", "Ireland": "Dublin", "Poland": "Warsaw", "Austria": "Vienna", "Kenya": "Nairobi",
            "Peru": "Lima", "Chile": "Santiago", "Cuba": "Havana", "Sweden": "Stockholm", "Finland": "Helsinki"}


def mc_items(seed: int = 0) -> list[dict[str, Any]]:
    """80 items: 40 sums, 10 days, 10 months, 20 capitals; the answer's place among the four drawn per item."""
    rng = random.Random(seed)
    items = []

    def add(question: str, answer: str, others: list[str]) -> None:
        choices = [answer, *rng.sample([o for o in others if o != answer], 3)]
        rng.shuffle(choices)
        items.append({"question": question, "choices": choices, "label": choices.index(answer)})

    for _ in range(40):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        add(f"{a} + {b} =", str(a + b), [str(a + b + d) for d in (-10, -2, -1, 1, 2, 10)])
    for i in range(10):
        add(f"The day after {DAYS[i % 7]} is", DAYS[(i + 1) % 7], list(DAYS))
    for i in range(10):
        add(f"The month after {MONTHS[i]} is", MONTHS[i + 1], list(MONTHS))
    for country, city in CAPITALS.items():
        add(f"The capital of {country} is", city, list(CAPITALS.values()))
    return items


def write_tasks(folder: Path, chat_template: Any) -> Path:
    """Both tasks' YAML and data in ``folder`` (lm-eval's ``--include_path``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in mc_items()))
    gen = [{"prompt": chat_template(q), "target": "Paris"} for q in QUESTIONS[:20]]
    (folder / "gen.jsonl").write_text("".join(json.dumps(x) + "\n" for x in gen))
    (folder / "labserver_mc.yaml").write_text(f"""task: labserver_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
""")
    (folder / "labserver_gen.yaml").write_text(f"""task: labserver_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: target
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 32
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return folder


def lm_eval(install: bool = True) -> Path:
    return peer_venv(PEERS, "lmeval", ["lm-eval[api,hf]==0.4.13"], "lm_eval", install=install)


def run(exe: Path, backend: str, model_args: str, tasks: Path, out: Path, log: Path, extra: list[str]) -> Path:
    """One lm-eval run of both tasks; its output folder (``--log_samples``)."""
    cmd = [str(exe), "--model", backend, "--model_args", model_args, "--tasks", ",".join(TASKS),
           "--include_path", str(tasks), "--output_path", str(out), "--log_samples", *extra]
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                                   "TOKENIZERS_PARALLELISM": "false"})
    if done.returncode:
        raise RuntimeError(f"lm-eval ({backend}) failed: see {log}")
    return out


def samples(out: Path, task: str) -> list[dict[str, Any]]:
    files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    if not files:
        raise RuntimeError(f"no samples of {task} under {out}")
    rows = [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["doc_id"])


def compare(served: Path, local: Path) -> dict[str, Any]:
    """Scores, log-likelihoods and generations of the served run (labserver) against the local one (HF)."""
    a_mc, b_mc = samples(served, "labserver_mc"), samples(local, "labserver_mc")
    gaps = [abs(float(x[0][0]) - float(y[0][0])) for ra, rb in zip(a_mc, b_mc, strict=True)
            for x, y in zip(ra["resps"], rb["resps"], strict=True)]
    a_gen, b_gen = samples(served, "labserver_gen"), samples(local, "labserver_gen")
    same = sum(ra["resps"][0][0] == rb["resps"][0][0] for ra, rb in zip(a_gen, b_gen, strict=True))
    acc = [sum(r["acc"] for r in rows) / len(rows) for rows in (a_mc, b_mc)]
    em = [sum(r["exact_match"] for r in rows) / len(rows) for rows in (a_gen, b_gen)]
    return {"mc_items": len(a_mc), "acc": acc, "loglikelihood_max_gap": max(gaps), "gen_items": len(a_gen),
            "generations_equal": same, "exact_match": em}


def check(url: str, model: str, folder: Path, work: Path) -> dict[str, Any]:
    """Both runs and their comparison (``work``: tasks, outputs and logs)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    tasks = write_tasks(work / "tasks", lambda q: tok.apply_chat_template(
        [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True))
    exe = lm_eval()
    served = run(exe, "local-completions", f"model={model},base_url={url}/v1/completions,tokenizer={folder}",
                 tasks, work / "served", work / "served.log", [])
    local = run(exe, "hf", f"pretrained={folder},dtype=float32", tasks, work / "hf", work / "hf.log",
                ["--device", "cpu", "--batch_size", "8"])
    return {**compare(served, local), "command": f"{exe} --model local-completions --model_args model={model},"
            f"base_url={url}/v1/completions,tokenizer={folder} --tasks {','.join(TASKS)} --include_path {tasks}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--folder", required=True)
    ap.add_argument("--work", default="results/_scratch/lmeval")
    args = ap.parse_args()
    print(json.dumps(check(args.url, args.model, Path(args.folder).expanduser(), Path(args.work)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
