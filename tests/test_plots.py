"""Tests for labserver.plots: each helper on hand-made runs, into a given Axes or its own."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # before pyplot: tests never open windows

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from labserver import analysis, plots  # noqa: E402

pytestmark = pytest.mark.usefixtures("untouched_rcparams")  # (tests/conftest.py)


def fake_run(rate: float, max_batch: int = 4, compute_ms: float = 20.0, n: int = 120, seed: int = 0,
             failures: int = 0) -> pd.DataFrame:
    """Records of one worker batching greedily (up to ``max_batch`` of what is queued)."""
    rng = np.random.default_rng(seed)
    scheduled = np.cumsum(rng.exponential(1.0 / rate, n))
    sent = scheduled + rng.uniform(0.0, 0.002, n)
    enqueue = sent + 0.001
    server = {name: np.full(n, np.nan) for name in ("queue_ms", "compute_ms", "batch_size", "batch_id")}
    dispatch = [""] * n
    done = np.zeros(n)
    free_s, k, batch_id = 0.0, 0, 0
    while k < n:
        start_s = max(free_s, enqueue[k])
        members = [j for j in range(k, n) if enqueue[j] <= start_s][:max_batch]
        took_s = compute_ms * (0.6 + 0.4 * len(members) / max_batch) / 1000.0
        for j in members:
            server["queue_ms"][j] = (start_s - enqueue[j]) * 1000.0
            server["compute_ms"][j] = took_s * 1000.0
            server["batch_size"][j] = len(members)
            server["batch_id"][j] = batch_id
            dispatch[j] = "full" if len(members) == max_batch else "idle"
            done[j] = start_s + took_s + 0.001
        free_s, k, batch_id = start_s + took_s, k + len(members), batch_id + 1
    status = np.array([200] * (n - failures) + [503] * failures)
    latency_ms = (done - scheduled) * 1000.0
    return pd.DataFrame(
        {
            "i": np.arange(n), "scheduled_s": scheduled, "sent_s": sent, "done_s": done, "status": status,
            "error": ["" if s == 200 else "overloaded" for s in status], "latency_ms": latency_ms,
            "send_latency_ms": (done - sent) * 1000.0, "late_ms": (sent - scheduled) * 1000.0,
            "warmup": np.arange(n) < 5, "input_chars": np.full(n, 30), **server, "dispatch": dispatch,
            "server_ms": np.full(n, np.nan), "request_id": [f"r{j}" for j in range(n)],
        }
    )  # fmt: skip


def foreign_run(n: int = 20) -> pd.DataFrame:
    """Records against a server that sends none of labserver's headers."""
    frame = fake_run(50.0, n=n, seed=3)
    for name in ("queue_ms", "compute_ms", "batch_size", "batch_id"):
        frame[name] = np.nan
    frame["dispatch"] = np.nan
    return frame


@pytest.fixture
def two_labels() -> dict[str, pd.DataFrame]:
    return {"batched": fake_run(80.0, max_batch=4), "single": fake_run(30.0, max_batch=1, seed=1, failures=3)}


@pytest.fixture
def sweep_runs() -> pd.DataFrame:
    return analysis.combine(
        [(label, rate, fake_run(rate, max_batch=size, seed=int(rate))) for label, size in (("b4", 4), ("b1", 1))
         for rate in (10.0, 30.0, 60.0)]
    )


def legend_texts(ax) -> list[str]:
    return [text.get_text() for text in ax.get_legend().get_texts()]


# ------------------------------------------------------------ latency


def test_latency_cdf_one_line_per_label_with_marks(ax, two_labels):
    assert plots.latency_cdf(two_labels, ax=ax) is ax
    assert len(ax.lines) == 2
    assert len(ax.collections) == 2  # p50 marks; a p99 of ~110 answers is left out (analysis.trust)
    assert legend_texts(ax) == ["batched", "single", "p50"]
    assert ax.get_xscale() == "log" and "ms" in ax.get_xlabel()
    line = ax.lines[1]  # "single": 115 measured rows, 3 of them 503s
    assert len(line.get_xdata()) == 112 and line.get_ydata()[-1] == pytest.approx(1.0)


def test_a_stream_that_broke_off_after_its_200_is_not_an_answer(ax):
    """One definition of "ok" for the summaries and the pictures: 2xx and no error."""
    run = fake_run(50.0).assign(label="x")
    run.loc[5, ["error", "latency_ms"]] = ["stream_incomplete", 99_999.0]  # status stays 200
    plots.latency_cdf(run, ax=ax)
    drawn = ax.lines[0].get_xdata()
    assert len(drawn) == len(analysis.measured(run)) - 1 and max(drawn) < 99_999.0
    assert analysis.summarize(run)["n_ok"] == len(drawn)


