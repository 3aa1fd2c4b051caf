"""Baseline: the embedded model behind Ray Serve's @serve.batch (benchmark only).

Runs in the separate benchmarks/.peers environment; never a dependency of labserver.
Same model code as labserver (labserver.models.MiniLM), same JSON request, one
replica, batch 64, 5 ms wait. Blocks until killed.

    python ray_server.py PORT
"""

from __future__ import annotations

import sys
import time

import ray
from ray import serve
from starlette.requests import Request

from labserver.models import MiniLM


@serve.deployment(max_ongoing_requests=256)
class Embedder:
    def __init__(self) -> None:
        self.model = MiniLM(device="cpu")

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.005)
    async def embed(self, texts: list[str]) -> list[dict]:
        return [{"embedding": o["embedding"].tolist(), "truncated": o["truncated"]} for o in self.model(texts)]

    async def __call__(self, request: Request) -> dict:
        body = await request.json()
        return {"output": await self.embed(body["inputs"])}


if __name__ == "__main__":
    port = int(sys.argv[1])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(Embedder.bind(), route_prefix="/predict")
    print("ready", flush=True)
    while True:
        time.sleep(3600)
