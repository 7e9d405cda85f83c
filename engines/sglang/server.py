"""An SGLang-compatible HTTP server over the embedded torch engine: `python -m engines.sglang.server`.

SGLang needs a GPU. This server speaks the subset of SGLang's HTTP API that Slipstream drives (generate with
log-probs, abort, pause/continue, flush, health, the weight-update group and the per-tensor broadcast
receive) over a `TorchEngine`, so the SGLang client, the launcher and the learner's sender run and are
tested for real on a CPU. It takes SGLang's core launch arguments (`--model-path --host --port --tp-size
--random-seed --max-running-requests --context-length --dtype`) and ignores any other `--flag [value]` with a
warning, so a command line written for `sglang.launch_server` starts it unchanged.

Weight updates are received the way SGLang receives them: the group is joined through the tcp:// rendezvous
with the group-name store prefix (`weight_group.py`), then each `/update_weights_from_distributed` call
allocates one tensor per name in the given dtype and shape and receives it by broadcast from rank 0, in
`names` order, before loading the bucket into the engine between two decode steps. The server holds one
rank: with `--tp-size N > 1` it serves generation but refuses to join a weight group (it cannot fill N ranks).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import sys
from typing import Any

import torch
import torch.distributed as dist
from aiohttp import web

from engines.inference.base import GenerateRequest, SamplingParams
from engines.inference.torch_engine import TorchEngine
from engines.sglang import protocol
from engines.sglang.weight_group import WeightGroup, join_weight_group

logger = logging.getLogger("engines.sglang.server")
COMPAT_VERSION = "slipstream-compat"
DTYPES = {
    "auto": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


class CompatServer:
    """The HTTP routes over one engine; state besides the engine is the weight version and the groups."""

    def __init__(self, engine: TorchEngine, args: argparse.Namespace) -> None:
        self.engine = engine
        self.args = args
        self.weight_version = args.weight_version
        self.groups: dict[str, WeightGroup] = {}
        self._rids = itertools.count()
        self._weights_lock = asyncio.Lock()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        get, post = web.get, web.post
        app.add_routes(
            [
                get("/health", self.health),
                get("/health_generate", self.health_generate),
                get("/get_model_info", self.model_info),
                get("/model_info", self.model_info),
                get("/get_server_info", self.server_info),
                get("/server_info", self.server_info),
                get("/get_weight_version", self.get_weight_version),
                post("/update_weight_version", self.update_weight_version),
                post("/generate", self.generate),
                post("/abort_request", self.abort_request),
                post("/pause_generation", self.pause_generation),
                post("/continue_generation", self.continue_generation),
                get("/flush_cache", self.flush_cache),
                post("/flush_cache", self.flush_cache),
                post("/init_weights_update_group", self.init_weights_update_group),
                post("/destroy_weights_update_group", self.destroy_weights_update_group),
                post("/update_weights_from_distributed", self.update_weights_from_distributed),
            ]
        )
        app.on_shutdown.append(self._shutdown)
        return app

    # ---- health and information

    async def health(self, request: web.Request) -> web.Response:
        healthy = bool((await self.engine.health())["healthy"])
        return web.Response(status=200 if healthy else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """One greedy token end to end, as SGLang does; while paused the engine cannot generate, so liveness."""
        status = await self.engine.health()
        if not status["healthy"]:
            return web.Response(status=503)
        if not status["paused"]:
            probe = GenerateRequest(f"health-{next(self._rids)}", [0], SamplingParams(temperature=0, max_new_tokens=1))
            await asyncio.wait_for(self.engine.generate(probe), timeout=20)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.args.model_path,
                "tokenizer_path": self.args.model_path,
                "is_generation": True,
                "weight_version": self.weight_version,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.args.model_path,
                "tp_size": self.args.tp_size,
                "random_seed": self.args.random_seed,
                "max_running_requests": self.args.max_running_requests,
                "version": COMPAT_VERSION,
                "weight_version": self.weight_version,
            }
        )

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _json(request)
        new_version = body.get("new_version")
        if not isinstance(new_version, str) or not new_version:
            return _failure("/update_weight_version: 'new_version' must be a non-empty string")
        if body.get("abort_all_requests"):
            await self.engine.abort(None)
        self.weight_version = new_version
        return web.json_response({"success": True, "message": f"weight version set to {new_version}"})

    # ---- generation control

    async def generate(self, request: web.Request) -> web.Response:
        try:
            items, batch = protocol.parse_generate_json(await _json(request), new_rid=self._new_rid)
            requests = [self._engine_request(item) for item in items]
        except ValueError as error:
            return _error(400, str(error))
        try:
            results = await asyncio.gather(*(self.engine.generate(r) for r in requests))
        except ValueError as error:
            return _error(400, str(error))
        tokenizer = self.engine.tokenizer
        body = []
        for item, outputs in zip(items, results, strict=True):
            for output in outputs:
                text = tokenizer.decode(output.output_ids) if tokenizer is not None else ""
                body.append(protocol.output_json(output, rid=item.rid, weight_version=self.weight_version, text=text))
        return web.json_response(body if batch or len(body) > 1 else body[0])

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json(request)
        if body.get("abort_all"):
            await self.engine.abort(None)
        elif isinstance(body.get("rid"), str) and body["rid"]:
            await self.engine.abort(body["rid"])
        else:
            return _error(400, "/abort_request: give a non-empty 'rid' or 'abort_all': true")
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        """SGLang's modes: "abort" returns in-flight requests; "in_place" and "retract" keep them for later."""
        mode = (await _json(request)).get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            return _error(400, f"/pause_generation: mode {mode!r} is not 'abort', 'retract' or 'in_place'")
        await self.engine.pause("abort" if mode == "abort" else "keep")
        return web.json_response({"success": True, "message": f"generation paused ({mode})"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self.engine.resume()
        return web.json_response({"success": True, "message": "generation continued"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        """The torch engine keeps no prefix cache across requests, so there is nothing to flush."""
        return web.Response(text="Cache flushed.\n")

    # ---- weights

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _json(request)
        try:
            address, port = str(body["master_address"]), int(body["master_port"])
            rank_offset, world_size = int(body["rank_offset"]), int(body["world_size"])
            name, backend = str(body.get("group_name", "weight_update_group")), str(body.get("backend", "nccl"))
        except (KeyError, TypeError, ValueError) as error:
            return _failure(f"/init_weights_update_group: bad or missing field ({error!r})")
        if self.args.tp_size > 1:
            return _failure(
                f"/init_weights_update_group: this server holds one rank, but --tp-size {self.args.tp_size} makes the "
                f"group expect ranks {rank_offset}..{rank_offset + self.args.tp_size - 1} from it; use --tp-size 1"
            )
        if backend == "nccl" and not torch.cuda.is_available():
            backend = "gloo"  # the CPU stand-in for a GPU server: same group, CPU transport
        if name in self.groups:
            return _failure(f"/init_weights_update_group: group {name!r} already exists")
        # Joining blocks until every member arrived; no lock is held meanwhile, so a join that never completes
        # (the learner gave up) does not hold back the next group's.
        try:
            group = await asyncio.to_thread(
                join_weight_group,
                backend=backend,
                master_address=address,
                master_port=port,
                rank=rank_offset,
                world_size=world_size,
                group_name=name,
                timeout_s=self.args.weight_group_timeout,
            )
        except Exception as error:  # a failed join must leave the server serving
            return _failure(f"Failed to initialize custom process group: {error}.")
        self.groups[name] = group
        logger.info("joined weight update group %s as rank %d of %d", name, rank_offset, world_size)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        name = str((await _json(request)).get("group_name", "weight_update_group"))
        async with self._weights_lock:
            group = self.groups.pop(name, None)
            if group is None:
                return _failure(f"/destroy_weights_update_group: no group {name!r}")
            group.destroy()
        return web.json_response({"success": True, "message": f"destroyed group {name}"})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await _json(request)
        try:
            names, dtypes, shapes = list(body["names"]), list(body["dtypes"]), list(body["shapes"])
            name = str(body.get("group_name", "weight_update_group"))
            if not len(names) == len(dtypes) == len(shapes):
                raise ValueError(f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes")
            specs = [
                (n, protocol.wire_dtype(d, where=f"tensor {n!r}"), tuple(int(x) for x in s))
                for n, d, s in zip(names, dtypes, shapes, strict=True)
            ]
        except (KeyError, TypeError, ValueError) as error:
            return _failure(f"/update_weights_from_distributed: bad request ({error})")
        if body.get("load_format") not in (None, "auto"):
            return _failure(
                f"/update_weights_from_distributed: load_format {body['load_format']!r} is not supported; "
                "send one broadcast per tensor (load_format omitted)"
            )
        async with self._weights_lock:
            group = self.groups.get(name)
            if group is None:
                return _failure(f"Group {name} not in {sorted(self.groups)}. Call /init_weights_update_group first.")
            if body.get("abort_all_requests"):
                await self.engine.abort(None)
            try:
                tensors = await asyncio.to_thread(_receive, group, specs)
            except Exception as error:  # the group is broken now; the sender forms a new one
                self.groups.pop(name, None)
                return _failure(f"Failed to update parameter online: {error}.")
            version = body.get("weight_version")
            number = protocol.parse_weight_version(version)
            try:
                await self.engine.update_weights(tensors, self.engine.version if number is None else number)
            except ValueError as error:
                return _failure(f"Failed to update parameter online: {error}.")
            if isinstance(version, str):
                self.weight_version = version
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    # ---- helpers

    def _new_rid(self) -> str:
        return f"compat-{next(self._rids)}"

    def _engine_request(self, item: protocol.GenerateItem) -> GenerateRequest:
        ids = item.input_ids
        if ids is None:
            tokenizer = self.engine.tokenizer
            if tokenizer is None:
                raise protocol.ProtocolError("/generate: 'text' needs a tokenizer; send input_ids")
            ids = list(tokenizer(item.text)["input_ids"])
        return GenerateRequest(item.rid, ids, item.params)

    async def _shutdown(self, app: web.Application) -> None:
        for group in self.groups.values():
            group.destroy()
        await self.engine.close()


def _receive(group: WeightGroup, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[tuple[str, Any]]:
    """One broadcast per tensor from rank 0, posted in `names` order, each in its own dtype (SGLang's layout)."""
    received, pending = [], []
    for name, dtype, shape in specs:
        tensor = torch.empty(shape, dtype=dtype)
        pending.append(dist.broadcast(tensor, src=0, group=group.group, async_op=True))
        received.append((name, tensor))
    for work in pending:
        work.wait()
    return received


async def _json(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError as error:
        raise web.HTTPBadRequest(text=f"{request.path}: body is not JSON ({error})") from error
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text=f"{request.path}: body must be a JSON object")
    return body


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _failure(message: str) -> web.Response:
    """SGLang's shape for a failed control call: success false and the reason, with HTTP 400."""
    logger.warning(message)
    return web.json_response({"success": False, "message": message}, status=400)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engines.sglang.server", description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True, help="local Hugging Face model folder")
    parser.add_argument("--tokenizer-path", default=None, help="accepted for SGLang compatibility; unused")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    parser.add_argument("--random-seed", type=int, default=None)
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="auto")
    parser.add_argument("--weight-version", default=protocol.INITIAL_WEIGHT_VERSION)
    parser.add_argument(
        "--weight-group-timeout", type=float, default=120.0, help="seconds a weight update group waits for all members"
    )
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--log-level", default="info")
    args, unknown = parser.parse_known_args(argv)
    args.ignored = unknown
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.ignored:
        logger.warning("ignoring SGLang arguments this server does not implement: %s", " ".join(args.ignored))
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    engine = TorchEngine.from_pretrained(
        args.model_path,
        dtype=DTYPES[args.dtype],
        max_batch_size=args.max_running_requests,
        max_model_len=args.context_length,
        seed=args.random_seed,
        version=protocol.parse_weight_version(args.weight_version) or 0,
    )
    server = CompatServer(engine, args)
    logger.info("serving %s on http://%s:%d", args.model_path, args.host, args.port)
    # handle_signals: SIGTERM and SIGINT shut the app down, which closes the engine and the groups.
    web.run_app(server.app(), host=args.host, port=args.port, print=None, handle_signals=True, shutdown_timeout=1.0)


if __name__ == "__main__":
    main()
