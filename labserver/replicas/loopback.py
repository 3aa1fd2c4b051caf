"""Serve's one listener without a setting, kept on loopback: each replica's inter-deployment gRPC server.

Ray Serve 2.60 binds every replica's inter-deployment gRPC server (the ingress's and each
replica's) to ``[::]:0`` (``ray/serve/_private/replica.py``, ``_on_initialized``), every
interface, whatever the node's address; callers reach it at the node's address and its port.
A local Ray started for a loopback host has its node on ``127.0.0.1`` (``local_ray``), so the
server is reachable where it is used when bound there. ``keep_serve_grpc_on_loopback`` runs in a
replica's process, in its constructor (before Serve starts that server), and, when the node's
address is loopback, makes the bind address ``127.0.0.1:0``; on a node with a routable address
(a cluster joined with ``--ray-address``, or ``--host 0.0.0.0``) nothing changes, and every other
address Serve binds is left as it is.

Imports Ray: only replica processes (``labserver.replicas.deploy``) call it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["keep_serve_grpc_on_loopback"]

EVERY_INTERFACE = "[::]:0"
LOOPBACK = "127.0.0.1:0"


def keep_serve_grpc_on_loopback() -> None:
    """In this process, on a loopback node, Serve's inter-deployment gRPC server binds ``127.0.0.1`` (idempotent)."""
    import ray
    from ray.serve._private import replica as serve_replica

    from ..server.guard import is_loopback

    if not is_loopback(ray.util.get_node_ip_address()):
        return

    bind = serve_replica.add_port_to_grpc_server
    if getattr(bind, "on_loopback", False):
        return

    def add_port(server: Any, address: str) -> int:
        return int(bind(server, LOOPBACK if address == EVERY_INTERFACE else address))

    add_port.on_loopback = True  # type: ignore[attr-defined]
    serve_replica.add_port_to_grpc_server = add_port
