"""Whose prefix cache a request reaches: ``cache_salt`` and ``--cache-isolation``, on a real loopback server.

A prompt one tenant sent must not show in another's ``usage.prompt_tokens_details.cached_tokens``
when the server isolates tenants; by default (no isolation, vLLM's) every request shares one cache.
Each test sends prompts no other test sends, so the cache the module's servers keep between tests
cannot make a hit appear or vanish.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import labserver
from labserver import wire
from labserver.config import ServerConfig
from labserver.models import load_model

from .test_server_openai import assert_openai_error

_fresh = itertools.count()


@pytest.fixture(scope="module")
def tiny() -> Any:
    return load_model("gpt2-tiny-random", device="cpu")


@pytest.fixture(scope="module", params=["none", "tenant"])
def server(request: pytest.FixtureRequest, tiny: Any) -> Iterator[labserver.ServerHandle]:
    with labserver.serve("gen-continuous", tiny, prefix_cache=True, kv_block_tokens=4,
                         cache_isolation=request.param) as h:
        yield h


def prompt() -> str:
    """A prompt of several whole blocks that nothing else sends."""
    k = next(_fresh)
    return f"document {k}: " + " ".join(f"clause{k}x{i}" for i in range(12))


def cached(server: labserver.ServerHandle, text: str, tenant: str | None = None, chat: bool = False,
           **fields: Any) -> int:
    """``cached_tokens`` of one request of ``text`` sent as ``tenant`` (no x-tenant header when None)."""
    headers = {} if tenant is None else {wire.HEADER_TENANT: tenant}
    body = ({"messages": [{"role": "user", "content": text}], "max_completion_tokens": 2} if chat
            else {"prompt": text, "max_tokens": 2})
    path = wire.V1_CHAT_PATH if chat else wire.V1_COMPLETIONS_PATH
    r = httpx.post(server.url + path, json={**body, **fields}, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def isolated(server: labserver.ServerHandle) -> bool:
    return server.config.cache_isolation == "tenant"


@pytest.mark.parametrize("chat", [False, True])
def test_a_tenant_sees_another_tenants_prompt_only_without_isolation(server: labserver.ServerHandle,
                                                                     chat: bool) -> None:
    text = prompt()
    assert cached(server, text, "tenant-a", chat) == 0
    other = cached(server, text, "tenant-b", chat)
    assert (other == 0) if isolated(server) else (other > 0)
    assert cached(server, text, "tenant-a", chat) > 0  # its own hits, always
    assert cached(server, text, "tenant-b", chat) > 0


def test_requests_without_a_tenant_share_the_unnamed_tenants_cache(server: labserver.ServerHandle) -> None:
    text = prompt()
    assert cached(server, text) == 0
    assert cached(server, text) > 0 and cached(server, text, "") > 0  # an empty x-tenant is no tenant
    named = cached(server, text, "tenant-a")
    assert (named == 0) if isolated(server) else (named > 0)


def test_only_the_same_cache_salt_shares(server: labserver.ServerHandle) -> None:
    text = prompt()
    assert cached(server, text, "tenant-a", cache_salt="s1") == 0
    assert cached(server, text, "tenant-a") == 0  # no salt: not the salted blocks
    assert cached(server, text, "tenant-a", cache_salt="s2") == 0
    assert cached(server, text, "tenant-a", cache_salt="s1") > 0
    theirs = cached(server, text, "tenant-b", cache_salt="s1")  # the same salt, another tenant
    assert (theirs == 0) if isolated(server) else (theirs > 0)


def test_generate_is_isolated_by_tenant_too(server: labserver.ServerHandle) -> None:
    text = prompt()

    def hits(tenant: str) -> int:
        r = httpx.post(server.url + wire.GENERATE_PATH, json={"prompt": text, "max_new_tokens": 2},
                       headers={wire.HEADER_TENANT: tenant}, timeout=30)
        assert r.status_code == 200, r.text
        return int(r.json()["timing"]["cached_tokens"])

    assert hits("tenant-a") == 0
    assert (hits("tenant-b") == 0) if isolated(server) else (hits("tenant-b") > 0)
    assert hits("tenant-a") > 0


@pytest.mark.parametrize("path", [wire.V1_COMPLETIONS_PATH, wire.V1_CHAT_PATH])
@pytest.mark.parametrize("salt", ["", 7, True, ["s"], {"s": 1}, "x" * 257])
def test_a_bad_cache_salt_is_a_400_naming_it(server: labserver.ServerHandle, path: str, salt: Any) -> None:
    body = ({"messages": [{"role": "user", "content": "hi"}]} if path == wire.V1_CHAT_PATH else {"prompt": "hi"})
    r = httpx.post(server.url + path, json={**body, "max_tokens": 2, "cache_salt": salt}, timeout=30)
    error = assert_openai_error(r, 400, "bad_request", "cache_salt")
    assert "cache_salt" in error["message"]
    ok = httpx.post(server.url + path, json={**body, "max_tokens": 2, "cache_salt": "x" * 256}, timeout=30)
    assert ok.status_code == 200 and "cache_salt" not in ok.headers.get(wire.HEADER_IGNORED_FIELDS, "")


def test_the_salt_of_a_tenant_cannot_be_sent_as_a_cache_salt() -> None:
    """Under tenant isolation every salt holds its tenant: no cache_salt another tenant (or none) sends is equal."""
    from labserver.server.handling import cache_salt

    salts = {cache_salt("tenant", t, s) for t in ("", "a", "b", "a:", ":") for s in (None, "a", "b", "", ":a")}
    assert len(salts) == 5 * 5 and "" in salts  # the unnamed tenant without a salt: no salt at all
    assert cache_salt("none", "a", "s") == "s" and cache_salt("none", "a") == ""
    with pytest.raises(ValueError, match="cache_isolation"):
        ServerConfig(cache_isolation="user")


def test_the_serve_command_takes_the_isolation(monkeypatch: pytest.MonkeyPatch) -> None:
    from labserver import cli, launch

    started: list[ServerConfig] = []
    monkeypatch.setattr(launch, "run_forever", started.append)
    args = ["serve", "--strategy", "gen-continuous", "--model", "synthetic-gen:1+0", "--prefix-cache"]
    assert cli.main([*args, "--cache-isolation", "tenant"]) == 0 and cli.main(args) == 0
    assert [c.cache_isolation for c in started] == ["tenant", "none"] and started[0].limits.prefix_cache
    with pytest.raises(SystemExit):
        cli.main([*args, "--cache-isolation", "user"])