def test_latency_cdf_tail_view_and_unlabelled_frame(ax):
    plots.latency_cdf(fake_run(50.0), ax=ax, tail=True, marks=(50.0, 99.0))
    assert ax.get_yscale() == "log" and len(ax.lines) == 1 and len(ax.collections) == 1
    assert legend_texts(ax) == ["p50"]  # too few answers for a p99 mark
    assert (ax.lines[0].get_ydata() > 0).all()


def test_latency_cdf_without_ax_makes_a_figure(two_labels):
    before = len(plt.get_fignums())
    ax = plots.latency_cdf(two_labels)
    assert len(plt.get_fignums()) == before + 1 and ax.figure.number in plt.get_fignums()


def test_latency_vs_throughput_from_records(ax, sweep_runs):
    assert plots.latency_vs_throughput(sweep_runs, ax=ax, slo_ms=100.0) is ax
    assert len(ax.lines) == 2 * 2 + 1  # p99 and p50 per label, and the SLO
    assert all(len(line.get_xdata()) == 3 for line in ax.lines[:4])  # one marker per offered rate
    assert legend_texts(ax) == ["b4 p99", "b4 p50", "b1 p99", "b1 p50", "SLO 100 ms"]
    assert len(ax.texts) == 6 and ax.texts[0].get_text() == "10/s"
    assert ax.lines[0].get_linestyle() == "-" and ax.lines[1].get_linestyle() == "--"
    assert "throughput" in ax.get_xlabel() and ax.get_yscale() == "log"


def test_latency_vs_throughput_from_summary(ax, sweep_runs):
    table = analysis.summarize_runs(sweep_runs)
    plots.latency_vs_throughput(table, ax=ax, annotate_rates=False)
    assert len(ax.lines) == 4 and not ax.texts
    assert ax.lines[0].get_xdata().tolist() == table.loc[table["label"] == "b4", "throughput_rps"].tolist()


# ------------------------------------------------------------ batches


def test_batch_size_hist_side_by_side_integer_bins(ax, two_labels):
    assert plots.batch_size_hist(two_labels, ax=ax) is ax
    assert len(ax.patches) == 2 * 4  # sizes 1..4 for each label
    heights = [p.get_height() for p in ax.patches]
    batched = analysis.batch_size_counts(two_labels["batched"])
    assert heights[:4] == batched.reindex([1, 2, 3, 4], fill_value=0).tolist()
    assert sum(heights[4:]) == analysis.summarize(two_labels["single"])["n_batches"]
    assert legend_texts(ax) == ["batched", "single"]
    assert ax.get_xlabel().startswith("batch size") and ax.get_ylabel() == "batches"


def test_batch_size_hist_stacked_by_requests(ax, two_labels):
    plots.batch_size_hist(two_labels, ax=ax, stacked=True, weight="requests")
    top = ax.patches[4:]  # second label stacked on the first
    assert all(p.get_y() == q.get_height() for p, q in zip(top, ax.patches[:4]))
    # every measured request that rode a batch shows up once
    n_requests = sum(int(analysis.measured(f)["batch_size"].notna().sum()) for f in two_labels.values())
    assert sum(p.get_height() for p in ax.patches) == n_requests


def test_batch_size_hist_share_puts_every_label_on_one_scale(ax, two_labels):
    """One cumulative line per label from 0 to 1: many batches of one do not flatten the others."""
    plots.batch_size_hist(two_labels, ax=ax, weight="share")
    lines = [line for line in ax.lines if line.get_label() in ("batched", "single")]
    assert [line.get_label() for line in lines] == ["batched", "single"]
    for line in lines:
        y = line.get_ydata()
        assert y[0] == 0.0 and y[-1] == pytest.approx(1.0) and (np.diff(y) >= 0).all()
    single = lines[1].get_ydata()
    assert single[1] == pytest.approx(1.0)  # every "single" request rode a batch of one
    assert ax.get_ylim()[1] <= 1.05


def test_batch_size_hist_without_batch_data_says_so(ax):
    plots.batch_size_hist(foreign_run(), ax=ax)
    assert not ax.patches and "no batch sizes" in ax.texts[0].get_text()
    with pytest.raises(ValueError, match="weight"):
        plots.batch_size_hist(foreign_run(), ax=ax, weight="items")


