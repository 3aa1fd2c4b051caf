"""Tests for labserver.plots.tokens: each picture on small hand-written frames, asserting on what is drawn."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # before pyplot: tests never open windows

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from labserver import plots  # noqa: E402

pytestmark = pytest.mark.usefixtures("untouched_rcparams")  # (tests/conftest.py)


def legend_texts(ax) -> list[str]:
    return [text.get_text() for text in ax.get_legend().get_texts()]


# ------------------------------------------------------------ frames


def fake_records() -> pd.DataFrame:
    """Two strategies at two rates, five requests each: one warm-up, one 503, three ok."""
    rows = []
    for label, base_ms in (("gen-static", 100.0), ("gen-continuous", 20.0)):
        for rate in (2.0, 4.0):
            for i in range(5):
                ok = i != 4
                rows.append({
                    "label": label, "rate": rate, "i": i, "warmup": i == 0, "status": 200 if ok else 503,
                    "ttft_ms": 9999.0 if i == 0 else base_ms * rate + i,
                    "tpot_ms": np.nan if i == 3 else base_ms / 10 + i,
                    "latency_ms": base_ms * rate * 3 + i, "n_tokens": 8, "max_new_tokens": 8,
                    "scheduled_s": i / rate, "done_s": i / rate + 1.0,
                })  # fmt: skip
    return pd.DataFrame(rows)


def fake_summary() -> pd.DataFrame:
    return pd.DataFrame({
        "label": ["gen-static", "gen-static", "gen-continuous", "gen-continuous", "gen-continuous"],
        "rate": [4.0, 2.0, 2.0, 4.0, np.nan],  # out of order, and a closed-loop row that has no place
        "token_throughput_tps": [60.0, 40.0, 45.0, 90.0, 100.0],
        "throughput_rps": [3.0, 2.0, 2.0, 4.0, 5.0],
        "ttft_p50_ms": [300.0, 200.0, 40.0, 60.0, 50.0], "ttft_p99_ms": [900.0, 400.0, 80.0, 200.0, 90.0],
        "gen_goodput_rps": [np.nan] * 5,
    })  # fmt: skip


def step(n: int, kind: str, seqs: tuple, idle: tuple = (), kv: int = 0, reserved: int = 0) -> dict:
    # step n runs from 100 + n/100 s to 8 ms later on the server's clock; a "prefill" call decodes nobody
    return {"step": n, "decoding": () if kind == "prefill" else seqs, "start_s": 100.0 + n / 100, "end_s": 100.0 + n / 100 + 0.008,
            "seqs": seqs, "idle": idle, "kv_tokens": kv, "kv_reserved": reserved}  # fmt: skip


def static_steps() -> pd.DataFrame:
    """A batch of three that runs until its longest (seq 2) is done, then a batch of two."""
    return pd.DataFrame([
        step(1, "prefill", (1, 2, 3), kv=30, reserved=60),
        step(2, "decode", (1, 2, 3), kv=33, reserved=60),
        step(3, "decode", (1, 2, 3), (1,), kv=35, reserved=60),  # seq 1 finished at step 2
        step(4, "decode", (1, 2, 3), (1, 3), kv=36, reserved=60),
        step(5, "prefill", (4, 5), kv=20, reserved=40),  # a new batch: lanes 0 and 1 again
        step(6, "decode", (4, 5), kv=22, reserved=40),
    ])  # fmt: skip


def continuous_steps() -> pd.DataFrame:
    """Seq 1 leaves after step 2; seq 3 is prefilled into its lane while seq 2 waits."""
    return pd.DataFrame([
        step(1, "prefill", (1, 2), kv=20, reserved=40),
        step(2, "decode", (1, 2), kv=22, reserved=40),
        step(3, "prefill", (3,), kv=21, reserved=40),
        step(4, "decode", (2, 3), kv=23, reserved=40),
    ])  # fmt: skip


def ms(n: int, end: bool = False) -> float:
    """Where step n starts (or ends) on the Gantt's x axis: ms since step 1 started."""
    return (n - 1) * 10.0 + (8.0 if end else 0.0)


def bars(ax, state: str) -> list[tuple[float, float, int]]:
    """``(x0, x1, lane)`` of every bar in the collection whose legend name starts with ``state``."""
    (collection,) = [c for c in ax.collections if c.get_label().startswith(state)]
    out = []
    for path in collection.get_paths():
        xy = path.vertices[:4]
        out.append((round(xy[:, 0].min(), 6), round(xy[:, 0].max(), 6), int(round(xy[:, 1].mean()))))
    return sorted(out)


# ------------------------------------------------------------ the step Gantt


