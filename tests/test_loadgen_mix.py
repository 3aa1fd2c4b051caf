"""A mix of flows in one load run: the draw, the headers each request carries, the record
columns, and each flow's summary under its own targets.

The stub is a Starlette app under uvicorn on a loopback socket (as in ``test_loadgen``)
that notes the ``x-priority`` / ``x-tenant`` headers and body of every request it gets,
answers with an ``x-request-id`` so a record can be matched to what the server saw, and
refuses tenant "shed" with a 503 and ``x-reason: queue-full``. Its ``/generate`` streams
``max_new_tokens`` token events in labserver's format.
"""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pandas as pd
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from labserver import cli, wire
from labserver.analysis import combine, meets_targets, summarize, summarize_flows, tokens_by
from labserver.load.apis import openai_body
from labserver.load.mix import Flow, Mix, make_mix, parse_mix
from labserver.loadgen import RECORD_COLUMNS, LoadResult, LoadSpec, _plan, run_load_sync

from .test_analysis import make_records
from .test_loadgen import assert_record_shape, serving

FAST = dict(process=False, progress=False)
NONE = "<none>"  # what the stub notes for a header not sent
MIX = "interactive:0.2:priority=0:tenant=a:ttft=500,batch:0.8:priority=1:tenant=b"


def make_app(seen: list[dict]) -> Starlette:
    def note(request: Request, body: bytes) -> dict[str, str]:
        n = len(seen)
        seen.append({"priority": request.headers.get(wire.HEADER_PRIORITY, NONE),
                     "tenant": request.headers.get(wire.HEADER_TENANT, NONE), "body": body})
        return {wire.HEADER_REQUEST_ID: f"q{n}"}

    async def text(request: Request):
        headers = note(request, await request.body())
        if request.headers.get(wire.HEADER_TENANT) == "shed":
            return PlainTextResponse("full", status_code=503, headers={**headers, wire.HEADER_REASON: "queue-full"})
        return PlainTextResponse("ok", headers=headers)

    async def embeddings(request: Request):
        headers = note(request, await request.body())
        return JSONResponse({"object": "list", "data": [{"embedding": [0.0], "index": 0}]}, headers=headers)

    async def generate(request: Request):
        body = await request.body()
        headers = note(request, body)
        n = json.loads(body)["max_new_tokens"]

        async def events():
            for k in range(n):
                yield b"event: token\ndata: " + json.dumps({"index": k, "id": k, "text": " t"}).encode() + b"\n\n"
                await asyncio.sleep(0)
            done = {"text": "", "tokens": list(range(n)), "finish_reason": "length", "prompt_tokens": 2,
                    "generated_tokens": n, "timing": {}}
            yield b"event: done\ndata: " + json.dumps(done).encode() + b"\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    return Starlette(routes=[Route("/", text, methods=["POST"]), Route("/generate", generate, methods=["POST"]),
                             Route("/v1/embeddings", embeddings, methods=["POST"])])


class Stub:
    def __init__(self, url: str, seen: list[dict]):
        self.url, self.seen = url, seen

    def saw(self, records: pd.DataFrame) -> pd.DataFrame:
        """What the server saw of each answered record, in the records' order."""
        answered = records[records["request_id"].notna()]
        got = [self.seen[int(rid[1:])] for rid in answered["request_id"]]
        return pd.DataFrame({"flow": answered["flow"].to_numpy(), "priority": answered["priority"].to_numpy(),
                             "tenant": answered["tenant"].to_numpy(),
                             "sent_priority": [g["priority"] for g in got], "sent_tenant": [g["tenant"] for g in got],
                             "body": [g["body"] for g in got]})


@pytest.fixture(scope="module")
def stub():
    seen: list[dict] = []
    with serving(make_app(seen)) as url:
        yield Stub(url, seen)


def assert_headers_match(saw: pd.DataFrame, mix: Mix) -> None:
    for flow in mix.flows:
        part = saw[saw["flow"] == flow.name]
        assert len(part), flow.name
        want_priority = NONE if flow.priority is None else str(flow.priority)
        assert part["sent_priority"].tolist() == [want_priority] * len(part), flow.name
        assert part["sent_tenant"].tolist() == [flow.tenant or NONE] * len(part), flow.name