def test_request_timeline_segments(ax, two_labels):
    assert plots.request_timeline(two_labels, ax=ax, n=10) is ax
    bars = {container.get_label(): len(container) for container in ax.containers}
    assert bars["compute"] == 10 and bars["reply"] == 10  # first label only, 10 requests
    assert set(bars) <= {"late send", "send + parse", "queue", "compute", "reply"}
    assert ax.get_ylim()[0] > ax.get_ylim()[1]  # earliest on top
    assert "s" in ax.get_xlabel()


def test_request_timeline_foreign_server_and_failures(ax):
    frame = foreign_run(20)
    frame.loc[frame.index[-2:], "status"] = 0
    plots.request_timeline(frame, ax=ax, n=50)
    bars = {container.get_label(): len(container) for container in ax.containers}
    assert bars == {"total (no server split)": 15}  # 20 minus 5 warm-up rows
    assert "failed" in legend_texts(ax) and len(ax.collections) == 1


def test_batch_gantt_one_bar_per_batch_per_lane(ax, two_labels):
    assert plots.batch_gantt(two_labels, ax=ax) is ax
    table = analysis.batches(analysis.combine(two_labels))
    assert len(ax.patches) == len(table)
    lanes = dict(zip(ax.get_yticks(), (t.get_text() for t in ax.get_yticklabels())))
    assert lanes == {1: "batched", 0: "single"}  # first label on top
    assert len(ax.figure.axes) == 2  # and its colour bar
    heights = sorted({round(p.get_height(), 6) for p in ax.patches if p.get_y() > 0})
    assert heights[-1] == pytest.approx(0.8)  # full batches fill the lane


def test_batch_gantt_from_batches_frame_without_colorbar(ax):
    table = analysis.batches(fake_run(40.0))
    plots.batch_gantt(table, ax=ax, colorbar=False)
    assert len(ax.patches) == len(table) and len(ax.figure.axes) == 1


def test_batch_gantt_without_batches(ax):
    plots.batch_gantt(foreign_run(), ax=ax)
    assert not ax.patches and ax.texts


# ------------------------------------------------------------ event loop


def lag_samples() -> pd.DataFrame:
    t_s = np.arange(0.0, 2.0, 0.05)
    return pd.DataFrame({"t_s": t_s, "lag_ms": np.where((t_s > 0.5) & (t_s < 0.8), 20.0, 0.5)})


def test_loop_lag_with_probes(ax):
    probes = pd.DataFrame({"t_s": [0.1, 0.6, 0.7, 1.5], "latency_ms": [1.0, 21.0, np.nan, 1.2],
                           "status": [200, 200, 0, 200]})  # fmt: skip
    assert plots.loop_lag(lag_samples(), ax=ax, probes=probes) is ax
    assert len(ax.lines) == 2 and len(ax.collections) == 1
    assert legend_texts(ax) == ["event-loop lag", "probe latency", "probe failed"]
    assert ax.get_ylabel() == "delay (ms)"


def test_loop_lag_per_label(ax):
    plots.loop_lag({"loop": lag_samples(), "thread": lag_samples().assign(lag_ms=0.3)}, ax=ax)
    assert legend_texts(ax) == ["loop loop lag", "thread loop lag"]


# ------------------------------------------------------------ overview


def test_overview_saves_a_png(tmp_path, sweep_runs):
    before = plt.get_fignums()
    fig = plots.overview(sweep_runs, slo_ms=80.0, lag=lag_samples(), title="test")
    assert isinstance(fig, Figure) and plt.get_fignums() == before  # not left open in pyplot
    assert len(fig.axes) == 6 + 1  # six pictures and the Gantt colour bar
    path = tmp_path / "overview.png"
    fig.savefig(path, dpi=60)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_overview_without_lag_widens_the_gantt(two_labels):
    fig = plots.overview(two_labels)
    assert len(fig.axes) == 5 + 1
    gantt = fig.axes[4]
    assert gantt.get_subplotspec().colspan == range(1, 3)


def test_replica_load_draws_one_line_per_replica_with_its_rate() -> None:
    frame = fake_run(20.0, n=200)
    frame["replica"] = np.where(np.arange(len(frame)) % 4 == 0, "slow", "fast")  # a quarter to one replica
    ax = plots.replica_load(frame, bin_s=2.0)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"fast (150)", "slow (50)"}
    # the plotted rates integrate back to each replica's requests
    assert abs(lines["fast (150)"].get_ydata().sum() * 2.0 - 150) < 1e-9
    plt.close("all")
    empty = plots.replica_load(fake_run(20.0, n=10))  # no replica column: says so, draws nothing
    assert not empty.get_lines() and "x-replica" in empty.texts[0].get_text()
    plt.close("all")