def test_step_gantt_static_idle_bars_exactly_where_idle_says(ax):
    assert plots.step_gantt(static_steps(), ax=ax) is ax
    # lanes: 1 -> 0, 2 -> 1, 3 -> 2; the second batch reuses the lowest freed lanes: 4 -> 0, 5 -> 1
    assert bars(ax, "idle") == [(ms(3), ms(4, True), 0), (ms(4), ms(4, True), 2)]
    assert bars(ax, "decode") == [
        (ms(2), ms(2, True), 0), (ms(2), ms(3, True), 2), (ms(2), ms(4, True), 1),  # consecutive steps: one bar
        (ms(6), ms(6, True), 0), (ms(6), ms(6, True), 1),
    ]  # fmt: skip
    assert bars(ax, "prefill") == [(ms(1), ms(1, True), lane) for lane in (0, 1, 2)] + [
        (ms(5), ms(5, True), lane) for lane in (0, 1)]  # fmt: skip
    assert bars(ax, "waiting") == sorted([(ms(1), ms(4, True), lane) for lane in (0, 1, 2)] + [
        (ms(5), ms(6, True), lane) for lane in (0, 1)])  # fmt: skip
    assert ax.get_xlabel() == "time since first step (ms)" and not ax.get_title()
    assert list(ax.get_yticks()) == [0, 1, 2]
    # 3 of the 11 sequence-steps in decode calls were idle
    assert "idle: done, still computed (27%)" in legend_texts(ax)
    assert not ax.patches  # a few collections, never one patch per bar


def test_step_gantt_continuous_reuses_a_lane_and_shows_the_stall(ax):
    plots.step_gantt(continuous_steps(), ax=ax)
    assert bars(ax, "prefill") == [(ms(1), ms(1, True), 0), (ms(1), ms(1, True), 1), (ms(3), ms(3, True), 0)]
    # seq 2 sat out seq 3's prefill: two decode bars, one waiting bar under its whole stay
    assert bars(ax, "decode") == [(ms(2), ms(2, True), 0), (ms(2), ms(2, True), 1), (ms(4), ms(4, True), 0),
                                  (ms(4), ms(4, True), 1)]  # fmt: skip
    assert bars(ax, "waiting") == [(ms(1), ms(2, True), 0), (ms(1), ms(4, True), 1), (ms(3), ms(4, True), 0)]
    assert bars(ax, "idle") == [] and "idle: done, still computed (0%)" in legend_texts(ax)


def test_step_gantt_never_shares_a_lane_within_a_step(ax):
    # a log that starts mid-run (the engine keeps only the last steps): seq 2 first seen in seq 1's last step
    plots.step_gantt(pd.DataFrame([step(1, "decode", (1,)), step(2, "decode", (1, 2)), step(3, "decode", (2, 3))]),
                        ax=ax)
    assert bars(ax, "waiting") == [(ms(1), ms(2, True), 0), (ms(2), ms(3, True), 1), (ms(3), ms(3, True), 0)]


def test_step_gantt_string_and_list_forms_draw_the_same(tmp_path):
    frame = static_steps()
    path = tmp_path / "steps.csv"
    frame.assign(seqs=frame["seqs"].map(lambda ids: " ".join(map(str, ids))),
                 idle=frame["idle"].map(lambda ids: " ".join(map(str, ids)))).to_csv(path, index=False)
    back = pd.read_csv(path)  # an empty idle comes back NaN
    assert back["idle"].isna().any()
    as_lists = frame.assign(seqs=frame["seqs"].map(list), idle=frame["idle"].map(list))
    drawn = []
    for steps in (frame, as_lists, back):
        _, ax = plt.subplots()
        plots.step_gantt(steps, ax=ax)
        drawn.append({state: bars(ax, state) for state in ("decode", "prefill", "idle", "waiting")})
    assert drawn[0] == drawn[1] == drawn[2]


def test_step_gantt_one_run_its_first_steps_from_a_given_origin(ax):
    steps = pd.concat([static_steps().assign(label="gen-static", rate=4.0),
                       continuous_steps().assign(label="gen-continuous", rate=4.0)])
    plots.step_gantt(steps, ax=ax, label="gen-continuous", max_steps=2, t0_s=100.0)
    # steps 1-2 of the continuous run only, 10 ms later than from its own first step
    assert bars(ax, "prefill") == [(10.0, 18.0, 0), (10.0, 18.0, 1)]
    assert bars(ax, "decode") == [(20.0, 28.0, 0), (20.0, 28.0, 1)]


def test_step_gantt_stays_a_few_collections_for_a_long_log(ax):
    steps = pd.DataFrame([step(n, "decode", tuple(range(32)), tuple(range(n % 2, 32, 2))) for n in range(1, 2001)])
    plots.step_gantt(steps, ax=ax)
    assert len(ax.collections) == 4 and not ax.patches
    sizes = {c.get_label().split(" ")[0]: len(c.get_paths()) for c in ax.collections}
    assert sizes == {"waiting,": 32, "decode": 32_000, "prefill": 0, "idle:": 32_000}  # alternating: nothing merges
    assert ax.get_xlabel().endswith("(s)")  # 20 s of steps: seconds, not ms


