"""A stand-in for sglang-router's worker registry (the 0.3 releases' documented `/workers` API): small, real HTTP,
so the run's discovery of the servers behind a router (`engines/sglang/router_workers.py`) is tested against a
server, and a slime user's setup (servers registered with a router, the run given the router's address) runs on a
CPU without the Rust router installed.

`python -m tools.standins.sglang_router --port 30000 --worker-urls http://127.0.0.1:30001 ...` serves:

- `GET /workers`: `{"workers": [{"id", "url", "model_id", "priority", "cost", "worker_type", "is_healthy", "load",
  "connection_mode"}], "total", "stats": {"prefill_count", "decode_count", "regular_count"}}`, as sglang-router's
  README shows it.
- `POST /workers` (`{"url", "worker_type"?}`, as slime's engines register): 202, the worker listed at once (the
  real router validates it in a background job first).
- `DELETE /workers/{id}`: 202, the worker gone.

It routes nothing: generation goes from the rollout workers to the servers themselves, never through a router.
For tests, `workers` can be edited directly (a worker's `is_healthy`, `worker_type` or `connection_mode`).
"""

from __future__ import annotations

import argparse
import uuid
from typing import Any

from aiohttp import web


class RouterStandIn:
    def __init__(self, worker_urls: list[str] | None = None) -> None:
        self.workers: list[dict[str, Any]] = []
        self.asked = 0  # GET /workers answered
        for url in worker_urls or []:
            self.register(url)

    def register(self, url: str, worker_type: str = "regular") -> dict[str, Any]:
        worker = {"id": str(uuid.uuid4()), "url": url, "model_id": "default", "priority": 50, "cost": 1.0,
                  "worker_type": worker_type, "is_healthy": True, "load": 0, "connection_mode": "Http"}
        self.workers.append(worker)
        return worker

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.get("/workers", self.list_workers), web.post("/workers", self.add_worker),
                        web.delete("/workers/{worker_id}", self.remove_worker)])
        return app

    async def list_workers(self, request: web.Request) -> web.Response:
        self.asked += 1
        kinds = [worker["worker_type"] for worker in self.workers]
        return web.json_response({"workers": self.workers, "total": len(self.workers), "stats": {
            "prefill_count": kinds.count("prefill"), "decode_count": kinds.count("decode"),
            "regular_count": kinds.count("regular")}})

    async def add_worker(self, request: web.Request) -> web.Response:
        payload = await request.json()
        if not isinstance(payload, dict) or not isinstance(payload.get("url"), str):
            return web.json_response({"error": "the body needs a url"}, status=400)
        worker = self.register(payload["url"], payload.get("worker_type", "regular"))
        return web.json_response({"status": "accepted", "worker_id": worker["id"], "url": worker["url"],
                                  "location": f"/workers/{worker['id']}"}, status=202)

    async def remove_worker(self, request: web.Request) -> web.Response:
        worker_id = request.match_info["worker_id"]
        kept = [worker for worker in self.workers if worker["id"] != worker_id]
        if len(kept) == len(self.workers):
            return web.json_response({"error": f"no worker {worker_id}"}, status=404)
        self.workers = kept
        return web.json_response({"status": "accepted", "worker_id": worker_id}, status=202)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--worker-urls", nargs="*", default=[], help="servers registered from the start")
    args = parser.parse_args(argv)
    web.run_app(RouterStandIn(args.worker_urls).app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
