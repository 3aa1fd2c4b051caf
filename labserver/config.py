"""Server configuration: one dataclass shared by ``labserver.serve`` and ``labserver serve``.

Kept apart from runtime state (as uvicorn keeps ``Config`` apart from ``Server``),
so the Python call and the command line have the same defaults by construction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields

from .models import DEFAULT_MODELS
from .strategies import STRATEGIES, Limits
from .wire import API_KEY_ENV, env_api_keys

logger = logging.getLogger(__name__)

DEFAULT_STRATEGY = "thread"
DEFAULT_MODEL = DEFAULT_MODELS["encode"]
CACHE_ISOLATION = ("none", "tenant")  # whose prefix-cache blocks a request may share: anyone's, or its tenant's


def default_model(strategy: str) -> str:
    """The model a strategy gets when none is named: the default of its kind (the embedded encoder or generator)."""
    cls = STRATEGIES.get(strategy)
    return DEFAULT_MODELS[cls.kind if cls is not None else "encode"]



@dataclass
class ServerConfig:
    strategy: str = DEFAULT_STRATEGY
    model: str = DEFAULT_MODEL  # a model spec, see labserver.models
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 (auto: float16 on GPU, float32 on CPU)
    task: str | None = None  # transformers pipeline task, for hub ids and folders
    limits: Limits = field(default_factory=Limits)
    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port
    max_body_bytes: int = 1 << 20  # request body limit, bytes (413 above)
    max_inputs: int = 256  # texts per /predict request (400 above)
    max_prompts: int = 16  # /v1 generation: prompts x n sequences per request (400 above; TGI's max-client-batch-size)
    max_chars: int = 100_000  # characters per text (400 above); the model truncates tokens itself
    max_new_tokens: int = 512  # /generate: the most tokens one request may ask for (400 above)
    debug: bool = False  # tracebacks in error responses: never on a shared server
    read_timeout_s: float = 30.0  # a request's headers and body must arrive within this (server.connections)
    max_connections: int = 4096  # open connections; one more gets a 503 and is closed (server.connections)
    drain_grace_s: float = 10.0  # on shutdown, time to finish queued work before answering 503
    lag_interval_ms: float = 10.0  # event-loop lag probe period, ms
    freeze_gc: bool = True  # gc.freeze() once loaded: no full-collection pauses walking the model (process-wide)
    log_level: str = "warning"
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # any of them as "Authorization: Bearer KEY"; () and
    #   no LABSERVER_API_KEY: no key asked (server.guard)
    cache_isolation: str = "none"  # "tenant": the prefix cache is salted by x-tenant (server.handling.cache_salt)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_inputs", "max_prompts", "max_chars", "max_new_tokens", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0, got {self.read_timeout_s}")
        if self.cache_isolation not in CACHE_ISOLATION:
            raise ValueError(f"cache_isolation must be one of {', '.join(CACHE_ISOLATION)}, "
                             f"got {self.cache_isolation!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if isinstance(self.api_keys, str):
            self.api_keys = (self.api_keys,)
        if not self.api_keys:
            self.api_keys = env_api_keys()
        if any(not k or not k.isascii() or not k.isprintable() or " " in k for k in self.api_keys):
            raise ValueError("an API key must be printable ASCII without spaces")

    @property
    def client_headers(self) -> dict[str, str]:
        """What a client in this process sends: ``Authorization: Bearer`` with the first key, if any."""
        return {"authorization": f"Bearer {self.api_keys[0]}"} if self.api_keys else {}

    @classmethod
    def build(cls, **kwargs: object) -> ServerConfig:
        """Accept Limits fields (max_batch_size, max_wait_ms, ...) flat, beside the rest."""
        limit_names = {f.name for f in fields(Limits)}
        own_names = {f.name for f in fields(cls)}
        limits = {k: kwargs.pop(k) for k in list(kwargs) if k in limit_names}
        unknown = set(kwargs) - own_names
        if unknown:
            known = sorted((own_names - {"limits"}) | limit_names)
            raise TypeError(f"unknown option(s) {sorted(unknown)}; known: {', '.join(known)}")
        if limits:
            kwargs["limits"] = Limits(**limits)  # type: ignore[arg-type]
        return cls(**kwargs)  # type: ignore[arg-type]

    def warn_if_exposed(self) -> None:
        if self.host not in ("127.0.0.1", "localhost", "::1") and not self.api_keys:
            logger.warning(
                "binding %s with no API key: anyone who can reach this address can use (and load) it; "
                "start it with --api-key KEY (or %s) to ask for one (docs/security.md)", self.host, API_KEY_ENV,
            )
