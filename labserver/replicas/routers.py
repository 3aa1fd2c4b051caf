"""Ray Serve request routers, one per routing policy, registered by name (``--router``).

Each is a ``ray.serve.request_router.RequestRouter`` whose ``choose_replicas`` asks a
policy from ``labserver.routing`` (the same object the simulation runs) and offers Ray
one replica. The loads it passes are Ray's own view: the queue lengths its router caches
between probes (``replica_queue_len_cache``), 0 for a replica not yet probed; stale by
design, as live loads are. ``pow2`` is Ray's own ``PowerOfTwoChoicesRequestRouter``,
unchanged (Ray Serve's default). Ray probes the replica offered and falls back to
another if it is full, so no policy can send a replica more than it accepts.

This module imports Ray: load it only where Ray is installed (``pip install 'labserver[ray]'``).
"""

from __future__ import annotations

import importlib
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from ..routing import Policy, Route, make_policy

__all__ = ["PINNED", "ROUTERS", "LeastLoadedRouter", "Pinned", "PolicyRouter", "PrefixAwareRouter", "PrefixHashRouter", "RandomRouter",
           "RoundRobinRouter", "router_class"]


class PolicyRouter(RequestRouter):
    """A labserver routing policy as a Ray request router (subclasses name the policy)."""

    policy_name = ""

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy: Policy = make_policy(self.policy_name, **kwargs)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if not hasattr(self, "policy"):  # (Ray calls initialize_state only when kwargs are configured)
            self.initialize_state()
        cache = self.replica_queue_len_cache
        ids = [r.replica_id.unique_id for r in candidate_replicas]
        loads = [cache.get(r.replica_id) or 0 for r in candidate_replicas]
        pick = self.policy.choose(route_of(pending_request), ids, loads)
        return [[candidate_replicas[pick]]]


def route_of(pending: PendingRequest | None) -> Route:
    """What the policy may read: the job the ingress sent (``remote.job_of``), if there is one."""
    job = pending.args[0] if pending is not None and pending.args else None
    if isinstance(job, dict):
        return Route(prompt=str(job.get("prompt", "")), session=job.get("session"),
                     salt=str(job.get("cache_salt", "")))
    return Route()


class RandomRouter(PolicyRouter):
    policy_name = "random"


class RoundRobinRouter(PolicyRouter):
    policy_name = "round-robin"


class LeastLoadedRouter(PolicyRouter):
    policy_name = "least-loaded"


class PrefixHashRouter(PolicyRouter):
    policy_name = "prefix-hash"


class PrefixAwareRouter(PolicyRouter):
    policy_name = "prefix-aware"


# name -> the import path Ray loads the router class from ("module:Class")
ROUTERS: dict[str, str] = {cls.policy_name: f"{__name__}:{cls.__name__}" for cls in
                           (RandomRouter, RoundRobinRouter, LeastLoadedRouter, PrefixHashRouter, PrefixAwareRouter)}
ROUTERS["pow2"] = "ray.serve._private.request_router.pow_2_router:PowerOfTwoChoicesRequestRouter"


class Pinned(RequestRouter):
    """A router for a prefill pool: a call that names its replica (``{"replica": id, ...}``: a decode replica's
    pull of the KV that replica holds) goes to that replica, whatever the policy; the rest as the policy says. A
    named replica that is gone is offered to nobody: the call waits, bounded by its caller's timeout."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ask = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if isinstance(ask, dict) and "ticket" in ask:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == ask["replica"]]]
        return await super().choose_replicas(candidate_replicas, pending_request)


def _pinned(path: str) -> str:
    """The import path of ``path``'s router with ``Pinned`` in front (made here once per router)."""
    module, _, name = path.partition(":")
    base = getattr(importlib.import_module(module), name)
    pinned = f"Pinned{name}"
    if pinned not in globals():
        globals()[pinned] = type(pinned, (Pinned, base), {"__module__": __name__})
    return f"{__name__}:{pinned}"


PINNED: dict[str, str] = {name: _pinned(path) for name, path in ROUTERS.items()}  # the same routers, pulls pinned


def router_class(name: str, pinned: bool = False) -> str:
    """The import path Ray loads for a router name (``pinned``: for a prefill pool); ValueError naming the known
    ones."""
    try:
        return (PINNED if pinned else ROUTERS)[name]
    except KeyError:
        raise ValueError(f"unknown router {name!r}: use one of {', '.join(sorted(ROUTERS))}") from None
