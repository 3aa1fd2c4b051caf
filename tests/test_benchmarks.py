"""benchmarks/perf.py runs end to end (tiny and on a synthetic model: a smoke test, not a measurement)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_perf_script_prints_every_target(tmp_path: Path) -> None:
    out = tmp_path / "perf.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "perf.py"), "--model", "synthetic:20+1", "--duration", "1",
         "--rounds", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )
    assert run.returncode in (0, 1), run.stderr[-3000:]  # 1: some target failed, which a smoke run may
    numbers = json.loads(out.read_text())
    targets = [r["target"] for r in numbers["rows"]]
    for prefix in ("1 efficiency", "6 GPU", "2 idle", "3 load: best/guide p50", "3 load: best/guide p99",
                   "5 generator: late", "5 generator: labserver / wrk"):
        assert any(t.startswith(prefix) for t in targets), (prefix, targets)
    for r in numbers["rows"]:
        assert r["result"] in ("PASS", "FAIL", "SKIP")
        assert r["result"] in run.stdout  # the table is printed, not only written
    best = numbers["rounds"][0]["best@64"]
    assert best["throughput_rps"] > 0 and 0 < best["busy"] <= 1.01 and best["mean_batch"] > 1
    assert len(numbers["idle_pairs"]) == 3 and {"best", "naive", "guide"} <= set(numbers["idle_pairs"][0])