def test_step_gantt_without_a_step_log_says_so(ax):
    plots.step_gantt(pd.DataFrame(columns=["step", "decoding", "seqs"]), ax=ax)  # gen-hf-cb
    assert not ax.collections and "no step log" in ax.texts[0].get_text()


# ------------------------------------------------------------ KV cache


def test_kv_tokens_in_use_and_reserved_per_run(ax):
    steps = pd.concat([static_steps().assign(label="gen-static"), continuous_steps().assign(label="gen-continuous")])
    assert plots.kv_tokens(steps, ax=ax, capacity=100) is ax
    assert len(ax.lines) == 2 * 2 + 1
    used, reserved = ax.lines[0], ax.lines[1]
    assert used.get_ydata().tolist() == static_steps()["kv_tokens"].tolist()
    assert reserved.get_ydata().tolist() == static_steps()["kv_reserved"].tolist()
    assert used.get_linestyle() == "-" and reserved.get_linestyle() == "--"
    assert used.get_xdata()[0] == pytest.approx(8.0)  # after each call, from the run's first step, in ms
    assert legend_texts(ax) == ["gen-static", "gen-continuous", "capacity 100", "in use", "reserved"]
    assert ax.lines[-1].get_ydata()[0] == 100


# ------------------------------------------------------------ token latency


def test_ttft_cdf_one_line_per_label_ok_measured_only(ax):
    records = fake_records()
    assert plots.ttft_cdf(records, ax=ax) is ax
    assert len(ax.lines) == 2 and len(ax.collections) == 2  # p50 marks; a p99 needs 300 answers
    assert legend_texts(ax) == ["gen-static", "gen-continuous", "p50"]
    # three ok, measured requests per run, two runs per label: warm-up (9999 ms) and the 503 left out
    assert ax.lines[1].get_xdata().tolist() == [41.0, 42.0, 43.0, 81.0, 82.0, 83.0]
    assert ax.get_xscale() == "log" and "ms" in ax.get_xlabel() and "first token" in ax.get_xlabel()


def test_tpot_cdf_skips_requests_without_a_second_token(ax):
    plots.tpot_cdf(fake_records(), ax=ax)
    assert ax.lines[0].get_xdata().tolist() == [11.0, 11.0, 12.0, 12.0]  # i == 3 has no TPOT
    assert ax.get_title() == "Time per output token"


def test_itl_cdf_gaps_within_each_stream(ax):
    tokens = pd.DataFrame({
        "label": ["a"] * 5 + ["b"] * 3, "rate": 1.0, "i": [0, 0, 0, 1, 1, 0, 0, 0],
        "k": [2, 0, 1, 0, 1, 0, 1, 2], "t_s": [0.030, 0.0, 0.010, 5.0, 5.005, 1.0, 1.002, 1.004],
    })  # fmt: skip
    assert plots.itl_cdf(tokens, ax=ax) is ax
    assert ax.lines[0].get_xdata() == pytest.approx([5.0, 10.0, 20.0])  # never across requests
    assert ax.lines[1].get_xdata() == pytest.approx([2.0, 2.0])
    assert ax.get_ylabel() == "fraction of gaps"
    records = pd.DataFrame({"label": ["a", "a", "b"], "rate": 1.0, "i": [0, 1, 0], "status": [200, 200, 200],
                            "warmup": [True, False, False]})  # fmt: skip
    _, ax = plt.subplots()
    plots.itl_cdf(tokens, ax=ax, records=records)
    assert ax.lines[0].get_xdata() == pytest.approx([5.0])  # request 0 was warm-up


def test_colours_follow_labels_across_pictures():
    tokens = pd.DataFrame({"label": ["z", "z", "a", "a"], "rate": 1.0, "i": 0, "k": [0, 1, 0, 1],
                           "t_s": [0.0, 0.01, 0.0, 0.02]})  # fmt: skip
    records = pd.DataFrame({"label": ["z", "a"], "ttft_ms": [1.0, 2.0], "status": 200})
    summary = pd.DataFrame({"label": ["z", "a"], "rate": 1.0, "token_throughput_tps": [1.0, 2.0]})
    colours = []
    for picture, frame in ((plots.itl_cdf, tokens), (plots.ttft_cdf, records),
                           (plots.token_throughput_vs_rate, summary)):
        ax = picture(frame, plt.subplots()[1])
        colours.append([to_hex(line.get_color()) for line in ax.lines])
    assert colours[0] == colours[1] == colours[2] and colours[0][0] != colours[0][1]


# ------------------------------------------------------------ against offered rate


