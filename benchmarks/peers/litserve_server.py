"""Baseline: the embedded model behind LitServe's batching server (benchmark only).

Runs in the separate benchmarks/.peers environment (see benchmarks/README.md); it is
never a dependency of labserver. Same model code as labserver (labserver.models.MiniLM),
same JSON request {"inputs": text}, batch 64, 5 ms batch timeout.

    python litserve_server.py PORT
"""

from __future__ import annotations

import sys

import litserve as ls

from labserver.models import MiniLM


class Embedder(ls.LitAPI):
    def setup(self, device: str) -> None:
        self.model = MiniLM(device="cpu")

    def decode_request(self, request: dict) -> str:
        return request["inputs"]

    def predict(self, texts: list[str]) -> list[dict]:
        return self.model(texts)

    def encode_response(self, output: dict) -> dict:
        return {"output": {"embedding": output["embedding"].tolist(), "truncated": output["truncated"]}}


if __name__ == "__main__":
    port = int(sys.argv[1])
    api = Embedder(max_batch_size=64, batch_timeout=0.005)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1)
    server.run(host="127.0.0.1", port=port, generate_client_file=False)
