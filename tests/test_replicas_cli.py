"""``labserver serve --replicas N`` from the shell: deploys, answers, and SIGTERM stops the Ray it started.

(Its own file: it starts its own Ray in a child process, after tests/test_replicas.py has stopped its own.)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("ray")

from labserver import wire  # noqa: E402


def test_serve_replicas_from_the_shell_until_sigterm() -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "labserver.cli", "serve", "--strategy", "gen-continuous",
                             "--model", "synthetic-gen:5+5", "--replicas", "2", "--router", "random",
                             "--max-batch", "4", "--port", "0"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
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
        r = httpx.post(url + "/generate", json={"prompt": "from the shell", "max_new_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["generated_tokens"] == 3
        assert r.headers[wire.HEADER_REPLICA]
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        assert code == 0, proc.stderr.read()[-3000:]
        with pytest.raises(httpx.HTTPError):  # the app and the Ray it started are gone
            httpx.get(url + "/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