# --- the draw ----------------------------------------------------------------------------

def test_shares_of_flows_drawn_match_within_tolerance():
    spec = LoadSpec("http://127.0.0.1:9", arrival="poisson", rate_per_s=1000, max_requests=2000, mix=MIX, **FAST)
    plans, _ = _plan(spec)
    flow = plans[0].flow
    assert len(flow) == 2000
    shares = np.bincount(flow, minlength=2) / len(flow)
    np.testing.assert_allclose(shares, [0.2, 0.8], atol=0.03)  # 3 sd of a binomial share is 0.027
    assert [f.name for f in plans[0].flows] == ["interactive", "batch"]
    three = make_mix([Flow("x", 1), Flow("y", 1), Flow("z", 2)])
    np.testing.assert_allclose(np.bincount(three.assign(2000, seed=3)) / 2000, [0.25, 0.25, 0.5], atol=0.03)


def test_same_seed_same_assignment_whatever_the_arrivals():
    base = dict(max_requests=500, mix=MIX, **FAST)
    a = _plan(LoadSpec("http://127.0.0.1:9", rate_per_s=100, seed=7, **base))[0][0]
    b = _plan(LoadSpec("http://127.0.0.1:9", rate_per_s=100, seed=7, **base))[0][0]
    c = _plan(LoadSpec("http://127.0.0.1:9", rate_per_s=900, arrival="constant", seed=7, **base))[0][0]
    d = _plan(LoadSpec("http://127.0.0.1:9", rate_per_s=100, seed=8, **base))[0][0]
    np.testing.assert_array_equal(a.flow, b.flow)
    np.testing.assert_array_equal(a.scheduled_s, b.scheduled_s)
    np.testing.assert_array_equal(a.flow, c.flow)  # other arrival times, the same flows
    assert not np.array_equal(a.flow, d.flow)
    np.testing.assert_array_equal(a.texts, _plan(LoadSpec("http://127.0.0.1:9", rate_per_s=100, seed=7,
                                                          max_requests=500, **FAST))[0][0].texts)
    split = _plan(LoadSpec("http://127.0.0.1:9", rate_per_s=100, seed=7, processes=3, max_requests=500, mix=MIX,
                           progress=False))[0]
    dealt = np.empty(500, dtype=int)
    for p in split:
        dealt[p.index] = p.flow
    np.testing.assert_array_equal(dealt, a.flow)  # processes split the same assignment


# --- what is sent and what is recorded ------------------------------------------------------

def test_headers_reach_the_server_and_records_carry_flow_priority_tenant_reason(stub):
    mix = make_mix([Flow("interactive", 0.3, priority=0, tenant="a"), Flow("batch", 0.5, priority=3),
                    Flow("refused", 0.2, tenant="shed"), Flow("plain", 0.1)])
    result = run_load_sync(stub.url, arrival="constant", rate_per_s=400, max_requests=200, mix=mix, **FAST)
    r = result.records
    assert_record_shape(r)
    assert r["request_id"].notna().all()  # every request reached the server
    saw = stub.saw(r)
    assert len(saw) == 200
    assert_headers_match(saw, mix)
    for flow in mix.flows:
        part = r[r["flow"] == flow.name]
        assert len(part) > 5, flow.name
        assert (part["tenant"] == (flow.tenant or "")).all()
        if flow.priority is None:
            assert part["priority"].isna().all()
        else:
            assert (part["priority"] == flow.priority).all()
    refused = r["flow"] == "refused"
    assert (r.loc[refused, "status"] == 503).all() and (r.loc[refused, "reason"] == "queue-full").all()
    assert (r.loc[~refused, "status"] == 200).all() and (r.loc[~refused, "reason"] == "").all()
    assert result.meta["mix"] == str(mix) and parse_mix(result.meta["mix"]) == mix
    # the same seed deals the same flows to the same requests
    again = run_load_sync(stub.url, arrival="constant", rate_per_s=400, max_requests=200, mix=mix, **FAST)
    assert again.records["flow"].tolist() == r["flow"].tolist()


