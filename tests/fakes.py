"""Small hand-written fakes shared by the tests."""

from __future__ import annotations

import ipaddress
import json
import threading
from typing import Any

from labserver.models import POISON, ModelError


class PlainModel:
    """An encoder model's side besides its call: every text is accepted, and it counts no tokens."""

    name = "plain"
    max_chars = None
    max_tokens = None

    def check(self, text: str) -> None:
        pass

    def count_tokens(self, texts: list[str]) -> list[int]:
        return [0] * len(texts)


class GateModel(PlainModel):
    """A model whose calls block until the test opens the gate: events, not sleeps.

    ``entered`` is set when a call starts; ``computed`` lists every text that reached
    the model, so a test can prove what was *not* computed.
    """

    name = "gate"

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.computed: list[str] = []
        self.calls: list[list[str]] = []

    def __call__(self, texts: list[str]) -> list[Any]:
        self.calls.append(list(texts))
        self.entered.set()
        if not self.gate.wait(30):
            raise RuntimeError("test never opened the gate")
        if any(POISON in t for t in texts):
            raise ModelError("poisoned input")
        self.computed.extend(texts)
        return [{"text": t} for t in texts]


class Crash(BaseException):
    """Not an Exception: kills whatever runs the model (as a hard fault would)."""


class CrashModel(PlainModel):
    name = "crash"

    def __call__(self, texts: list[str]) -> list[Any]:
        if any("__crash__" in t for t in texts):
            raise Crash("simulated worker crash")
        return [{"text": t} for t in texts]


def call_kind(chunks: Any) -> str:
    """How a test names a model call: "decode" when every chunk is one, else "prefill" (prompt tokens in it)."""
    return "decode" if all(c.decode for c in chunks) else "prefill"


class CallLog:
    """Any generator, with its prefill and decode calls logged as (kind, sequence ids), in the order they ran.

    What reached the model is the strongest evidence a test has (a sequence whose client
    left must not be in a later decode). The real models keep no such log: a list that grows
    with every step would be a leak in a long-running server.
    """

    def __init__(self, model: Any) -> None:
        self.inner = model
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def __getattr__(self, name: str) -> Any:  # everything else is the model's own
        return getattr(self.inner, name)

    def forward(self, chunks):  # type: ignore[no-untyped-def]
        self.calls.append((call_kind(chunks), tuple(c.sid for c in chunks)))
        return self.inner.forward(chunks)


class FailsMidStream:
    """A synthetic generator that fails every call computing a marked sequence past its first tokens.

    A prompt holding the word ``MARK`` is prefilled as any other; from its ``after``-th token
    on, any call that computes it raises ``ModelError``, however many sequences share the
    call (mid-stream: its first tokens were sent). Every other sequence is ``SyntheticGen``'s,
    whose tokens depend on its own context only: a batch-mate's are checked exactly.
    ``calls`` logs every call that reached the model, failed or not, as sequence ids.
    """

    MARK = "__fails_later__"

    def __init__(self, after: int = 3, **options: Any) -> None:
        from labserver.models import SyntheticGen

        self.inner = SyntheticGen(0, 0, **options)
        self.after = after
        self.marked: set[int] = set()
        self.calls: list[tuple[int, ...]] = []
        self._mark = self.inner.encode(self.MARK)[0]

    def __getattr__(self, name: str) -> Any:  # everything else is the synthetic model's
        return getattr(self.inner, name)

    def allocate_kv(self, blocks: int, block_tokens: int) -> None:
        self.marked.clear()  # a new engine: its sequence ids start again
        self.inner.allocate_kv(blocks, block_tokens)

    def forward(self, chunks):  # type: ignore[no-untyped-def]
        self.calls.append(tuple(c.sid for c in chunks))
        self.marked.update(c.sid for c in chunks if self._mark in c.tokens)
        if any(c.sid in self.marked and c.end >= c.prompt_len + self.after for c in chunks):
            raise ModelError("this sequence poisons every call it is in")
        return self.inner.forward(chunks)


class SteppedGen:
    """A synthetic generator whose decode steps wait for the test's permits: one permit, one step.

    ``entered`` counts steps begun (a semaphore the test can wait on); ``calls`` logs
    every prefill and decode with its sequence ids, as the real models do.
    """

    def __init__(self) -> None:
        from labserver.models import SyntheticGen

        self.inner = SyntheticGen(0, 0)
        self.permits = threading.Semaphore(0)
        self.entered = threading.Semaphore(0)
        self.name, self.note, self.eos_id, self.max_context = "stepped", None, 0, 4096
        self.eos_ids, self.kv_bytes_per_token, self.paged, self.scores = (0,), 0, True, False
        self.vocab_size = self.inner.vocab_size
        self.device, self.kv_portable = "cpu", True  # (its synthetic inner model's KV copies out and in)
        self.tokenizer = None
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def allow(self, steps: int = 1) -> None:
        for _ in range(steps):
            self.permits.release()

    def wait_entered(self, timeout_s: float = 10.0) -> None:
        if not self.entered.acquire(timeout=timeout_s):
            raise AssertionError("no decode step began")

    def encode(self, prompt: str) -> list[int]:
        return self.inner.encode(prompt)

    def token_text(self, token: int) -> str:
        return self.inner.token_text(token)

    def text(self, tokens: list[int]) -> str:
        return self.inner.text(tokens)

    def token_bytes(self, token: int) -> bytes:
        return self.inner.token_bytes(token)

    def allocate_kv(self, blocks: int, block_tokens: int) -> None:
        self.inner.allocate_kv(blocks, block_tokens)

    def forward(self, chunks):  # type: ignore[no-untyped-def]
        if call_kind(chunks) == "decode":  # a decode step waits for its permit
            self.entered.release()
            if not self.permits.acquire(timeout=30):
                raise RuntimeError("test never allowed the step")
        self.calls.append((call_kind(chunks), tuple(c.sid for c in chunks)))  # logged once allowed to run
        return self.inner.forward(chunks)

    def release(self, seq_ids):  # type: ignore[no-untyped-def]
        self.inner.release(seq_ids)

    def export_kv(self, table, positions):  # type: ignore[no-untyped-def]
        return self.inner.export_kv(table, positions)

    def import_kv(self, sid, table, start, end, kv):  # type: ignore[no-untyped-def]
        self.inner.import_kv(sid, table, start, end, kv)

    @property
    def cached(self) -> int:
        return self.inner.cached


