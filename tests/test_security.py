"""The doors before any route (``labserver.server.guard``), on a real server on a loopback socket:
an API key, and the host check a web page's DNS rebinding meets."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

import labserver
from labserver import wire
from labserver.config import ServerConfig
from labserver.experiments.runs import load_rates
from labserver.loadgen import run_load_sync
from labserver.models import SyntheticGen

KEYS = ("sk-first", "sk-second")


@pytest.fixture(scope="module")
def keyed() -> Iterator[labserver.ServerHandle]:
    with labserver.serve("gen-continuous", SyntheticGen(0, 0, max_context=64), api_keys=KEYS) as h:
        yield h


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_every_route_but_health_asks_for_a_key(keyed: labserver.ServerHandle) -> None:
    routes = [("POST", wire.GENERATE_PATH, {"prompt": "x", "max_new_tokens": 2}),
              ("POST", wire.V1_COMPLETIONS_PATH, {"prompt": "x", "max_tokens": 2}),
              ("GET", wire.V1_MODELS_PATH, None), ("GET", "/stats", None), ("GET", "/metrics", None)]
    for method, path, body in routes:
        for headers in ({}, bearer("sk-wrong"), {"authorization": "Basic c2stZmlyc3Q="}, bearer("sk-first-")):
            r = httpx.request(method, keyed.url + path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer" and "sk-" not in r.text
            if path.startswith("/v1/"):
                assert r.json()["error"]["code"] == "invalid_api_key"
            else:
                assert r.json()["error"]["type"] == "unauthorized"
        for key in KEYS:  # either key opens every route
            assert httpx.request(method, keyed.url + path, json=body, headers=bearer(key)).status_code == 200
    assert httpx.get(keyed.url + "/health").status_code == 200  # a probe needs no key
    assert keyed.stats()["statuses"]["401"] >= 20


def test_the_load_generator_and_the_cli_pass_the_key(keyed: labserver.ServerHandle,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    result = run_load_sync(keyed.url, api="openai-completions", users=2, max_requests=6, new_tokens=3,
                           api_key="sk-second", process=False, progress=False)
    assert (result.records["status"] == 200).all() and len(result.records) == 6
    refused = run_load_sync(keyed.url, mode="generate", users=1, max_requests=2, new_tokens=3, process=False,
                            progress=False)
    assert (refused.records["status"] == 401).all()
    runs = load_rates(keyed, [40], label="keyed", duration_s=0.5, mode="generate", new_tokens=2, process=False)
    assert len(runs.records) >= 5 and (runs.records["status"] == 200).all()  # the lab helpers send the handle's key
    assert httpx.get(keyed.url + "/stats", headers=keyed.headers).status_code == 200
    from labserver.replicas import ReplicasHandle  # (its stats() is one GET /stats: no Ray needed to check it)

    replicas = ReplicasHandle(keyed.url, keyed.config, 1, "pow2", started_ray=False, started_serve=False)
    assert replicas.stats()["statuses"]["200"] > 0 and replicas.headers == bearer(KEYS[0])
    replicas.stopped = True
    monkeypatch.setenv("LABSERVER_API_KEY", "sk-a, sk-b")
    assert ServerConfig().api_keys == ("sk-a", "sk-b")  # a server started without keys takes the environment's
    assert ServerConfig(api_keys=("sk-c",)).api_keys == ("sk-c",)
    assert "sk-c" not in repr(ServerConfig(api_keys=("sk-c",)))
    with labserver.serve("gen-continuous", SyntheticGen(0, 0, max_context=64)) as h:  # keyed by the environment
        assert h.api_key == "sk-a" and httpx.get(h.url + "/stats").status_code == 401
        assert httpx.get(h.url + "/stats", headers=h.headers).status_code == 200
        env_run = run_load_sync(h.url, mode="generate", users=1, max_requests=3, new_tokens=2, process=False,
                                progress=False)  # a client in the same environment sends its first key
        assert (env_run.records["status"] == 200).all()
    with pytest.raises(ValueError, match="printable ASCII"):
        ServerConfig(api_keys=("has space",))


def test_a_loopback_server_answers_only_requests_addressed_to_it() -> None:
    """DNS rebinding: a page on evil.example resolves its name to 127.0.0.1; its requests still say Host: evil."""
    with labserver.serve("gen-continuous", SyntheticGen(0, 0, max_context=64)) as h:
        port = h.url.rsplit(":", 1)[1]
        body = {"prompt": "x", "max_new_tokens": 2}
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
            assert httpx.post(h.url + wire.GENERATE_PATH, json=body, headers={"host": host}).status_code == 200, host
        for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}", "10.0.0.5"):
            r = httpx.post(h.url + wire.GENERATE_PATH, json=body, headers={"host": host})
            assert r.status_code == 403 and r.json()["error"]["type"] == "forbidden", host
            assert httpx.get(h.url + "/stats", headers={"host": host}).status_code == 403
        assert h.stats()["running"] == 0


BROWSER_SIMPLE = ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x", None)  # None: a blob body, sent with no type at all


def test_a_post_a_browser_may_send_cross_site_unasked_is_415() -> None:
    """A page may POST form data, plain text or an untyped blob anywhere without a preflight: JSON it may not."""
    with labserver.serve("gen-continuous", SyntheticGen(0, 0, max_context=64)) as h:
        docs = {wire.GENERATE_PATH: {"prompt": "x", "max_new_tokens": 2},
                wire.V1_COMPLETIONS_PATH: {"model": "synthetic", "prompt": "x", "max_tokens": 2},
                wire.V1_CHAT_PATH: {"model": "synthetic", "messages": [{"role": "user", "content": "x"}]},
                "/predict": {"inputs": ["x"]}}
        for path, doc in docs.items():
            body = json.dumps(doc).encode()
            for kind in BROWSER_SIMPLE:
                r = httpx.post(h.url + path, content=body, headers={"content-type": kind} if kind else {})
                assert r.status_code == 415, (path, kind, r.text)
                err = r.json()["error"]
                assert err["type"] == ("invalid_request_error" if path.startswith("/v1/") else "unsupported_media_type")
                assert "application/json" in err["message"]
            for kind in ("application/json", "application/json; charset=utf-8", "Application/JSON",
                         "application/vnd.labserver+json"):
                r = httpx.post(h.url + path, content=body, headers={"content-type": kind})
                assert r.status_code != 415, (path, kind)
        assert h.stats()["running"] == 0 and h.stats()["statuses"]["415"] == 4 * len(BROWSER_SIMPLE)
        assert httpx.get(h.url + wire.V1_MODELS_PATH).status_code == 200  # a GET has no body to type
        preflight = httpx.options(h.url + wire.V1_COMPLETIONS_PATH, headers={
            "origin": "http://evil.example", "access-control-request-method": "POST",
            "access-control-request-headers": "content-type"})
        assert not any(k.startswith("access-control-") for k in preflight.headers)  # never granted
