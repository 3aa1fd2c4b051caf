"""Realistic text-length mixes for encoder loads: lognormal lengths, texts of those lengths,
JSON lists of several texts per request, and the server's token count in the records.

The stub is a Starlette app under uvicorn on a loopback socket (``serving`` from
``test_loadgen``) that notes every body it gets and, like an encoder server counting with
MiniLM's tokenizer, answers ``x-input-tokens`` = words + 2 special tokens per text; a
second one sends no such header.
"""

from __future__ import annotations

import doctest
import json
import math

import numpy as np
import pandas as pd
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from labserver import cli
from labserver.load import lengths
from labserver.load.lengths import LENGTHS, LognormalLength, parse_lengths, take_lengths
from labserver.load.mix import Flow
from labserver.load.payloads import WordTexts
from labserver.wire import HEADER_INPUT_TOKENS
from labserver.load.prompts import TokenPrompts
from labserver.loadgen import LoadResult, LoadSpec, run_load_sync

from .test_loadgen import assert_record_shape, serving

FAST = dict(process=False, progress=False)
SPECIAL = 2  # [CLS] and [SEP]


def make_app(seen: list[object], count_tokens: bool = True) -> Starlette:
    def answer(texts: list[str], content: object) -> JSONResponse:
        tokens = sum(len(t.split()) + SPECIAL for t in texts)
        return JSONResponse(content, headers={HEADER_INPUT_TOKENS: str(tokens)} if count_tokens else None)

    async def text(request: Request):
        body = (await request.body()).decode()
        seen.append(body)
        return answer([body], {"output": 0})

    async def predict(request: Request):
        inputs = json.loads(await request.body())["inputs"]
        seen.append(inputs)
        return answer(inputs if isinstance(inputs, list) else [inputs], {"outputs": 0})

    return Starlette(routes=[Route("/", text, methods=["POST"]), Route("/predict", predict, methods=["POST"])])


@pytest.fixture(scope="module")
def counting():
    seen: list[object] = []
    with serving(make_app(seen)) as url:
        yield url, seen


@pytest.fixture(scope="module")
def silent():
    seen: list[object] = []
    with serving(make_app(seen, count_tokens=False)) as url:
        yield url, seen


def words(texts: list[str]) -> int:
    return sum(len(t.split()) for t in texts)


# --- the lognormal ----------------------------------------------------------------------

def test_lognormal_draws_have_the_asked_median_and_p99():
    spec = LognormalLength.from_p99(20, 256)  # hi 2048: no clipping near the p99
    draws = spec.take(20_000, np.random.default_rng(0))
    assert draws.dtype == np.int64 and draws.min() >= 1
    assert np.median(draws) == pytest.approx(20, rel=0.03)
    assert np.percentile(draws, 99) == pytest.approx(256, rel=0.06)
    assert draws.mean() == pytest.approx(spec.mean(), rel=0.05)


def test_lognormal_mean_is_the_unclipped_one():
    assert LognormalLength(20, 1.0).mean() == pytest.approx(20 * math.exp(0.5))
    assert LognormalLength(20, 1.0, hi=40).mean() == LognormalLength(20, 1.0).mean()
    assert (LognormalLength(20, 0.0).take(50, np.random.default_rng(1)) == 20).all()


def test_lognormal_clips_to_its_bounds():
    draws = LognormalLength(20, 1.5, lo=5, hi=64).take(20_000, np.random.default_rng(2))
    assert draws.min() == 5 and draws.max() == 64


def test_lognormal_draws_are_seeded():
    spec = LognormalLength(20, 1.1)
    first = take_lengths(spec, 100, seed=[3, 2])
    assert np.array_equal(first, take_lengths(spec, 100, seed=[3, 2]))
    assert not np.array_equal(first, take_lengths(spec, 100, seed=[4, 2]))


def test_from_p99_gives_the_sigma_of_that_percentile():
    spec = LognormalLength.from_p99(20, 256, lo=2, hi=300)
    assert spec.sigma == pytest.approx(math.log(256 / 20) / 2.3263, rel=1e-4)
    assert (spec.median, spec.lo, spec.hi) == (20, 2, 300)
    assert LognormalLength.from_p99(20, 20).sigma == 0
    with pytest.raises(ValueError, match="p99 >= median"):
        LognormalLength.from_p99(20, 10)