def test_the_httpx_client_sends_them_too(stub):
    result = run_load_sync(stub.url, client="httpx", arrival="constant", rate_per_s=200, max_requests=20, mix=MIX,
                           **FAST)
    saw = stub.saw(result.records)
    assert len(saw) == 20
    assert_headers_match(saw, parse_mix(MIX))


def test_records_without_a_mix_have_empty_flow_columns(stub):
    r = run_load_sync(stub.url, arrival="constant", rate_per_s=200, max_requests=5, **FAST).records
    assert_record_shape(r)
    assert (r["flow"] == "").all() and (r["tenant"] == "").all() and r["priority"].isna().all()
    assert (r["reason"] == "").all()
    assert {s["priority"] for s in stub.seen[-5:]} == {NONE} == {s["tenant"] for s in stub.seen[-5:]}
    columns = list(RECORD_COLUMNS)
    assert columns.index("reason") == columns.index("error") + 1
    assert columns[columns.index("input_chars") + 1:][:3] == ["flow", "priority", "tenant"]


def test_spawned_processes_send_each_flows_headers(stub):
    result = run_load_sync(stub.url, arrival="constant", rate_per_s=200, max_requests=60, mix=MIX, process=True,
                           processes=2, progress=False)
    r = result.records
    assert_record_shape(r)
    assert (r["process"] == r["i"] % 2).all()
    planned = _plan(LoadSpec(stub.url, arrival="constant", rate_per_s=200, max_requests=60, mix=MIX, **FAST))[0][0]
    mix = parse_mix(MIX)
    assert r["flow"].tolist() == [mix.names[k] for k in planned.flow]  # the draw made here, before spawning
    saw = stub.saw(r)
    assert len(saw) == 60
    assert_headers_match(saw, mix)


def test_closed_loop_draws_flows_as_it_goes(stub):
    result = run_load_sync(stub.url, users=3, max_requests=90, mix=MIX, seed=1, **FAST)
    r = result.records
    assert len(r) == 90 and set(r["flow"]) == {"interactive", "batch"}
    assert 0.05 < (r["flow"] == "interactive").mean() < 0.45
    assert_headers_match(stub.saw(r), parse_mix(MIX))


@pytest.mark.parametrize("loop", [dict(arrival="constant", rate_per_s=300, max_requests=40),
                                  dict(users=2, max_requests=40)], ids=["open", "closed"])
def test_a_flow_may_send_its_own_payload(stub, loop):
    mix = [Flow("own", 1, tenant="o", payload=["alpha", "beta"]), Flow("shared", 1)]
    result = run_load_sync(stub.url, payload="hello world", mix=mix, **loop, **FAST)
    saw = stub.saw(result.records)
    assert len(saw) == 40
    assert set(saw.loc[saw["flow"] == "own", "body"]) == {b"alpha", b"beta"}
    assert set(saw.loc[saw["flow"] == "shared", "body"]) == {b"hello world"}


def test_openai_bodies_carry_priority_as_vllm_reads_it(stub):
    result = run_load_sync(stub.url, api="openai-embeddings", model="m", arrival="constant", rate_per_s=200,
                           max_requests=30, mix="hi:1:priority=-2,lo:1:priority=5:tenant=t", **FAST)
    saw = stub.saw(result.records)
    assert len(saw) == 30
    for _, row in saw.iterrows():
        doc = json.loads(row["body"])
        assert doc["priority"] == int(row["sent_priority"]) == row["priority"]
        assert doc["input"] and doc["model"] == "m"
    for api in ("openai-completions", "openai-chat"):
        assert json.loads(openai_body(api, "m", "hi", 4, priority=1))["priority"] == 1
        assert "priority" not in json.loads(openai_body(api, "m", "hi", 4))