def generate_alone_served(model: Any, prompt: str, n: int, sampling: Any) -> Any:
    """One sequence through a real step engine (``gen-continuous``) on its own loop: the finished ``Seq``."""
    import asyncio

    from labserver.engine import StepEngine
    from labserver.strategies import Limits, make_strategy

    async def run() -> Any:
        engine = StepEngine(make_strategy("gen-continuous", Limits()), model)
        engine.start()
        try:
            return await engine.submit(model.encode(prompt), n, ignore_eos=True, sampling=sampling).future
        finally:
            await engine.stop()

    return asyncio.run(run())


class ReplayStream:
    """What Ray hands the ingress for one replica call: the events, in order (``cancel`` is a no-op)."""

    def __init__(self, events: list[Any]) -> None:
        self.events = iter(events)

    def __aiter__(self) -> ReplayStream:
        return self

    async def __anext__(self) -> Any:
        import asyncio

        await asyncio.sleep(0)  # (as a real stream does, an event arrives after a turn of the loop)
        try:
            return next(self.events)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self) -> None:
        pass


class ReplayHandle:
    """A stand-in for the replicas' ``DeploymentHandle``: every ``generate`` call replays the same events."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events
        self.jobs: list[dict[str, Any]] = []

    def options(self, **_: Any) -> ReplayHandle:
        return self

    @property
    def generate(self) -> ReplayHandle:
        return self

    def remote(self, job: dict[str, Any]) -> ReplayStream:
        self.jobs.append(job)
        return ReplayStream(self.events)


def remote_answer(model: Any, handle: Any, prompt_ids: list[int], n: int, sampling: Any) -> Any:
    """One sequence through the ingress's ``RemoteEngine`` over ``handle``: the answered ``Seq``."""
    import asyncio

    from labserver.replicas.remote import RemoteEngine
    from labserver.strategies import Limits, make_strategy

    async def run() -> Any:
        ingress = RemoteEngine(make_strategy("gen-continuous", Limits()), model, handle, max_in_flight=4)
        ingress.start()
        try:
            return await ingress.submit(prompt_ids, n, ignore_eos=True, sampling=sampling).future
        finally:
            await ingress.stop()

    return asyncio.run(run())


def sse_events(text: str) -> list[tuple[str, Any]]:
    """A server-sent event stream's (event, data) pairs, data parsed (``[DONE]`` kept as it is)."""
    events, kind = [], "message"
    for line in text.splitlines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
            events.append((kind, data if data == "[DONE]" else json.loads(data)))
            kind = "message"
    return events


def listeners(pid: int) -> list[tuple[str, int, str, int]]:
    """(address, port, process name, pid) of every TCP socket listening in process ``pid`` and its descendants, read
    from the operating system: the tree from ``/proc/*/stat``, each process's sockets from ``/proc/PID/fd``, and the
    listening ones (state 0A) from ``/proc/net/tcp`` and ``/proc/net/tcp6``."""
    import os
    import socket

    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:  # (a process that ended while the table was read)
                continue
    tree, grew = {pid}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in tree} - tree
        tree, grew = tree | more, bool(more)
    listening: dict[str, tuple[str, int]] = {}  # socket inode -> (address, port)
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    address, port = fields[1].split(":")
                    listening[fields[9]] = (_proc_address(address, family), int(port, 16))
    found = []
    for p in sorted(tree):
        try:
            with open(f"/proc/{p}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{p}/cmdline") as f:  # (Ray retitles its workers: "ray::ServeReplica:...")
                title = f.read().split("\0")[0]
            fds = os.listdir(f"/proc/{p}/fd")
        except OSError:
            continue
        inodes = set()
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{p}/fd/{fd}")
            except OSError:  # (closed since: the listing's own descriptor, say)
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        found += [(*listening[i], title if title.startswith("ray::") else name, p) for i in inodes if i in listening]
    return found


def _proc_address(hexed: str, family: int) -> str:
    """An address as /proc/net/tcp{,6} writes it (little-endian 32-bit words in hex) in its usual text."""
    import socket
    import struct

    raw = bytes.fromhex(hexed)
    words = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, words)


def exposed(found: list[tuple[str, int, str, int]]) -> list[tuple[str, int, str, int]]:
    """The listeners not on loopback (none is allowed: Serve's inter-deployment gRPC servers are kept on loopback by
    ``labserver.replicas.loopback``)."""
    return [f for f in found if not is_loopback(f[0])]


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4 loopback address mapped into IPv6 (``::ffff:127.0.0.1``, as gRPC binds)."""
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback
