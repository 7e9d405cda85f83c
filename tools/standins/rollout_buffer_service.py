"""A stand-in for slime's rollout-buffer service (`slime_plugins/rollout_buffer/buffer.py`): small, real HTTP, the
protocol as slime's README and its client describe it, so the client (`actors/slime_compat/rollout_buffer.py`) is
tested against a server and a run can train on an external agent service without slime installed.

`python -m tools.standins.rollout_buffer_service --port 8889` serves:

- `POST /start_rollout` (the trainer's payload: `remote_engine_url`, `task_type`, `input_file`,
  `num_repeat_per_sample`, `sampling_params`, ...): answers at once and runs the generator in the background. It
  starts a fresh buffer, as slime's does. The one generator here (task type `math`, slime's default) asks the
  engine's `/v1/chat/completions` for each record's `prompt` (`num_repeat_per_sample` times, a few at a time), and
  rewards 1.0 when the record's `label` appears in the answer, else 0.0; it writes each trajectory as slime's
  generators do (`uid`, `instance_id` = the record's line, `messages`, `reward`, `extra_info` with `label`,
  `timestamp` and `finish_reason`). Another task type is answered 400 naming the one served.
- `POST /buffer/write`: one trajectory from a generator (a test writes its own here).
- `POST /get_rollout_data`: every group that has `num_repeat_per_sample` trajectories, taken out of the buffer, as
  `{"success": true, "data": {"data": [...], "meta_info": {...}}}`; `success: false` while none is complete.

For tests, `fail_reads` makes the next that many `/get_rollout_data` answer 500.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

TASK_TYPES = ("math",)


class RolloutBufferService:
    def __init__(self, *, concurrency: int = 4) -> None:
        self.concurrency = concurrency
        self.group_size = 1
        self.groups: dict[str, list[dict[str, Any]]] = {}
        self.starts: list[dict[str, Any]] = []  # every /start_rollout payload, in order
        self.generated = 0
        self.generator_errors: list[str] = []
        self.fail_reads = 0
        self._task: asyncio.Task[None] | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.add_routes([web.post("/start_rollout", self.start_rollout), web.post("/buffer/write", self.write),
                        web.post("/get_rollout_data", self.get_rollout_data)])
        app.on_shutdown.append(self._shutdown)
        return app

    async def start_rollout(self, request: web.Request) -> web.Response:
        payload = await request.json()
        if payload.get("task_type") not in TASK_TYPES:
            return web.json_response({"detail": f"no generator for task_type {payload.get('task_type')!r}; this "
                                      f"stand-in serves {', '.join(TASK_TYPES)}"}, status=400)
        self.starts.append(payload)
        self.group_size = int(payload["num_repeat_per_sample"])
        self.groups = {}
        if self._task is not None:
            self._task.cancel()
        self._task = asyncio.create_task(self._generate(payload))
        return web.json_response({"message": "Rollout started"})

    async def write(self, request: web.Request) -> web.Response:
        item = await request.json()
        if "instance_id" not in item:
            return web.json_response({"detail": "Write failed: 'instance_id'"}, status=500)
        self.groups.setdefault(str(item["instance_id"]), []).append(item)
        return web.json_response({"success": True, "message": "written", "data": {"data": [item]}})

    async def get_rollout_data(self, request: web.Request) -> web.Response:
        if self.fail_reads > 0:
            self.fail_reads -= 1
            return web.json_response({"detail": "stand-in read failure"}, status=500)
        ready = [key for key, items in self.groups.items() if len(items) >= self.group_size]
        data = [item for key in ready for item in self.groups.pop(key)]
        meta = {"total_samples": len(data), "num_groups": len(ready), "finished_groups": []}
        if not data:
            return web.json_response({"success": False, "message": "No data available to read",
                                      "data": {"data": [], "meta_info": meta}})
        return web.json_response({"success": True, "message": f"Successfully read {len(data)} items",
                                  "data": {"data": data, "meta_info": meta}})

    async def _generate(self, payload: dict[str, Any]) -> None:
        """slime's base generator, in short: every record, `num_repeat_per_sample` times, through the engine."""
        lines = Path(payload["input_file"]).read_text().splitlines()
        records = [(index, json.loads(line)) for index, line in enumerate(lines) if line.strip()]
        url = payload["remote_engine_url"].rstrip("/").removesuffix("/v1") + "/v1/chat/completions"
        params = payload.get("sampling_params") or {}
        gate = asyncio.Semaphore(self.concurrency)
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async def one(index: int, record: dict[str, Any]) -> None:
                async with gate:
                    try:
                        self._store(index, record, *await _ask(session, url, record["prompt"], params))
                    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError) as error:
                        self.generator_errors.append(f"record {index}: {type(error).__name__}: {error}")

            for _ in range(int(payload.get("num_epoch") or 1)):
                await asyncio.gather(*(one(index, record) for index, record in records
                                       for _ in range(self.group_size)))

    def _store(self, index: int, record: dict[str, Any], messages: list[dict[str, Any]], finish: str) -> None:
        label = str(record.get("label", ""))
        reward = 1.0 if label and label in (messages[-1]["content"] or "") else 0.0
        item = {"uid": str(uuid.uuid4()), "instance_id": record.get("instance_id", index), "messages": messages,
                "reward": reward, "extra_info": {"label": record.get("label"), "timestamp": str(time.time()),
                                                 "finish_reason": finish, "round_number": 1}}
        self.groups.setdefault(str(item["instance_id"]), []).append(item)
        self.generated += 1

    async def _shutdown(self, app: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()


async def _ask(session: aiohttp.ClientSession, url: str, prompt: Any, params: dict[str, Any]
               ) -> tuple[list[dict[str, Any]], str]:
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    body = {"model": "custom", "messages": messages, "stream": False, **params}
    async with session.post(url, json=body) as response:
        reply = await response.json()
        if response.status != 200:
            raise ValueError(f"{url} answered {response.status}: {reply}")
    choice = reply["choices"][0]
    return [*messages, {"role": "assistant", "content": choice["message"]["content"]}], choice["finish_reason"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8889)
    parser.add_argument("--concurrency", type=int, default=4, help="engine calls at once")
    args = parser.parse_args(argv)
    web.run_app(RolloutBufferService(concurrency=args.concurrency).app(), host=args.host, port=args.port,
                print=None)


if __name__ == "__main__":
    main()
