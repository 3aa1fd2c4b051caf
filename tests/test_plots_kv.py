"""Tests for labserver.plots.kv and the step Gantt's preemptions: small hand-written step logs, what is drawn."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # before pyplot: tests never open windows

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from labserver import plots  # noqa: E402

from .test_plots_tokens import bars, legend_texts, ms  # noqa: E402

pytestmark = pytest.mark.usefixtures("untouched_rcparams")  # (tests/conftest.py)


def step(n: int, kind: str, seqs: tuple, used: int, cached: int = 0, prefilling: tuple = (),
         preempted: tuple = ()) -> dict:
    decoding = () if kind == "prefill" else tuple(s for s in seqs if s not in prefilling)  # (mixed: the rest)
    return {"step": n, "decoding": decoding, "start_s": 100.0 + n / 100, "end_s": 100.0 + n / 100 + 0.008, "seqs": seqs,
            "idle": (), "prefilling": prefilling, "preempted": preempted, "kv_tokens": used * 16,
            "blocks_used": used, "blocks_cached": cached, "blocks_free": 10 - used - cached}


def paged_steps() -> pd.DataFrame:
    """Seq 3 is preempted before step 4 (seqs 1 and 2 needed its blocks) and recomputed in step 6."""
    return pd.DataFrame([
        step(1, "prefill", (1, 2, 3), 6),
        step(2, "decode", (1, 2, 3), 8),
        step(3, "decode", (1, 2, 3), 10),
        step(4, "decode", (1, 2), 7, preempted=(3,)),
        step(5, "decode", (2,), 4, cached=2),  # seq 1 finished; its prompt's blocks stay cached
        step(6, "mixed", (2, 3), 9, prefilling=(3,)),  # seq 3's recompute rides along with seq 2's decode
        step(7, "decode", (2, 3), 9),
    ])  # fmt: skip


def test_step_gantt_marks_a_preemption_and_starts_a_new_stay(ax):
    plots.step_gantt(paged_steps(), ax=ax)
    # seq 3 held lane 2 for steps 1-3; its recompute is a new stay, in the lowest lane free then (seq 1's, 0)
    assert bars(ax, "waiting") == [(ms(1), ms(3, True), 2), (ms(1), ms(4, True), 0), (ms(1), ms(7, True), 1),
                                   (ms(6), ms(7, True), 0)]  # fmt: skip
    assert (ms(6), ms(6, True), 0) in bars(ax, "prefill")  # its piece of a mixed step is drawn as prefill
    assert (ms(2), ms(7, True), 1) in bars(ax, "decode")  # seq 2's share of that step is decode: one bar, 2-7
    (cross,) = [c for c in ax.collections if c.get_label().startswith("preempted")]
    assert np.asarray(cross.get_offsets()).tolist() == [[pytest.approx(ms(4)), 2.0]]
    assert "preempted (1)" in legend_texts(ax)


def test_kv_blocks_stacks_the_pool_and_marks_preemptions(ax):
    assert plots.kv_blocks(paged_steps(), ax=ax) is ax
    used, cached, free = (np.asarray(c.get_paths()[0].vertices) for c in ax.collections[:3])
    assert used[:, 1].max() == 10 and np.isclose(free[:, 1].max(), 10)  # the stack is the pool, every step
    ticks = [line for line in ax.get_lines() if line.get_label().startswith("preemption")]
    assert len(ticks) == 1 and ticks[0].get_xdata().tolist() == pytest.approx([ms(4)])
    assert "preemption (1 sequences)" in legend_texts(ax)
    assert ax.get_ylabel() == "KV blocks"


def test_kv_blocks_reads_a_saved_log_and_says_when_there_is_none(tmp_path, ax):
    frame = paged_steps()
    path = tmp_path / "steps.csv"
    frame.assign(preempted=frame["preempted"].map(str)).to_csv(path, index=False)  # "(3,)" and "()"
    plots.kv_blocks(pd.read_csv(path), ax=ax)
    assert "preemption (1 sequences)" in legend_texts(ax)
    _, other = plt.subplots()
    plots.kv_blocks(pd.DataFrame(columns=["step", "seqs"]), ax=other)
    assert "no step log" in other.texts[0].get_text()


def test_ttft_split_queue_then_the_rest_per_label(ax):
    rows = pd.DataFrame({
        "label": ["reserve"] * 3 + ["paged"] * 3, "status": 200, "warmup": False,
        "queue_ms": [900.0, 1000.0, 1100.0, 10.0, 20.0, 30.0], "ttft_ms": [950.0, 1080.0, 1130.0, 60.0, 70.0, 90.0],
    })  # fmt: skip
    assert plots.ttft_split(rows, ax=ax) is ax
    queue, rest = ax.containers
    assert [p.get_width() for p in queue] == [1000.0, 20.0]  # medians
    assert [p.get_width() for p in rest] == [50.0, 50.0] and [p.get_x() for p in rest] == [1000.0, 20.0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["reserve", "paged"]
    assert ax.texts[0].get_text().strip() == "1,050 ms"


def test_ttft_split_without_the_columns_says_so(ax):
    plots.ttft_split(pd.DataFrame({"label": ["a"], "ttft_ms": [1.0]}), ax=ax)
    assert "queue_ms" in ax.texts[0].get_text()