def test_flows_with_their_own_lengths_and_tokens_per_tenant(stub):
    mix = "short:1:tenant=a:ttft=5000:tokens=2,long:1:tenant=b:tokens=uniform:6:8"
    result = run_load_sync(stub.url, mode="generate", new_tokens=4, arrival="constant", rate_per_s=200,
                           max_requests=40, mix=mix, **FAST)
    r = result.records
    assert (r["status"] == 200).all() and (r["error"] == "").all()
    short, long = r[r["flow"] == "short"], r[r["flow"] == "long"]
    assert (short["max_new_tokens"] == 2).all() and (short["n_tokens"] == 2).all()
    assert long["max_new_tokens"].between(6, 8).all() and (long["n_tokens"] == long["max_new_tokens"]).all()
    sent = [json.loads(b)["max_new_tokens"] for b in stub.saw(r)["body"]]
    assert sent == r["max_new_tokens"].tolist()

    table = result.flow_summary()
    assert table.equals(summarize_flows(r, parse_mix(mix), result.tokens))
    assert table["flow"].tolist() == ["short", "long"] and table["tenant"].tolist() == ["a", "b"]
    assert table["share_of_tokens"].sum() == pytest.approx(1.0)
    assert table["share_of_answers"].sum() == pytest.approx(1.0)
    run = summarize(r, tokens=result.tokens)
    assert table["tokens_per_s"].sum() == pytest.approx(run["token_throughput_tps"])
    assert table["throughput_rps"].sum() == pytest.approx(run["throughput_rps"])
    assert table["gen_goodput_rps"].iloc[0] > 0 and math.isnan(table["gen_goodput_rps"].iloc[1])  # long: no target

    per_tenant = tokens_by(r, result.tokens, key="tenant", bin_s=0.05)
    assert list(per_tenant.columns) == ["t_s", "tenant", "tokens", "tokens_per_s"]
    totals = per_tenant.groupby("tenant")["tokens"].sum()
    assert totals["a"] == short["n_tokens"].sum() and totals["b"] == long["n_tokens"].sum()
    assert len(per_tenant) == 2 * per_tenant["t_s"].nunique()  # every bin shows both tenants
    # without the tokens frame, each answer counts at its end
    assert tokens_by(r, None, key="tenant")["tokens"].sum() == r["n_tokens"].sum()


def test_csv_round_trip_keeps_the_flow_columns(stub, tmp_path):
    result = run_load_sync(stub.url, arrival="constant", rate_per_s=200, max_requests=20,
                           mix="x:1:priority=2:tenant=shed,y:1", **FAST)
    result.to_csv(tmp_path / "run.csv")
    back = LoadResult.from_csv(tmp_path / "run.csv")
    pd.testing.assert_frame_equal(back.records, result.records)
    assert set(back.records["reason"]) == {"queue-full", ""} and set(back.records["tenant"]) == {"shed", ""}


# --- bad mixes fail early, saying what is wrong ------------------------------------------------

@pytest.mark.parametrize("spec, says", [
    ("", "empty mix"),
    ("interactive", "must start with NAME:SHARE"),
    ("interactive:lots", "share 'lots' is not a number"),
    ("a:0", "share must be a number > 0"),
    ("a:1:prio=0", "unknown key 'prio'"),
    ("a:1:priority=high", "priority='high'"),
    ("a:1:ttft=-5", "ttft_slo_ms must be a number of ms > 0"),
    ("a:1:tokens=lots", "bad lengths 'lots'"),
    ("a:1:7", "'7' in flow 'a' is not KEY=VALUE"),
    ("a:1,a:2", "flow names must differ"),
    ("a:1:priority=1:priority=2", "gives 'priority' twice"),
])
def test_a_bad_mix_string_says_what_is_wrong(spec, says):
    with pytest.raises(ValueError, match="bad mix|empty mix") as info:
        parse_mix(spec)
    assert says in str(info.value)
    with pytest.raises(ValueError, match="NAME:SHARE|bad mix|empty mix"):
        LoadSpec("http://127.0.0.1:9", max_requests=1, mix=spec)


def test_other_bad_mixes():
    with pytest.raises(ValueError, match="set new_tokens, but this load generates no tokens"):
        LoadSpec("http://127.0.0.1:9", max_requests=1, mix="a:1:tokens=4")
    with pytest.raises(ValueError, match="priority must be an int"):
        Flow("a", priority="0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one or more Flow"):
        Mix(())
    with pytest.raises(TypeError, match="mix must be"):
        make_mix(3)  # type: ignore[arg-type]


