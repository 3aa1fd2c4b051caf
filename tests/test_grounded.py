"""The input-grounded workload (``labserver.load.grounded``) and the CLI's ``--questions``: no model, no server."""

from __future__ import annotations

import doctest
import re

import numpy as np
import pytest

from labserver import cli
from labserver.load import grounded, prompts
from labserver.load.grounded import PASSAGES, TASKS, GroundedTasks, misspell
from labserver.load.mix import Flow, Mix
from labserver.load.payloads import WordTexts, take_payloads

BENCH = ["bench", "--url", "http://127.0.0.1:9", "--rate", "5"]
ALL = len(PASSAGES) * len(TASKS)  # every (task, passage) pair


def test_module_doctests() -> None:
    assert doctest.testmod(grounded).failed == 0


def test_the_passages_are_short_plain_and_distinct() -> None:
    assert 20 <= len(PASSAGES) <= 30
    assert len(set(PASSAGES)) == len(PASSAGES)
    for text in PASSAGES:
        assert 60 <= len(text.split()) <= 120, text[:40]
        assert text.isascii() and text == text.strip() and "  " not in text, text[:40]


def test_the_same_seed_draws_the_same_prompts() -> None:
    src = GroundedTasks()
    first = src.take(50, np.random.default_rng(3))
    assert first == src.take(50, np.random.default_rng(3))
    assert first != src.take(50, np.random.default_rng(4))
    assert take_payloads(src, 50, seed=3) == first  # the load generator draws it as it draws Questions


def test_each_pair_once_before_any_repeats() -> None:
    src = GroundedTasks()
    rng = np.random.default_rng(0)
    pairs = src.pairs(2 * ALL + 5, rng)
    everything = {(task, i) for task in TASKS for i in range(len(PASSAGES))}
    assert set(pairs[:ALL]) == everything and len(set(pairs[:ALL])) == ALL
    assert set(pairs[ALL:2 * ALL]) == everything
    assert pairs[:ALL] != pairs[ALL:2 * ALL]  # a new order each round
    texts = src.take(ALL, np.random.default_rng(1))
    assert len(set(texts)) == ALL
    assert texts == [src.prompt(t, i) for t, i in src.pairs(ALL, np.random.default_rng(1))]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_prompt_is_its_instruction_then_its_passage(task: str) -> None:
    src = GroundedTasks()
    for i, passage in enumerate(PASSAGES):
        head, sep, body = src.prompt(task, i).partition("\n\n")
        assert head == TASKS[task] and sep
        if task == "spelling":
            assert body == misspell(passage)
        else:
            assert body == passage  # the answer's words are there to copy


def test_the_spelling_task_really_has_mistakes() -> None:
    for text in PASSAGES:
        wrong = misspell(text)
        assert wrong != text and text not in GroundedTasks().prompt("spelling", PASSAGES.index(text))
        pairs = list(zip(text.split(), wrong.split(), strict=True))  # the same words, some of them changed
        changed = [(a, b) for a, b in pairs if a != b]
        assert 2 <= len(changed) <= len(pairs) // 8, changed
        assert all(len(a) >= 5 and re.sub(r"\W", "", a).islower() for a, _ in changed)  # no names, no numbers
    assert misspell(PASSAGES[0]) == misspell(PASSAGES[0])  # no randomness
    assert misspell("too short to change") == "too short to change"


def test_by_task_labels_each_prompt_with_its_task() -> None:
    split = GroundedTasks().by_task()
    assert list(split) == list(TASKS)
    rng = np.random.default_rng(2)
    assert all(text.startswith(TASKS["summary"]) for text in split["summary"].take(30, rng))
    mix = Mix(tuple(Flow(name, 1.0, payload=src) for name, src in split.items()))
    assert [f.name for f in mix.flows] == list(TASKS)


def test_bad_sources_fail_when_made() -> None:
    with pytest.raises(ValueError, match="names from TASKS"):
        GroundedTasks(tasks=("translate",))
    with pytest.raises(ValueError, match="passages"):
        GroundedTasks(passages=())
    with pytest.raises(ValueError, match="every"):
        misspell("a text", every=0)


def test_the_public_paths() -> None:
    assert prompts.GroundedTasks is GroundedTasks
    assert "GroundedTasks" in prompts.__all__ and "GroundedTasks" in grounded.__all__


@pytest.mark.parametrize(("flag", "kind"), [("chat", prompts.Questions), ("grounded", GroundedTasks)])
def test_the_cli_flag_picks_the_questions(flag: str, kind: type) -> None:
    opts = cli.load_options(cli.build_parser().parse_args([*BENCH, "--questions", flag]))
    assert type(opts["payload"]) is kind
    assert isinstance(cli.load_options(cli.build_parser().parse_args(BENCH))["payload"], WordTexts)


@pytest.mark.parametrize("other", [["--prompt-tokens", "32"], ["--payload-file", "lines.txt"]])
def test_the_cli_refuses_two_payloads(other: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([*BENCH, "--questions", "grounded", *other], [*BENCH, *other, "--questions", "chat"]):
        with pytest.raises(SystemExit) as stop:
            cli.build_parser().parse_args(argv)
        assert stop.value.code == 2
        assert "not allowed with argument" in capsys.readouterr().err


def test_the_cli_refuses_a_shared_prefix_with_questions() -> None:
    args = cli.build_parser().parse_args([*BENCH, "--questions", "grounded", "--shared-prefix", "64"])
    with pytest.raises(ValueError, match="--shared-prefix"):
        cli.load_options(args)
