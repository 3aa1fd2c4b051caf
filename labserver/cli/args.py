"""The argument groups several commands share, and what each turns into.

``add_model_args`` (which model, where), ``add_strategy_args`` (the limits a strategy
runs under, turned into ``Limits`` by ``limits_from``) and ``add_load_args`` (what load
to send and where, turned into ``run_load`` options by ``load_options``). The commands
themselves, and the flags only one of them takes, are in the command modules beside
this one.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..config import DEFAULT_STRATEGY
from ..strategies import Limits, strategy_names
from ..strategies.base import SPECULATIVE
from ..strategies.queueing import DISCIPLINES
from ..strategies.scheduling import SCHEDULING
from ..strategies.steps import PREFILLS

__all__ = ["add_load_args", "add_model_args", "add_strategy_args", "limits_from", "load_options",
           "wants_generation"]

_LIMITS = Limits()
COMPILE = {"auto": "auto", "on": True, "off": False}  # --compile's words -> Limits.compile


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="minilm (embedded default), bert-base-random, synthetic:BASE+PER_ITEM, echo, "
                        "or a Hugging Face id / local folder; for gen-* strategies: smollm2 (their default: "
                        "the embedded SmolLM2-135M-Instruct), gpt2-random, gpt2-tiny-random (random weights), "
                        "synthetic-gen:PREFILL+STEP, or a folder of a GPT-2, Llama, "
                        "Qwen2, Qwen3 or Mistral causal LM (labserver tiny-model writes one)")
    p.add_argument("--task", default=None, help="pipeline task for a hub id or folder")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"], help="(default: auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="auto: float16 on GPU, float32 on CPU")


def add_strategy_args(p: argparse.ArgumentParser, with_strategy: bool = True) -> None:
    if with_strategy:
        p.add_argument("--strategy", default=DEFAULT_STRATEGY, choices=strategy_names(),
                       help="(default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=_LIMITS.max_batch_size,
                   help="items per model call; 0 = no cap (default: %(default)s)")
    p.add_argument("--max-wait-ms", type=float, default=_LIMITS.max_wait_ms, help="(default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=None,
                   help="queued items before new requests get 503 (default: unbounded)")
    p.add_argument("--timeout-ms", type=float, default=None,
                   help="per-request deadline; 504 after it (default: none)")
    p.add_argument("--no-idle-dispatch", action="store_true",
                   help="deadline/thread: wait for the deadline even when nothing else is queued")
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="encoders: a batch's padded tokens (longest x count) at most this; the rest waits for the "
                        "next (default: none; the tokens strategy: 2048)")
    p.add_argument("--target-ms", type=float, default=_LIMITS.target_ms,
                   help="slo: the latency target; a batch may spend half of it waiting (default: %(default)s)")
    p.add_argument("--max-kv-tokens", type=int, default=None,
                   help="gen-*: KV-cache tokens the running sequences may hold (default: max-batch, at most 64, x "
                        "the model's context, at most 2048)")
    p.add_argument("--kv-memory-mb", type=float, default=None,
                   help="gen-*: KV-cache memory in MiB; the pool holds what fits at the model's bytes per position "
                        "(layers x 2 x KV heads x head size x dtype); with --max-kv-tokens, the smaller")
    p.add_argument("--kv-block-tokens", type=int, default=_LIMITS.kv_block_tokens,
                   help="gen-*: tokens per KV block, the unit memory is taken in (default: %(default)s)")
    p.add_argument("--prefix-cache", action="store_true",
                   help="gen-*: prompts that begin alike share their KV blocks")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="gen-*, on a GPU: replay decode steps from CUDA graphs (one launch a step instead of one a "
                        "kernel; steps padded to buckets)")
    p.add_argument("--compile", nargs="?", const="on", default="auto", choices=list(COMPILE),
                   help="gen-*: compile the decode steps (one sequence's, and a batch's) with torch.compile at "
                        "startup: fewer ops a step, each fused. auto (the default): where they can compile "
                        "(labserver's own model on a CPU, a C++ compiler), eager if the compile fails; on "
                        "(--compile): a failure fails the load; off: eager. The first compile on a machine takes "
                        "~2 min on 2 cores, later starts read torch's cache (~20 s)")
    p.add_argument("--prefill", default=_LIMITS.prefill, choices=list(PREFILLS),
                   help="gen-continuous, gen-paged: prefill all that fit at every step, at most "
                        "--max-prefill-tokens, or in pieces inside each step (--max-step-tokens)")
    p.add_argument("--max-prefill-tokens", type=int, default=_LIMITS.max_prefill_tokens,
                   help="with --prefill budget (default: %(default)s)")
    p.add_argument("--max-step-tokens", type=int, default=_LIMITS.max_step_tokens,
                   help="with --prefill chunked: tokens per step, decodes first (default: %(default)s)")
    p.add_argument("--eos-prob", type=float, default=_LIMITS.eos_prob,
                   help="gen-*: a stand-in for a trained model's EOS: each token ends its answer with this "
                        "probability (random weights never choose EOS; default: %(default)s)")
    spec = p.add_argument_group("speculative decoding (gen-continuous, gen-paged; docs/generation.md)")
    spec.add_argument("--speculative", choices=list(SPECULATIVE), default=None,
                      help="guess tokens and verify them in one step: ngram (prompt lookup) or draft (--draft-model) "
                           "(default: off)")
    spec.add_argument("--num-speculative-tokens", type=int, default=_LIMITS.num_speculative_tokens,
                      help="tokens guessed per step, verified with the last one (default: %(default)s)")
    spec.add_argument("--prompt-lookup-min", type=int, default=_LIMITS.prompt_lookup_min,
                      help="ngram: the shortest suffix looked up in the context (default: %(default)s)")
    spec.add_argument("--prompt-lookup-max", type=int, default=_LIMITS.prompt_lookup_max,
                      help="ngram: the longest, tried first (default: %(default)s)")
    spec.add_argument("--speculative-disable-batch-size", type=int, default=None,
                      help="no guesses while more than this many requests run or wait (default: always guess)")
    spec.add_argument("--draft-model", default=None, metavar="SPEC",
                      help="draft: the model that guesses (NAME or NAME:DTYPE), with the target's tokenizer")
    p.add_argument("--handover-timeout-s", type=float, default=_LIMITS.handover_timeout_s,
                   help="with --disaggregate: a prefill replica frees KV no decode replica pulled within this "
                        "(default: %(default)s)")
    over = p.add_argument_group("under overload (docs/overload.md)")
    over.add_argument("--queue", default=_LIMITS.queue, choices=sorted(DISCIPLINES),
                      help="queue discipline within a priority class (default: %(default)s)")
    over.add_argument("--codel-target-ms", type=float, default=_LIMITS.codel_target_ms,
                      help="codel: while a queue stands, shed whoever waited longer (default: %(default)s)")
    over.add_argument("--codel-interval-ms", type=float, default=_LIMITS.codel_interval_ms,
                      help="a queue stands when not empty for this long (default: %(default)s)")
    over.add_argument("--admit", default=_LIMITS.admit, choices=["all", "deadline"],
                      help="deadline: refuse at once (503) what is expected past --timeout-ms (default: %(default)s)")
    over.add_argument("--scheduling", default=_LIMITS.scheduling, choices=sorted(SCHEDULING),
                      help="gen-*: who joins first: fcfs, priority (preempts a lower class), fair (per x-tenant), "
                           "slo (earliest TTFT deadline; TPOT caps the batch) (default: %(default)s)")
    over.add_argument("--ttft-target", type=class_targets, default=None, metavar="CLASS=MS,...",
                      help="--scheduling slo: TTFT target per priority class, e.g. 0=500,1=5000")
    over.add_argument("--tpot-target", type=class_targets, default=None, metavar="CLASS=MS,...",
                      help="--scheduling slo: TPOT target per priority class, e.g. 0=100")


def class_targets(text: str) -> dict[int, float]:
    """``"0=500,1=5000"`` -> {0: 500.0, 1: 5000.0}: a target in ms per priority class."""
    out = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected CLASS=MS pairs such as 0=500,1=5000, got {part!r}") from None
        if not sep or out[int(key)] <= 0:
            raise argparse.ArgumentTypeError(f"expected CLASS=MS with MS > 0, got {part!r}")
    return out


def limits_from(args: argparse.Namespace) -> Limits:
    return Limits(
        max_batch_size=args.max_batch or None,
        max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue,
        timeout_ms=args.timeout_ms,
        idle_dispatch=not args.no_idle_dispatch,
        target_ms=args.target_ms,
        max_batch_tokens=args.max_batch_tokens,
        max_kv_tokens=args.max_kv_tokens,
        kv_memory_mb=args.kv_memory_mb,
        kv_block_tokens=args.kv_block_tokens,
        prefix_cache=args.prefix_cache,
        cuda_graphs=args.cuda_graphs,
        compile=COMPILE[args.compile],
        prefill=args.prefill,
        max_prefill_tokens=args.max_prefill_tokens,
        max_step_tokens=args.max_step_tokens,
        eos_prob=args.eos_prob,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
        speculative_disable_batch_size=args.speculative_disable_batch_size,
        draft_model=args.draft_model,
        handover_timeout_s=args.handover_timeout_s,
        queue=args.queue,
        codel_target_ms=args.codel_target_ms,
        codel_interval_ms=args.codel_interval_ms,
        admit=args.admit,
        scheduling=args.scheduling,
        ttft_targets_ms=args.ttft_target,
        tpot_targets_ms=args.tpot_target,
    )


def add_load_args(p: argparse.ArgumentParser) -> None:
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="load this server (loopback only unless --allow-remote)")
    target.add_argument("--strategy", choices=strategy_names(), help="start this strategy here and load it")
    add_model_args(p)
    add_strategy_args(p, with_strategy=False)
    p.add_argument("--api", default="labserver", choices=["labserver", "openai-completions", "openai-chat",
                                                          "openai-embeddings"],
                   help="labserver's own routes (--mode), or the OpenAI API any LLM server speaks (vLLM, TGI, "
                        "SGLang, Ollama, llama.cpp, transformers serve, labserver's /v1); with --url, --model "
                        "names the model to send (default: the server's first in GET /v1/models)")
    p.add_argument("--arrival", default="poisson", choices=["poisson", "constant", "gamma"],
                   help="(default: %(default)s)")
    p.add_argument("--burstiness", type=float, default=0.5,
                   help="--arrival gamma: the gamma shape (1 = Poisson, < 1 burstier) (default: %(default)s)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="open loop: at most this many requests outstanding; later sends wait for one to end "
                        "(latency still counts from the schedule)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of sending (default: %(default)s)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds left out of the summary (default: %(default)s)")
    p.add_argument("--mode", default=None, choices=["text", "json", "generate"],
                   help="POST / text, /predict JSON, or /generate (default: text; json with --texts-per-request "
                        "above 1; generate for gen-* strategies)")
    p.add_argument("--texts-per-request", type=int, default=1, metavar="N",
                   help="--mode json: each request is {\"inputs\": [N texts]}, drawn from the payload in order "
                        "(default: %(default)s, {\"inputs\": text})")
    p.add_argument("--new-tokens", default="uniform:16:256",
                   help="generate: tokens each request asks for: N, uniform:LO:HI, geometric:MEAN[:LO:HI], "
                        "lognormal:MEDIAN:SIGMA[:LO:HI] or replay:FILE (default: %(default)s)")
    p.add_argument("--no-stream", action="store_true", help="generate: one JSON answer instead of a token stream")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="generate: let EOS end an answer early (default: ask for exactly --new-tokens)")
    payload = p.add_mutually_exclusive_group()  # what the requests carry: one source, or the default texts
    payload.add_argument("--prompt-tokens", default=None,
                         help="texts of this many tokens, for any mode or api (encoder texts as well as prompts): "
                              "N, uniform:LO:HI, geometric:MEAN[:LO:HI], lognormal:MEDIAN:SIGMA[:LO:HI] (e.g. "
                              "lognormal:20:1.1:1:254: most texts short, a tail up to MiniLM's 256 with its 2 "
                              "special tokens) or replay:FILE (words of the built-in list, one token each in the "
                              "bundled vocabulary)")
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="every prompt starts with the same prefix of this many tokens (then --prompt-tokens own)")
    payload.add_argument("--questions", default=None, choices=["chat", "grounded"],
                         help="real prompts for a real model (smollm2): chat, open questions; grounded, texts to "
                              "rewrite, correct or summarise, whose answers copy the prompt (where prompt-lookup "
                              "speculation pays)")
    p.add_argument("--tokenizer", default=None,
                   help="a local tokenizer folder: --prompt-tokens counted exactly by it")
    p.add_argument("--ttft-slo-ms", type=float, default=None, help="generate: goodput needs TTFT within this")
    p.add_argument("--tpot-slo-ms", type=float, default=None, help="generate: goodput needs TPOT within this")
    p.add_argument("--mix", default=None, metavar="SPEC",
                   help="several flows in one run, each request dealt to one by a seeded draw: flows separated "
                        "by ',', each NAME:SHARE (shares are normalised) then any of :priority=INT (sent as "
                        "x-priority, and \"priority\" in an OpenAI body; lower is served first), :tenant=NAME "
                        "(x-tenant), :slo=MS (latency target), :ttft=MS, :tpot=MS (generation targets) and "
                        ":tokens=LENGTHS (its own --new-tokens, colons allowed); each flow is then summarised "
                        "under its own targets (--slo-ms, --ttft-slo-ms, --tpot-slo-ms stand in where it sets "
                        "none). E.g. 'interactive:0.2:priority=0:ttft=500:tokens=32,batch:0.8:priority=1'")
    payload.add_argument("--payload-file",
                         help="send the lines of this file (default: seeded 8-24 word sentences)")
    p.add_argument("--processes", type=int, default=1, help="load generator processes (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ms", type=float, default=None, help="goodput: answers within this count")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --url (mind whose it is)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="send Authorization: Bearer KEY (default: the first of $LABSERVER_API_KEY, if set)")
    p.add_argument("--out", help="write the result: x.csv (records + x.csv.json with the summary), x.json "
                                 "(summary, meta, warnings), x.parquet, or a folder")


def wants_generation(args: argparse.Namespace) -> bool:
    """Whether the load asks for tokens (mode generate, or an OpenAI completions/chat API)."""
    from ..load.apis import is_generative

    return is_generative(args.api, args.mode)


def load_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``run_load`` options of ``add_load_args``'s flags (``--mode`` filled in when not given)."""
    from ..load.lengths import parse_lengths

    if args.mode is None:
        generate = (args.strategy or "").startswith("gen-")
        args.mode = "generate" if generate else "json" if args.texts_per_request > 1 else "text"
    opts: dict[str, Any] = dict(duration_s=args.duration, warmup_s=args.warmup, seed=args.seed,
                                mode=args.mode, api=args.api, processes=args.processes,
                                allow_remote=args.allow_remote, texts_per_request=args.texts_per_request)
    if args.api_key:  # else the load generator's own default: the first key of $LABSERVER_API_KEY
        opts["api_key"] = args.api_key
    if args.url and args.api != "labserver":
        opts["model"] = args.model  # the name to send (None: ask the server's /v1/models)
    if args.concurrency:
        opts["users"] = args.concurrency
    else:
        arrival = f"gamma:{args.burstiness}" if args.arrival == "gamma" else args.arrival
        opts.update(arrival=arrival, rate_per_s=args.rate)
        if args.max_concurrency:  # open loop, at most this many outstanding: later sends wait (and count as late)
            opts.update(max_in_flight=args.max_concurrency, overflow="wait")
    if args.questions and args.shared_prefix:  # the parser already refuses --questions with the other sources
        raise ValueError("--shared-prefix builds token prompts; leave it out with --questions")
    if args.payload_file:
        from ..load.payloads import FileLines

        opts["payload"] = FileLines(args.payload_file)
    elif args.questions:
        from ..load.prompts import GroundedTasks, Questions

        opts["payload"] = GroundedTasks() if args.questions == "grounded" else Questions()
    elif args.prompt_tokens or args.shared_prefix:
        from ..load.prompts import TokenPrompts

        opts["payload"] = TokenPrompts(parse_lengths(args.prompt_tokens or "32"), prefix_tokens=args.shared_prefix,
                                       tokenizer=args.tokenizer)
    else:
        from ..load.payloads import WordTexts

        opts["payload"] = WordTexts(min_words=8, max_words=24)
    if getattr(args, "mix", None):
        from ..load.mix import parse_mix

        opts["mix"] = parse_mix(args.mix)  # a bad spec fails here, before a server is started
    if wants_generation(args):
        opts.update(new_tokens=parse_lengths(args.new_tokens), stream=not args.no_stream, timeout_s=600.0,
                    ignore_eos=not args.no_ignore_eos)
    return opts
