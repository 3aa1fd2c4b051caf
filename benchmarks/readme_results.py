"""The README's figures, written from ``results/``: each with its goal and verdict, the FAIL rows beside them.

    python benchmarks/readme_results.py          # rewrite the block between <!-- results --> and <!-- /results -->
    python benchmarks/readme_results.py --check  # exit 1 when the committed block differs from what it would write

``make readme-results`` runs the first. Every benchmark writes its table as
``results/<name>/cpu.txt``: a row a line, the label, then the value, goal, verdict and detail
separated by two or more spaces (or the verdict last, after the detail and a semicolon);
this reads those rows. ``QUOTED`` names the rows the README quotes; the block shows
each with its value, goal and verdict (PASS, FAIL or INFO), then every FAIL row of the
benchmarks it quotes that it does not quote, then how many FAIL rows ``results/`` holds in
all. ``tests/test_docs.py`` fails when the committed block is not what this writes, and when
the README's prose quotes a figure the block does not hold.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BEGIN, END = "<!-- results -->", "<!-- /results -->"

# (benchmark, the start of a row's target): the rows the README quotes, in the order it shows them
QUOTED: list[tuple[str, str]] = [
    ("peers", "1 stream: labserver smollm2 / vLLM"),
    ("peers", "16 streams: labserver smollm2 / vLLM"),
    ("peers", "32 streams: labserver smollm2 / vLLM"),
    ("peers", "exact: labserver smollm2 greedy texts equal vLLM's"),
    ("onestream", "1 stream: labserver smollm2 / llama-server"),
    ("onestream", "1 stream: labserver smollm2:float16+compile / llama-server"),
    ("onestream", "32 streams: labserver smollm2 / llama-server"),
    ("kvperf", "1 paged/reserved tokens/s"),
    ("kvperf", "2 prefix cache: p50 TTFT"),
    ("kvperf", "3 chunked/eager p99 ITL"),
    ("specperf", "ngram, input-grounded, 1 stream"),
    ("specperf", "ngram, input-grounded, 16 streams: always on"),
    ("structured", "valid: constrained answers that parse and validate"),
    ("structured", "16 streams: output tokens/s, JSON schema / free answers of the same lengths"),
    ("routeperf", "5 live cache affinity: prefix-aware / pow2 p50 TTFT"),
    ("disagg", "live, p99 ITL (300 requests)"),
    ("disagg", "live, p50 TTFT"),
    ("crosscheck", "1 labserver's mean ITL / the server's own"),
]


_VALUE = r"(?P<value>-?[\d,]*\.?\d+(?:e[-+]?\d+)?|nan|None|-)"
_VERDICT = r"(?P<result>PASS|FAIL|INFO|SKIP)"
_ROW = re.compile(rf"^(?P<target>\S.*?)\s{{2,}}{_VALUE}\s{{2,}}(?P<goal>.*?)\s*{_VERDICT}\s+(?P<detail>.*)$")
_LAST = re.compile(rf"^(?P<target>\S.*?)\s{{2,}}{_VALUE}\s{{2,}}(?P<goal>\S.*?)\s{{2,}}(?P<detail>.*);\s*{_VERDICT}$")


def rows_of(path: Path) -> list[dict[str, Any]]:
    """A results table's rows: target, value, goal, result, detail (no rows: a file of another shape)."""
    lines = path.read_text().splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith("target ")), None)
    if header is None:
        return []
    last = lines[header].rstrip().endswith("detail; result")
    rows = []
    for line in lines[header + 1:]:
        m = (_LAST if last else _ROW).match(line.rstrip())
        if m is None:
            continue
        row = m.groupdict()
        try:
            row["value"] = float(row["value"].replace(",", ""))
        except ValueError:
            row["value"] = float("nan")
        rows.append({k: v.strip() if isinstance(v, str) else v for k, v in row.items()})
    return rows


def all_rows() -> dict[str, list[dict[str, Any]]]:
    """Every benchmark's rows (``results/<name>/cpu.txt``; where a benchmark keeps only ``cpu.json``, its
    ``rows``), by benchmark."""
    out = {}
    for folder in sorted(p for p in (ROOT / "results").iterdir() if p.is_dir()):
        txt, js = folder / "cpu.txt", folder / "cpu.json"
        rows = rows_of(txt) if txt.exists() else json.loads(js.read_text()).get("rows", []) if js.exists() else []
        if rows:
            out[folder.name] = rows
    return out


def _value(row: dict[str, Any]) -> str:
    v = row["value"]
    if not isinstance(v, (int, float)) or v != v:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}" if abs(v) < 10 else f"{v:.4g}"


def _line(name: str, row: dict[str, Any]) -> str:
    detail = row["detail"].replace("|", "/")
    detail = detail if len(detail) <= 60 else detail[:57].rsplit(" ", 1)[0] + " ..."
    return f"| {row['target']} | **{_value(row)}** | {row['goal']} | {row.get('result', 'INFO')} | {name}: {detail} |"


def block() -> str:
    """The block, markers included."""
    rows = all_rows()
    quoted, missing = [], []
    for name, start in QUOTED:
        found = [r for r in rows.get(name, []) if r["target"].startswith(start)]
        if not found:
            missing.append(f"{name}: {start}")
        quoted += [(name, r) for r in found[:1]]
    lines = [BEGIN, "", "| figure | value | goal | verdict | benchmark: what it compares |", "|---|---|---|---|---|"]
    lines += [_line(name, r) for name, r in quoted]
    shown = {(name, r["target"]) for name, r in quoted}
    benches = dict.fromkeys(name for name, _ in quoted)
    fails = [(name, r) for name in benches for r in rows.get(name, [])
             if r.get("result") == "FAIL" and (name, r["target"]) not in shown]
    if fails:
        lines += ["", "FAIL rows of the same benchmarks, not quoted above:", "",
                  "| figure | value | goal | verdict | benchmark: what it compares |", "|---|---|---|---|---|"]
        lines += [_line(name, r) for name, r in fails]
    graded = [r for rs in rows.values() for r in rs if r.get("result") in ("PASS", "FAIL")]
    failed = [(name, r) for name, rs in rows.items() for r in rs if r.get("result") == "FAIL"]
    by = {name: sum(1 for n, _ in failed if n == name) for name in rows}
    lines += ["", f"`results/` holds {len(failed)} FAIL rows of {len(graded)} graded (PASS or FAIL) in "
              f"{len(rows)} benchmarks: " + ", ".join(f"{n} {k}" for n, k in by.items() if k) + "."
              if failed else f"`results/` holds no FAIL row among its {len(graded)} graded rows."]
    if missing:
        lines += ["", "Not in `results/` yet: " + "; ".join(missing) + "."]
    lines += ["", END]
    return "\n".join(lines)


def rewrite(text: str, new: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{README} has no {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN, 1)
    return head + new + rest.split(END, 1)[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare the committed block with what would be written")
    args = ap.parse_args()
    text = README.read_text()
    new = rewrite(text, block())
    if args.check:
        if new != text:
            print("README.md's results block is not what results/ says: run make readme-results", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
