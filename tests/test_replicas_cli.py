"""``labserver serve --replicas N`` from the shell: deploys on loopback, asks for its key, and SIGTERM drains as one
server does, then stops the Ray it started.

(Its own file: it starts its own Ray in a child process, after tests/test_replicas.py has stopped its own.)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import psutil
import pytest

pytest.importorskip("ray")

from labserver import wire  # noqa: E402

from .fakes import exposed, listeners, sse_events  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")  # Ray's own

KEY = {"authorization": "Bearer sk-shell"}


def serve_cli(*flags: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("LABSERVER_API_KEY", None)
    return subprocess.Popen([sys.executable, "-m", "labserver.cli", "serve", "--strategy", "gen-continuous",
                             "--replicas", "2", "--router", "random", "--max-batch", "4", "--port", "0", *flags],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)


def test_serve_replicas_from_the_shell_drains_on_sigterm() -> None:
    # 30 ms a token: 200 tokens outlast the drain's 2 s grace (--drain-grace; 10 s by default, which they would
    # not), so the stream is cut by the drain, not finished
    proc = serve_cli("--model", "synthetic-gen:5+30", "--api-key", "sk-shell", "--drain-grace", "2")
    stream: dict[str, Any] = {}
    first_token = threading.Event()

    def long_stream(url: str) -> None:
        with httpx.stream("POST", url + "/generate", headers=KEY, timeout=120,
                          json={"prompt": "a long one", "max_new_tokens": 200, "stream": True}) as r:
            body = ""
            for chunk in r.iter_text():
                body += chunk
                first_token.set()
            stream["events"] = sse_events(body)

    try:
        assert proc.stderr is not None
        url, seen = None, []
        deadline = time.monotonic() + 240
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()  # blocks until the child says something (or ends)
            if not line:
                break
            seen.append(line)
            m = re.search(r"x2 replicas \(router random\) on (http://\S+)", line)
            url = m.group(1) if m else None
        assert url, "".join(seen[-20:])
        assert "no API key" not in "".join(seen)  # loopback, and a key: nothing to warn of
        found = listeners(proc.pid)
        assert int(url.rsplit(":", 1)[1]) in {f[1] for f in found}
        assert exposed(found) == [], found  # Ray's and Serve's ports on loopback, as labserver's own

        assert httpx.post(url + "/generate", json={"prompt": "x", "max_new_tokens": 1}, timeout=60).status_code == 401
        r = httpx.post(url + "/generate", headers=KEY, json={"prompt": "from the shell", "max_new_tokens": 3},
                       timeout=60)
        assert r.status_code == 200 and r.json()["generated_tokens"] == 3
        assert r.headers[wire.HEADER_REPLICA]

        reader = threading.Thread(target=long_stream, args=(url,))
        reader.start()
        assert first_token.wait(60)
        ray_tree = psutil.Process(proc.pid).children(recursive=True)  # Ray's processes, all started here
        proc.send_signal(signal.SIGTERM)
        refused, deadline = None, time.monotonic() + 30
        while refused is None and time.monotonic() < deadline:  # the drain starts: new requests are refused
            r = httpx.post(url + "/generate", headers=KEY, json={"prompt": "late", "max_new_tokens": 1}, timeout=30)
            refused = r if r.status_code == 503 else None
        assert refused is not None and refused.json()["error"]["type"] == "shutting_down", refused
        assert refused.headers["retry-after"]
        reader.join(60)
        kinds = [k for k, _ in stream["events"]]
        assert kinds[-1] == "error" and 0 < kinds.count("token") < 200, kinds[-3:]  # cut short by the drain
        assert stream["events"][-1][1]["error"]["type"] == "shutting_down"

        code = proc.wait(timeout=120)
        assert code == 0, proc.stderr.read()[-3000:]
        with pytest.raises(httpx.HTTPError):  # the app and the Ray it started are gone
            httpx.get(url + "/health", timeout=5)
        _, alive = psutil.wait_procs(ray_tree, timeout=30)
        assert alive == [], alive  # Ray stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def test_the_shell_warns_of_an_exposed_replicas_server_without_a_key() -> None:
    proc = serve_cli("--model", "synthetic-gen:5+5", "--host", "0.0.0.0", "--router", "no-such-router")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "unknown router" in err  # refused before Ray starts, after the warning
    assert "binding 0.0.0.0 with no API key" in err
