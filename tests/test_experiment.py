"""The main job end to end, small: `labserver compare` on a synthetic model, then `plot`."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from labserver import cli, experiment

FILES = ["records.csv", "summary.csv", "summary.json", "lag.csv", "machine.json", "overview.png",
         "latency_cdf.png", "latency_vs_throughput.png", "batch_sizes.png", "batch_gantt.png", "loop_lag.png"]


def test_compare_writes_results_and_plot_redraws_them(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "run"
    rc = cli.main(["compare", "--quick", "--model", "synthetic:2+0.2", "--strategies", "naive,thread",
                   "--rates", "40", "--duration", "1.5", "--out", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "naive" in table and "thread" in table and "p99_ms" in table
    for name in FILES:
        assert (out / name).stat().st_size > 0, name
    doc = json.loads((out / "summary.json").read_text())
    assert [r["label"] for r in doc["summary"]] == ["naive", "thread"]
    assert all(r["n_ok"] > 0 for r in doc["summary"])
    assert doc["machine"]["cpu_count"] and doc["machine"]["torch"]
    assert doc["config"]["model"] == "synthetic:2+0.2"
    records, lag, _ = experiment.read(out)
    assert set(records["label"]) == {"naive", "thread"}
    assert len(lag) > 0 and set(lag["label"]) == {"naive", "thread"}
    for png in out.glob("*.png"):
        png.unlink()
    assert cli.main(["plot", str(out)]) == 0
    assert (out / "overview.png").stat().st_size > 0


def test_saved_records_read_back_numeric_even_with_failures(tmp_path: Path) -> None:
    """A request that got no answer has empty numbers in the CSV; they must come back as NaN."""
    rows = pd.DataFrame({
        "label": ["a", "a"], "rate": [10.0, 10.0], "i": [0, 1], "process": [0, 0],
        "scheduled_s": [0.0, 0.1], "sent_s": [0.0, 0.1], "done_s": [0.02, float("nan")],
        "status": [200, 0], "error": ["", "client_overflow"], "latency_ms": [20.0, float("nan")],
        "send_latency_ms": [20.0, float("nan")], "late_ms": [0.0, 0.0], "warmup": [False, False],
        "input_chars": [5, 5], "queue_ms": [1.0, float("nan")], "compute_ms": [18.0, float("nan")],
        "batch_size": [1, None], "batch_id": [1, None], "dispatch": ["idle", ""], "server_ms": [19.0, float("nan")],
        "request_id": ["x-1", ""],
    })
    rows.to_csv(tmp_path / "records.csv", index=False)
    records, _, _ = experiment.read(tmp_path)
    assert records["latency_ms"].dtype.kind == "f" and records["latency_ms"].isna().sum() == 1
    assert records["error"].tolist() == ["", "client_overflow"]
    experiment.draw(tmp_path)  # draws without tripping over the missing numbers
    assert (tmp_path / "overview.png").exists()


def test_bench_cli_runs_one_load_and_saves_it(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "bench.csv"
    rc = cli.main(["bench", "--strategy", "deadline", "--model", "synthetic:2+0", "--rate", "50", "--duration", "1.5",
                   "--warmup", "0.5", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "p99_ms" in printed and "throughput_rps" in printed
    from labserver.loadgen import LoadResult

    result = LoadResult.from_csv(out)
    assert len(result.records) > 40 and (result.records["status"] == 200).all()
    assert result.records["dispatch"].isin(["idle", "deadline", "full"]).all()  # the server's headers came back