def test_module_doctests():
    assert doctest.testmod(lengths).failed == 0


@pytest.mark.parametrize("text, expected", [
    ("lognormal:20:1.1", LognormalLength(20.0, 1.1)),
    ("lognormal:20:1.1:2:254", LognormalLength(20.0, 1.1, 2, 254)),
])
def test_parse_lognormal(text, expected):
    assert parse_lengths(text) == expected
    assert LENGTHS["lognormal"] is LognormalLength


@pytest.mark.parametrize("text, message", [
    ("lognormal:20", r"use N, uniform:LO:HI, geometric:MEAN\[:LO:HI\], lognormal:MEDIAN:SIGMA\[:LO:HI\] or replay"),
    ("lognormal:20:1:5", r"lognormal:MEDIAN:SIGMA\[:LO:HI\]"),
    ("lognormal:x:1", "bad lengths 'lognormal:x:1'"),
    ("lognormal:0.5:1", "finite median >= 1"),
    ("lognormal:20:-1", "finite sigma >= 0"),
    ("lognormal:20:nan", "finite sigma >= 0"),
    ("lognormal:20:1:0:10", "lo must be an int >= 1"),
    ("lognormal:20:1:10:5", "lo <= hi"),
])
def test_bad_lognormal_specs_say_what_to_write(text, message):
    with pytest.raises(ValueError, match=message):
        parse_lengths(text)


# --- texts of those lengths, for encoder loads ----------------------------------------------

def test_token_prompts_with_lognormal_lengths_have_as_many_words():
    spec = LognormalLength(20, 1.1, hi=254)
    drawn = spec.take(200, np.random.default_rng(5))  # TokenPrompts draws the lengths first
    texts = TokenPrompts(spec).take(200, np.random.default_rng(5))
    assert [len(t.split()) for t in texts] == drawn.tolist()
    assert drawn.max() > 5 * np.median(drawn)  # a long tail, not a spread around the median


def test_text_mode_sends_token_prompts_and_records_the_servers_count(counting):
    url, seen = counting
    spec = LognormalLength(20, 1.1, hi=254)
    before = len(seen)
    result = run_load_sync(url, mode="text", payload=TokenPrompts(spec), seed=3, arrival="constant",
                           rate_per_s=100, max_requests=30, **FAST)
    r = result.records
    assert_record_shape(r)
    expected = take_lengths(spec, 30, seed=[3, 1])  # the payload's seed in an open loop
    assert sorted(len(t.split()) for t in seen[before:]) == sorted(expected.tolist())
    assert r["input_tokens"].tolist() == (expected + SPECIAL).tolist()


def test_cli_prompt_tokens_for_encoder_loads():
    args = cli.build_parser().parse_args(["bench", "--url", "http://127.0.0.1:9", "--rate", "5", "--mode", "json",
                                          "--prompt-tokens", "lognormal:20:1.1:1:254"])
    opts = cli.load_options(args)
    assert opts["mode"] == "json" and opts["texts_per_request"] == 1
    assert opts["payload"].lengths == LognormalLength(20.0, 1.1, 1, 254)


def test_cli_texts_per_request_asks_for_json():
    base = ["bench", "--url", "http://127.0.0.1:9", "--rate", "5", "--texts-per-request", "4"]
    opts = cli.load_options(cli.build_parser().parse_args(base))
    assert opts["mode"] == "json" and opts["texts_per_request"] == 4
    LoadSpec("http://127.0.0.1:9", max_requests=1, **opts)
    text = cli.load_options(cli.build_parser().parse_args([*base, "--mode", "text"]))
    with pytest.raises(ValueError, match="only mode='json' of api='labserver'"):
        LoadSpec("http://127.0.0.1:9", max_requests=1, **text)


# --- several texts per request ------------------------------------------------------------

