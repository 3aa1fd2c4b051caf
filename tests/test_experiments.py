"""The main job end to end, small: `labserver compare` on a synthetic model, then `plot`."""

from __future__ import annotations

import json
import math
import selectors
import struct
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import image

from labserver import cli
from labserver.experiments import compare as experiment
from labserver.load.results import RECORD_COLUMNS

PNGS = ["overview", "latency_cdf", "latency_vs_throughput", "batch_sizes", "batch_gantt", "loop_lag"]
GEN_PNGS = ["overview", "ttft_cdf", "tpot_cdf", "token_throughput", "ttft_vs_rate", "kv_tokens"]


def assert_png(path: Path) -> None:
    """A real picture: PNG signature, a header with a plausible size that matplotlib reads back, not one flat colour."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path.name
    width, height = struct.unpack(">II", data[16:24])
    assert 200 <= width <= 5000 and 200 <= height <= 5000, (path.name, width, height)
    pixels = image.imread(path)
    assert pixels.shape[:2] == (height, width), path.name
    assert np.ptp(pixels[..., :3]) > 0, f"{path.name} is blank"


def is_answer(records: pd.DataFrame) -> pd.Series:
    """Rows of records.csv.gz read back that were answered: status 200 and an empty error cell."""
    return (records["status"] == 200) & records["error"].isna()


def assert_results_agree(out: Path, labels: list[str], rates: list[float]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """records.csv.gz, summary.csv, summary.json, lag.csv.gz and machine.json of one results folder agree:
    one summary row per (label, rate), each counting that run's records; every run's loop sampled."""
    records = pd.read_csv(out / "records.csv.gz")
    assert set(records.columns) == {*RECORD_COLUMNS, "label", "rate"}
    doc = json.loads((out / "summary.json").read_text())
    summary = pd.DataFrame(doc["summary"])
    assert list(zip(summary["label"], summary["rate"])) == [(label, rate) for label in labels for rate in rates]
    counts = ["label", "rate", "count", "n_ok", "n_warmup"]
    assert pd.read_csv(out / "summary.csv")[counts].to_dict("records") == summary[counts].to_dict("records")
    assert len(records) == (summary["count"] + summary["n_warmup"]).sum()
    answered = is_answer(records)
    for row in summary.itertuples():
        run = records[(records["label"] == row.label) & (records["rate"] == row.rate)]
        measured = run[~run["warmup"]]
        assert (row.count, row.n_warmup) == (len(measured), int(run["warmup"].sum())), row.label
        assert row.n_ok == int(answered[measured.index].sum()) > 0, row.label
        assert math.isclose(row.throughput_rps, row.n_ok / row.window_s, rel_tol=1e-6), row.label
        assert 0 < row.p50_ms <= row.p99_ms <= row.max_ms, row.label
    lag = pd.read_csv(out / "lag.csv.gz")
    assert list(lag.columns) == ["label", "rate", "t_s", "lag_ms"]
    sampled = lag.groupby(["label", "rate"]).size()
    assert all(sampled.get((label, rate), 0) > 0 for label in labels for rate in rates), sampled
    assert lag["t_s"].notna().all() and (lag["lag_ms"] >= 0).all()
    assert json.loads((out / "machine.json").read_text()) == doc["machine"]
    return records, summary


def test_compare_writes_results_and_plot_redraws_them(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "run"
    rc = cli.main(["compare", "--quick", "--model", "synthetic:2+0.2", "--strategies", "naive,thread",
                   "--rates", "40", "--duration", "1.5", "--out", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "naive" in table and "thread" in table and "p99_ms" in table
    assert_results_agree(out, ["naive", "thread"], [40.0])
    for name in PNGS:
        assert_png(out / f"{name}.png")
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
    for name in PNGS:
        assert_png(out / f"{name}.png")


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
    gz = tmp_path / "gz"  # the way results are written now: to the microsecond, gzipped, read back alike
    gz.mkdir()
    assert experiment.save_table(rows.assign(sent_s=[1 / 3, 2 / 3]), gz / "records.csv") == gz / "records.csv.gz"
    again = experiment.read(gz)[0].records
    assert again["sent_s"].tolist() == [0.333333, 0.666667] and again["latency_ms"].isna().sum() == 1
    assert again["error"].tolist() == ["", "client_overflow"]


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
    labels = ["gen-static", "gen-continuous"]
    records, summary = assert_results_agree(out, labels, [10.0])
    pngs = GEN_PNGS + [f"steps_{label}" for label in labels]
    for name in pngs:
        assert_png(out / f"{name}.png")
    doc = json.loads((out / "summary.json").read_text())
    assert doc["task"] == "generate" and [r["label"] for r in doc["summary"]] == labels
    assert all(r["token_throughput_tps"] > 0 for r in doc["summary"])

    # every answer as long as it asked (the load generator sends ignore_eos), in --quick's 8..64
    answers = records[is_answer(records)]
    assert (answers["n_tokens"] == answers["max_new_tokens"]).all() and answers["n_tokens"].between(8, 64).all()
    for row in summary.itertuples():
        run = answers[(answers["label"] == row.label) & ~answers["warmup"]]
        assert row.output_tokens == run["n_tokens"].sum(), row.label
        assert math.isclose(row.token_throughput_tps, row.output_tokens / row.window_s, rel_tol=1e-6), row.label

    # tokens.csv: one row per token each request received, numbered from 0
    tokens = pd.read_csv(out / "tokens.csv.gz")
    assert list(tokens.columns) == ["label", "rate", "i", "k", "t_s"] and len(tokens) == records["n_tokens"].sum()
    per_request = tokens.groupby(["label", "rate", "i"])["k"].agg(["size", "min", "max"])
    received = records.set_index(["label", "rate", "i"])["n_tokens"]
    assert (per_request["size"] == received.reindex(per_request.index)).all()
    assert (per_request["min"] == 0).all() and (per_request["max"] == per_request["size"] - 1).all()

    # steps.csv: the server's steps, every answered request among their sequences; the idle share from them
    steps = pd.read_csv(out / "steps.csv.gz", keep_default_na=False)
    assert {"label", "rate", "step", "decoding", "start_s", "end_s", "seqs", "idle"} <= set(steps.columns)
    decodes = steps["decoding"].map(lambda v: len(str(v).split())) == steps["seqs"].map(lambda v: len(str(v).split()))
    prefills = steps["decoding"].map(lambda v: not str(v).split())
    assert (decodes | prefills).all() and decodes.any() and prefills.any()  # eager: prefill calls, decode steps
    assert set(steps["label"]) == set(labels)
    assert (steps["end_s"] >= steps["start_s"]).all()
    for row in summary.itertuples():
        run = steps[steps["label"] == row.label]
        sids = {int(sid) for seqs in run["seqs"] for sid in str(seqs).split()}
        assert len(sids) >= (answers["label"] == row.label).sum(), row.label
        decode = run[decodes[run.index]]
        idle = sum(len(str(x).split()) for x in decode["idle"]) / sum(len(str(x).split()) for x in decode["seqs"])
        assert math.isclose(row.idle_share, idle, rel_tol=1e-6, abs_tol=1e-9), row.label
    assert summary.set_index("label").loc["gen-continuous", "idle_share"] == 0  # it never holds a finished one

    for png in out.glob("*.png"):
        png.unlink()
    assert cli.main(["plot", str(out)]) == 0
    for name in pngs:
        assert_png(out / f"{name}.png")


def test_compare_shows_overload_as_503s_not_as_unsent_requests() -> None:
    """The load generator's window holds more than the server's queue and, at compare's top rate,
    the requests a strategy on the event loop leaves unread (~2,000): the server, not the
    client, turns overload away; what the client could not send has its own column."""
    from labserver.experiments.compare import TABLE_COLUMNS, CompareConfig
    from labserver.load.loops import loop_factory

    cfg = CompareConfig()
    options = cfg.load_options()
    assert options["max_in_flight"] >= 2500 > cfg.max_queue
    per_process = -(-options["max_in_flight"] // options["processes"])  # as the load generator deals it
    loop = loop_factory(per_process, max(cfg.rates) / options["processes"])()
    try:  # select(), whose timeouts are µs: each process sends on time
        assert isinstance(getattr(loop, "_selector", None), selectors.SelectSelector)
    finally:
        loop.close()
    assert "err_client_overflow" in TABLE_COLUMNS["encode"]
    at = cfg.lesson_rates(cfg.rates)
    assert at["latency_cdf"] < at["batch_gantt"] < max(cfg.rates)


def test_compare_help_names_the_configs_default_rates() -> None:
    from labserver.cli import build_parser
    from labserver.experiments.compare import CompareConfig, GenCompareConfig

    sub = next(a for a in build_parser()._actions if a.dest == "command" or getattr(a, "choices", None))
    rates = next(a for a in sub.choices["compare"]._actions if a.dest == "rates").help
    for cfg in (CompareConfig(), CompareConfig.quick(), GenCompareConfig(), GenCompareConfig.quick()):
        assert ",".join(f"{r:g}" for r in cfg.rates) in rates