def test_token_throughput_vs_rate_x_is_the_offered_rates(ax):
    assert plots.token_throughput_vs_rate(fake_summary(), ax=ax, limit_tps=120.0) is ax
    static, continuous, limit = ax.lines
    assert static.get_xdata().tolist() == [2.0, 4.0] and static.get_ydata().tolist() == [40.0, 60.0]
    assert continuous.get_xdata().tolist() == [2.0, 4.0]  # the closed-loop row has no offered rate
    assert limit.get_linestyle() == "--" and limit.get_ydata()[0] == 120.0
    assert legend_texts(ax) == ["gen-static", "gen-continuous", "offline limit 120 tokens/s"]
    assert ax.get_ylim()[0] == 0


def test_ttft_vs_rate_p99_and_p50_per_label(ax):
    assert plots.ttft_vs_rate(fake_summary(), ax=ax, slo_ms=500.0) is ax
    assert len(ax.lines) == 2 * 2 + 1
    assert ax.lines[0].get_ydata().tolist() == [400.0, 900.0] and ax.lines[1].get_ydata().tolist() == [200.0, 300.0]
    assert legend_texts(ax) == ["gen-static", "gen-continuous", "SLO 500 ms", "p99", "p50"]
    assert ax.get_yscale() == "log"


# ------------------------------------------------------------ manners, empty frames


PICTURES = [
    (plots.ttft_cdf, fake_records),
    (plots.tpot_cdf, fake_records),
    (plots.token_throughput_vs_rate, fake_summary),
    (plots.ttft_vs_rate, fake_summary),
    (plots.step_gantt, static_steps),
    (plots.kv_tokens, static_steps),
]


@pytest.mark.parametrize(("picture", "make"), PICTURES, ids=lambda p: getattr(p, "__name__", ""))
def test_draws_into_the_given_axes_or_a_new_figure(picture, make):
    fig, ax = plt.subplots()
    assert picture(make(), ax) is ax and ax.figure is fig
    before = len(plt.get_fignums())
    assert picture(make()).figure.number in plt.get_fignums()
    assert len(plt.get_fignums()) == before + 1


@pytest.mark.parametrize("picture", [p for p, _ in PICTURES] + [plots.itl_cdf], ids=lambda p: p.__name__)
def test_empty_frames_draw_a_message(picture, ax):
    assert picture(pd.DataFrame(), ax) is ax
    assert len(ax.texts) == 1 and ax.texts[0].get_text().startswith("no ")
    assert not ax.lines and not ax.collections


def test_token_cdf_without_a_2xx_request_says_so(ax):
    plots.ttft_cdf(fake_records().assign(status=503), ax=ax)
    assert not ax.lines and ax.texts[0].get_text() == "no ttft_ms of an answered request"


# ------------------------------------------------------------ overview


def test_generation_overview_saves_a_png(tmp_path):
    records = fake_records()
    steps = pd.concat([static_steps().assign(label="gen-static", rate=4.0),
                       static_steps().assign(label="gen-static", rate=2.0, seqs=[(9,)] * 6, idle=[()] * 6),
                       continuous_steps().assign(label="gen-continuous", rate=4.0)])
    records = pd.concat([records, records[records["label"] == "gen-static"].assign(label="gen-hf-cb")])
    tokens = pd.DataFrame({"label": "gen-static", "rate": 4.0, "i": 1, "k": [0, 1], "t_s": [0.0, 0.01]})
    before = plt.get_fignums()
    fig = plots.generation_overview(records, fake_summary(), steps, tokens, limit_tps=100.0, title="test")
    assert isinstance(fig, Figure) and plt.get_fignums() == before  # not left open in pyplot
    assert len(fig.axes) == 5 + 3 + 1  # five on top; a Gantt per label and the KV cache below
    gantts = fig.axes[5:8]
    assert [ax.get_title() for ax in gantts] == ["Steps: gen-static @ 4/s", "Steps: gen-continuous @ 4/s",
                                                 "Steps: gen-hf-cb @ 4/s"]  # fmt: skip
    assert bars(gantts[0], "idle") == [(ms(3), ms(4, True), 0), (ms(4), ms(4, True), 2)]  # the 4/s run only
    assert "no step log" in gantts[2].texts[0].get_text()
    assert len(fig.axes[8].lines) == 2 * 2 + 0  # KV of the two runs drawn above
    assert fig.axes[0].get_title() == "Time to first token (highest rate)"
    path = tmp_path / "overview.png"
    fig.savefig(path, dpi=50)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_generation_overview_without_steps_is_one_row():
    fig = plots.generation_overview(fake_records(), fake_summary())
    assert len(fig.axes) == 4
    assert [ax.get_subplotspec().colspan.start for ax in fig.axes] == [0, 1, 2, 3]
