"""The main job end to end, small: `labserver compare` on a synthetic model, then `plot`."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from labserver import cli
from labserver.experiments import compare as experiment

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
    runs, _ = experiment.read(out)
    records, lag = runs.records, runs.lag
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
    records = experiment.read(tmp_path)[0].records
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


def test_bench_out_format_follows_the_name(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    args = ["bench", "--strategy", "thread", "--model", "synthetic:1+0", "--rate", "40", "--duration", "1",
            "--warmup", "0.2", "--slo-ms", "50"]
    assert cli.main([*args, "--out", str(tmp_path / "run.json")]) == 0
    doc = json.loads((tmp_path / "run.json").read_text())
    assert set(doc) == {"summary", "meta", "warnings"}  # JSON: the summary itself, not records
    for key in ("p50_ms", "p90_ms", "p99_ms", "mean_ms", "throughput_rps", "goodput_rps"):
        assert isinstance(doc["summary"][key], float), key
    assert doc["meta"]["target_rate"] == 40

    assert cli.main([*args, "--out", str(tmp_path / "run.csv")]) == 0
    records = pd.read_csv(tmp_path / "run.csv")  # CSV: the records, with the summary beside them
    assert len(records) > 20 and "latency_ms" in records
    side = json.loads((tmp_path / "run.csv.json").read_text())
    assert side["summary"]["p99_ms"] == side["summary"]["p99_ms"] and side["meta"]["target_rate"] == 40

    assert cli.main([*args, "--out", str(tmp_path / "folder")]) == 0
    assert (tmp_path / "folder" / "records.csv").exists() and (tmp_path / "folder" / "records.csv.json").exists()


def test_generation_bench_and_sweep(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "gen.json"
    rc = cli.main(["bench", "--strategy", "gen-continuous", "--model", "synthetic-gen:2+1", "--rate", "10",
                   "--duration", "1.5", "--warmup", "0.2", "--new-tokens", "uniform:4:12", "--ttft-slo-ms", "500",
                   "--tpot-slo-ms", "50", "--out", str(out)])
    assert rc == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["ttft_p99_ms"] > 0 and summary["token_throughput_tps"] > 0
    assert summary["gen_goodput_rps"] > 0 and 4 <= summary["output_tokens"] / summary["n_ok"] <= 12
    rc = cli.main(["sweep", "--strategy", "gen-static", "--model", "synthetic-gen:2+1", "--slo-p99-ms", "1000",
                   "--start-rate", "5", "--duration", "1", "--warmup", "0", "--new-tokens", "5", "--tolerance", "0.5"])
    assert rc == 0
    assert "highest rate meeting ttft_p99_ms <= 1000 ms" in capsys.readouterr().out


def test_generation_compare_writes_results_and_plot_redraws_them(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "gen"
    rc = cli.main(["compare", "--task", "generate", "--quick", "--model", "synthetic-gen:2+1",
                   "--strategies", "gen-static,gen-continuous", "--rates", "10", "--duration", "1.5", "--out", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "gen-static" in table and "ttft_p99_ms" in table and "idle_share" in table
    for name in ("records.csv", "tokens.csv", "steps.csv", "summary.json", "overview.png", "steps_gen-static.png",
                 "ttft_cdf.png", "kv_tokens.png"):
        assert (out / name).stat().st_size > 0, name
    doc = json.loads((out / "summary.json").read_text())
    assert doc["task"] == "generate" and [r["label"] for r in doc["summary"]] == ["gen-static", "gen-continuous"]
    assert all(r["token_throughput_tps"] > 0 for r in doc["summary"])
    steps = pd.read_csv(out / "steps.csv")
    assert set(steps["kind"]) == {"prefill", "decode"} and set(steps["label"]) == {"gen-static", "gen-continuous"}
    for png in out.glob("*.png"):
        png.unlink()
    assert cli.main(["plot", str(out)]) == 0
    assert (out / "overview.png").stat().st_size > 0 and (out / "steps_gen-continuous.png").exists()


def test_compare_shows_overload_as_503s_not_as_unsent_requests() -> None:
    """The server's queue cap is below the load generator's in-flight limit, so the server, not
    the client, turns overload away; what the client could not send has its own column."""
    from labserver.experiments.compare import TABLE_COLUMNS, CompareConfig
    from labserver.loadgen import LoadSpec

    assert CompareConfig().max_queue < LoadSpec("http://127.0.0.1:1", duration_s=1).max_in_flight
    assert "err_client_overflow" in TABLE_COLUMNS["encode"]
    at = CompareConfig().lesson_rates(CompareConfig().rates)
    assert at["latency_cdf"] < at["batch_gantt"] < max(CompareConfig().rates)