def test_mix_strings_round_trip():
    spec = "i:0.25:priority=0:tenant=a:slo=20:ttft=500:tpot=50:tokens=32,b:0.75:priority=1:tokens=uniform:100:200"
    mix = parse_mix(spec)
    assert str(mix) == spec and parse_mix(str(mix)) == mix
    assert mix.flow("i").headers() == {wire.HEADER_PRIORITY: "0", wire.HEADER_TENANT: "a"}
    assert mix.flow("b").headers() == {wire.HEADER_PRIORITY: "1"}
    assert make_mix([dict(name="x", share=2)]).flows[0] == Flow("x", 2)


def test_cli_mix_flag():
    args = cli.build_parser().parse_args(["bench", "--url", "http://127.0.0.1:9", "--rate", "5", "--mix", MIX])
    assert cli.load_options(args)["mix"] == parse_mix(MIX)
    bad = cli.build_parser().parse_args(["bench", "--url", "http://127.0.0.1:9", "--rate", "5", "--mix", "a:x"])
    with pytest.raises(ValueError, match="share 'x' is not a number"):
        cli.load_options(bad)


def test_bench_prints_each_flow(stub, capsys):
    from labserver.cli.bench import _flow_table

    args = cli.build_parser().parse_args(["bench", "--url", stub.url, "--rate", "5", "--slo-ms", "1000"])
    result = run_load_sync(stub.url, arrival="constant", rate_per_s=200, max_requests=20,
                           mix="fast:1:priority=0:slo=0.001,slow:1:priority=1", **FAST)
    text = _flow_table(args, result)
    assert "per flow" in text and "fast" in text and "slow" in text and "goodput_rps" in text


# --- per-flow summaries on records worked out by hand ----------------------------------------

def flow_records() -> pd.DataFrame:
    # a: latencies 5, 20 (target 10: one good); b: 50, 150, 90 (target 100: two good); over 10 s
    r = make_records([5.0, 20.0, 50.0, 150.0, 90.0], scheduled_s=[0.0, 1.0, 2.0, 3.0, 4.0])
    return r.assign(flow=["a", "a", "b", "b", "b"], priority=pd.array([0, 0, 1, 1, 1], dtype="Int64"),
                    tenant=["t1", "t2", "t1", "t1", "t2"])


def test_per_flow_goodput_uses_each_flows_own_target():
    mix = [Flow("a", 1, slo_ms=10), Flow("b", 1, slo_ms=100)]
    table = summarize_flows(flow_records(), mix, duration_s=10.0).set_index("flow")
    assert table.loc["a", "slo_ms"] == 10 and table.loc["b", "slo_ms"] == 100
    assert table.loc["a", "goodput_rps"] == pytest.approx(1 / 10)
    assert table.loc["b", "goodput_rps"] == pytest.approx(2 / 10)
    assert table.loc["a", "good_frac"] == pytest.approx(1 / 2) and table.loc["b", "good_frac"] == pytest.approx(2 / 3)
    assert table.loc["a", "share_of_requests"] == pytest.approx(0.4)
    assert table.loc["b", "p50_ms"] == 90.0 and table.loc["a", "priority"] == 0
    # one target for all would judge them otherwise
    one = summarize_flows(flow_records(), slo_ms=10, duration_s=10.0).set_index("flow")
    assert one.loc["b", "goodput_rps"] == 0.0
    # a flow that sets none takes the keyword target
    partial = summarize_flows(flow_records(), [Flow("a", 1, slo_ms=10), Flow("b", 1)], slo_ms=60,
                              duration_s=10.0).set_index("flow")
    assert partial.loc["b", "goodput_rps"] == pytest.approx(1 / 10) and partial.loc["b", "slo_ms"] == 60


def test_rates_are_per_second_of_the_runs_window_and_add_up():
    r = flow_records()
    table = summarize_flows(r, {"a": {"slo_ms": 10}, "b": {"slo_ms": 100}})
    run = summarize(r)
    assert table["throughput_rps"].sum() == pytest.approx(run["throughput_rps"])
    assert (table["window_s"] == run["window_s"]).all()