def test_json_lists_carry_the_payload_in_order(counting):
    url, seen = counting
    payload = [f"text {k} " + "w " * k for k in range(7)]
    before = len(seen)
    result = run_load_sync(url, mode="json", texts_per_request=3, payload=payload, arrival="constant",
                           rate_per_s=100, max_requests=5, **FAST)
    got = seen[before:]
    assert all(isinstance(inputs, list) and len(inputs) == 3 for inputs in got)
    r = result.records
    assert_record_shape(r)
    assert (r["status"] == 200).all()
    cycled = (payload * 3)[:15]
    groups = [cycled[k:k + 3] for k in range(0, 15, 3)]
    assert sorted(map(tuple, got)) == sorted(map(tuple, groups))
    assert r["input_chars"].tolist() == [sum(map(len, g)) for g in groups]
    assert r["input_tokens"].tolist() == [words(g) + 3 * SPECIAL for g in groups]


def test_json_lists_split_over_processes_keep_each_requests_texts(counting):
    url, seen = counting
    payload = [f"t{k}" for k in range(12)]
    before = len(seen)
    result = run_load_sync(url, mode="json", texts_per_request=2, payload=payload, arrival="constant",
                           rate_per_s=50, max_requests=6, processes=2, progress=False)
    assert sorted(map(tuple, seen[before:])) == sorted((f"t{k}", f"t{k + 1}") for k in range(0, 12, 2))
    assert result.records["input_chars"].tolist() == [4] * 5 + [6]


def test_json_lists_in_a_closed_loop(counting):
    url, seen = counting
    before = len(seen)
    result = run_load_sync(url, mode="json", texts_per_request=4, payload=WordTexts(mean_words=6), users=2,
                           max_requests=8, **FAST)
    got = seen[before:]
    assert len(got) == 8 and all(len(inputs) == 4 for inputs in got)
    r = result.records
    assert sorted(r["input_chars"]) == sorted(sum(map(len, inputs)) for inputs in got)
    assert sorted(r["input_tokens"]) == sorted(words(inputs) + 4 * SPECIAL for inputs in got)


@pytest.mark.parametrize("users", [None, 2])
def test_json_lists_with_a_flows_own_payload(counting, users):
    url, seen = counting
    before = len(seen)
    loop = dict(users=users) if users else dict(arrival="constant", rate_per_s=100)
    run_load_sync(url, mode="json", texts_per_request=2, payload=["shared"], max_requests=20,
                  mix=[Flow("own", 1, payload=["alpha", "beta", "gamma"]), Flow("rest", 1)], **loop, **FAST)
    got = [tuple(inputs) for inputs in seen[before:]]
    assert ("shared", "shared") in got and all(len(g) == 2 for g in got)
    own = [g for g in got if g != ("shared", "shared")]
    assert own and all(set(g) <= {"alpha", "beta", "gamma"} and g[0] != g[1] for g in own)


@pytest.mark.parametrize("options, message", [
    (dict(texts_per_request=2), "only mode='json' of api='labserver'.*got mode='text'"),
    (dict(texts_per_request=2, mode="generate"), "got mode='generate'"),
    (dict(texts_per_request=2, mode="json", api="openai-embeddings", model="m"), "api='openai-embeddings'"),
    (dict(texts_per_request=0, mode="json"), "texts_per_request must be an int >= 1"),
    (dict(texts_per_request=2.0, mode="json"), "texts_per_request must be an int >= 1"),
])
def test_texts_per_request_needs_json_on_labserver(options, message):
    with pytest.raises(ValueError, match=message):
        LoadSpec("http://127.0.0.1:9", max_requests=1, **options)


# --- the server's token count -------------------------------------------------------------

def test_input_tokens_are_na_from_a_server_that_sends_none(silent):
    url, _ = silent
    result = run_load_sync(url, mode="json", texts_per_request=2, payload=["a b", "c"], arrival="constant",
                           rate_per_s=100, max_requests=4, **FAST)
    r = result.records
    assert_record_shape(r)
    assert (r["status"] == 200).all() and r["input_tokens"].isna().all()
    assert (r["input_chars"] == 4).all()


def test_input_tokens_survive_the_csv_round_trip(counting, tmp_path):
    url, _ = counting
    result = run_load_sync(url, mode="json", payload=WordTexts(mean_words=5), arrival="constant", rate_per_s=100,
                           max_requests=5, **FAST)
    assert result.records["input_tokens"].notna().all()
    back = LoadResult.from_csv(result.to_csv(tmp_path / "run.csv"))
    pd.testing.assert_series_equal(back.records["input_tokens"], result.records["input_tokens"])
    pd.testing.assert_frame_equal(back.records, result.records)