def test_per_tenant_goodput_counts_each_request_against_its_flows_target():
    mix = parse_mix("a:1:slo=10,b:1:slo=100")
    table = summarize_flows(flow_records(), mix, key="tenant", duration_s=10.0).set_index("tenant")
    # t1: a@5 (good), b@50 (good), b@150 (late); t2: a@20 (late), b@90 (good)
    assert table.loc["t1", "goodput_rps"] == pytest.approx(2 / 10)
    assert table.loc["t2", "goodput_rps"] == pytest.approx(1 / 10)
    assert math.isnan(table.loc["t1", "slo_ms"])  # its requests have different targets
    good = meets_targets(flow_records(), mix)
    assert good["good"].tolist() == [True, False, True, False, True] and good["gen_good"].isna().all()
    by_class = summarize_flows(flow_records(), mix, key="priority", duration_s=10.0)
    assert by_class["priority"].tolist() == [0, 1] and by_class["slo_ms"].tolist() == [10, 100]


def test_per_flow_generation_goodput_under_its_own_ttft_and_tpot():
    r = flow_records().assign(ttft_ms=[100.0, 900.0, 100.0, 2000.0, 100.0], tpot_ms=[10.0, 10.0, 80.0, 10.0, np.nan],
                              n_tokens=pd.array([4, 4, 8, 8, 1], dtype="Int64"))
    mix = [Flow("a", 1, ttft_slo_ms=500), Flow("b", 1, ttft_slo_ms=5000, tpot_slo_ms=50)]
    table = summarize_flows(r, mix, duration_s=10.0).set_index("flow")
    assert table.loc["a", "gen_goodput_rps"] == pytest.approx(1 / 10)  # 900 > 500
    assert table.loc["b", "gen_goodput_rps"] == pytest.approx(2 / 10)  # tpot 80 > 50; one token: no TPOT to miss
    assert table.loc["a", "tokens_per_s"] == pytest.approx(8 / 10)
    assert table.loc["b", "share_of_tokens"] == pytest.approx(17 / 25)
    assert table.loc["b", "gen_good_frac"] == pytest.approx(2 / 3)


def test_per_flow_summaries_of_combined_runs():
    both = combine([("x", 1.0, flow_records()), ("y", 2.0, flow_records())])
    table = summarize_flows(both, parse_mix("a:1:slo=10,b:1:slo=100"))
    assert table[["label", "rate", "flow"]].values.tolist() == [["x", 1.0, "a"], ["x", 1.0, "b"],
                                                                  ["y", 2.0, "a"], ["y", 2.0, "b"]]
    with pytest.raises(ValueError, match="no 'tenant' column"):
        summarize_flows(make_records([1.0]), key="tenant")
    with pytest.raises(TypeError, match="parse_mix"):
        summarize_flows(flow_records(), "a:1:slo=10")


def test_tokens_by_fills_the_bins_and_combined_runs():
    rec = pd.DataFrame({"i": [0, 1, 2], "tenant": ["a", "b", "a"], "n_tokens": [2, 1, 3], "done_s": [0.5, 2.5, 2.9],
                        "status": 200, "error": ""})
    tok = pd.DataFrame({"i": [0, 0, 1], "k": [0, 1, 0], "t_s": [0.1, 0.4, 2.2]})  # request 2: one piece, at done_s
    table = tokens_by(rec, tok, bin_s=1.0)
    assert table.values.tolist() == [[0.0, "a", 2, 2.0], [0.0, "b", 0, 0.0], [1.0, "a", 0, 0.0],
                                     [1.0, "b", 0, 0.0], [2.0, "a", 3, 3.0], [2.0, "b", 1, 1.0]]
    runs = tokens_by(pd.concat([rec.assign(label="x", rate=1.0), rec.assign(label="y", rate=1.0)]),
                     pd.concat([tok.assign(label="x", rate=1.0), tok.assign(label="y", rate=1.0)]), bin_s=1.0)
    assert list(runs.columns) == ["label", "rate", "t_s", "tenant", "tokens", "tokens_per_s"]
    assert runs.groupby("label")["tokens"].sum().tolist() == [6, 6]
    with pytest.raises(ValueError, match="bin_s must be > 0"):
        tokens_by(rec, tok, bin_s=0)
