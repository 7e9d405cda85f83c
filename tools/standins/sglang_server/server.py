"""An SGLang-compatible HTTP server over the embedded torch engine: `python -m tools.standins.sglang_server`.

SGLang needs a GPU. This server speaks the subset of SGLang's HTTP API that Slipstream drives (the rows of
`protocol.ENDPOINTS`: generate with log-probs, abort, pause/continue, flush, health, model and server info, the
weight-update group, the weight-update session and the per-tensor broadcast receive) over a `TorchEngine`, so
the SGLang client, the launcher and the learner's sender run and are tested for real on a CPU. It takes
SGLang's core launch arguments (`--model-path --host --port --tp-size --random-seed --max-running-requests
--context-length --dtype`) and ignores any other `--flag [value]` with a warning, so a command line written for
`sglang.launch_server` starts it unchanged.

It behaves as SGLang does where a client can get it wrong, so the tests catch such a client:

* `--sglang-api 0.5.23` (the default): `/update_weights_from_distributed` outside a `/begin_weight_update` ..
  `/end_weight_update` session is refused before any tensor is received, and responses carry per-token
  `weight_versions` spans. `--sglang-api 0.5.15.post1`: no sessions (those paths answer 404), no spans, and a
  weight update with `flush_cache` while requests are still in the engine takes the server down, as that
  release's weight updater asserts the flush succeeded.
* `/flush_cache` succeeds only when no request runs (requests waiting out a pause do not count).
* `/health` and `/health_generate` generate one token, so while generation is paused they wait, and answer 503
  after `SGLANG_HEALTH_CHECK_TIMEOUT` seconds (20 by default), as SGLang's do.
* `/abort_request` with a `rid` aborts every request whose rid starts with it, if that rid is one in flight.
* `/generate` answers HTTP 400 when the prompt is not shorter than the context length, or the prompt plus
  `max_new_tokens` exceed it, with SGLang's message.
* `/generate` with `max_new_tokens: 0` and `return_logprob` scores the prompt instead of generating (a
  distillation teacher): `input_token_logprobs` from `logprob_start_len` on, the first entry's log-prob None.
* `/get_weight_version` does not exist (0.5.15.post1 answers 404, 0.5.23 has no such route): the version is in
  `/model_info`.
* LoRA, with `--enable-lora --max-lora-rank R --lora-target-modules ...` (SGLang's flags, checked as SGLang
  checks them): `/load_lora_adapter` reads a PEFT folder, `/unload_lora_adapter` waits for the requests still
  using the adapter, and a `/generate` item runs with the adapter its `lora_path` names, in one batch with items
  of other adapters (`adapters.py`). Without `--enable-lora` a load fails with SGLang's message.
* A mixture-of-experts model takes its experts under checkpoint names (`mlp.experts.<e>.gate_proj.weight`, written
  into the stacked parameter's slice), and skips transformers' stacked names (`mlp.experts.gate_up_proj`) while
  the update still succeeds: SGLang's MoE models pass over a name they do not know without a word.
* `/weights_checker` with action "checksum" answers SGLang's checksum of the weights served, computed as SGLang's
  CPU path computes it (`checksum.py`); other actions are refused with success false.

A fault for tests, hidden from `--help`: `--drop-weight-updates-after N` acknowledges every weight update after
the first N as loaded, and sets the version it names, without loading its tensors: a load path that silently
drops updates, which only the weight check (`engines/sglang/checksums.py`) can tell.

Weight updates are received the way SGLang receives them: the group is joined through the tcp:// rendezvous
with the group-name store prefix (`weight_group.py`), then each `/update_weights_from_distributed` call
allocates one tensor per name in the given dtype and shape and receives it by broadcast from rank 0, in
`names` order, before loading the bucket into the engine between two decode steps. A failed receive leaves the
group in place, as on SGLang: the client destroys it. The server holds one rank: with `--tp-size N > 1` it
serves generation but refuses to join a weight group (it cannot fill N ranks).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from aiohttp import web
from safetensors.torch import load_file
from transformers import AutoConfig

from engines.inference.base import GenerateRequest, SamplingParams
from engines.inference.model_facts import context_length as model_context_length
from engines.inference.torch_engine import TorchEngine
from engines.sglang import protocol
from engines.sglang.weight_group import WeightGroup, broadcastable, join_weight_group
from engines.weights import layouts
from tools.standins.sglang_server import checksum, openai_chat, parsing
from tools.standins.sglang_server.adapters import AdapterRoutes
from tools.standins.sglang_server.args import DTYPES, parse_args
from tools.standins.sglang_server.memory import ColocationRoutes

logger = logging.getLogger("tools.standins.sglang_server")
COMPAT_VERSION = "slipstream-compat"


class CompatServer:
    """The HTTP routes over one engine; state besides the engine: weight version, groups, the open session."""

    def __init__(self, engine: TorchEngine, args: argparse.Namespace, *, context_length: int) -> None:
        self.engine = engine
        self.args = args
        self.context_length = context_length
        self.sessions = args.sglang_api != "0.5.15.post1"
        self.weight_version = args.weight_version
        self.groups: dict[str, WeightGroup] = {}
        self.session_open = False
        self._version_names = {protocol.parse_weight_version(args.weight_version) or 0: args.weight_version}
        self._rids = itertools.count()
        self._inflight: set[str] = set()
        self.weights_lock = asyncio.Lock()
        self.loads = 0  # weight updates loaded (or, past --drop-weight-updates-after, dropped)
        self.lora = AdapterRoutes.for_server(engine, args)
        self.memory = ColocationRoutes(self, args)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        handlers = {
            protocol.GENERATE: self.generate,
            protocol.ABORT: self.abort_request,
            protocol.PAUSE: self.pause_generation,
            protocol.CONTINUE: self.continue_generation,
            protocol.FLUSH_CACHE: self.flush_cache,
            protocol.HEALTH: self.health_generate,  # SGLang's /health generates too (its default environment)
            protocol.HEALTH_GENERATE: self.health_generate,
            protocol.MODEL_INFO: self.model_info,
            protocol.SERVER_INFO: self.server_info,
            protocol.INIT_WEIGHTS_GROUP: self.init_weights_update_group,
            protocol.DESTROY_WEIGHTS_GROUP: self.destroy_weights_update_group,
            protocol.UPDATE_WEIGHTS_FROM_DISTRIBUTED: self.update_weights_from_distributed,
            protocol.UPDATE_WEIGHTS_FROM_TENSOR: self.memory.update_weights_from_tensor,
            protocol.UPDATE_WEIGHTS_FROM_DISK: self.update_weights_from_disk,
            protocol.RELEASE_MEMORY: self.memory.release,
            protocol.RESUME_MEMORY: self.memory.resume,
            protocol.LOAD_LORA_ADAPTER: self.lora.load,
            protocol.UNLOAD_LORA_ADAPTER: self.lora.unload,
            protocol.WEIGHTS_CHECKER: self.weights_checker,
        }
        if self.sessions:
            handlers[protocol.BEGIN_WEIGHT_UPDATE] = self.begin_weight_update
            handlers[protocol.END_WEIGHT_UPDATE] = self.end_weight_update
        routes = [web.route(endpoint.method, endpoint.path, handler) for endpoint, handler in handlers.items()]
        # SGLang's older spellings and extras we serve too (not called by our client).
        routes += [
            web.get("/get_model_info", self.model_info),
            web.get("/get_server_info", self.server_info),
            web.get("/metrics", self.metrics),
            web.post("/flush_cache", self.flush_cache),
            web.post("/update_weight_version", self.update_weight_version),
            web.get(protocol.WEIGHTS_CHECKER.path, self.weights_checker),  # SGLang's route takes GET and POST
            web.post("/v1/chat/completions", self.chat_completions),  # for agent frameworks outside the run
            web.get("/v1/models", self.lora.models),  # the loaded adapters, as SGLang lists them
        ]
        app.add_routes(routes)
        app.on_shutdown.append(self._shutdown)
        return app

    # ---- health and information

    async def health_generate(self, request: web.Request) -> web.Response:
        """One greedy token end to end, as SGLang does; paused, it waits like any request, then 503. With memory
        released it needs memory that is not there (SGLang would fault): 503 at once."""
        if not (await self.engine.health())["healthy"] or self.memory.refusal("/health") is not None:
            return web.Response(status=503)
        greedy_token = SamplingParams(temperature=0, max_new_tokens=1)
        probe = GenerateRequest(f"HEALTH_CHECK_{next(self._rids)}", [0], greedy_token)
        timeout = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
        try:
            await asyncio.wait_for(self.engine.generate(probe), timeout=timeout)
        except (asyncio.TimeoutError, TimeoutError):
            logger.error("health check failed: no token within %gs", timeout)
            return web.Response(status=503)
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
                "context_length": self.context_length,
                "max_req_input_len": self.context_length - 1 - parsing.RESERVED_INPUT_TOKENS,
                # Reported as given, like SGLang's arguments; seeds are honoured here either way.
                "enable_deterministic_inference": self.args.enable_deterministic_inference,
                # LoRA room, as SGLang reports its arguments (here --max-loras-per-batch caps the loaded adapters too)
                "max_loras_per_batch": self.args.max_loras_per_batch, "max_loaded_loras": None,
                "version": f"{COMPAT_VERSION} ({self.args.sglang_api})",
                "weight_version": self.weight_version,
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        """Two of SGLang's Prometheus gauges (served there with --enable-metrics, here always): what a caller can
        watch to know a request is being decoded, e.g. before pausing it."""
        health = await self.engine.health()
        labels = f'{{model_name="{self.args.model_path}"}}'
        lines = ["# TYPE sglang:num_running_reqs gauge", f"sglang:num_running_reqs{labels} {health['running']}",
                 "# TYPE sglang:generation_tokens_total counter",
                 f"sglang:generation_tokens_total{labels} {health['generated_tokens']}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await parsing.request_json(request)
        new_version = body.get("new_version")
        if not isinstance(new_version, str) or not new_version:
            return _failure("/update_weight_version: 'new_version' must be a non-empty string")
        if body.get("abort_all_requests"):
            await self.engine.abort(None)
        self.weight_version = new_version
        return web.json_response({"success": True, "message": f"weight version set to {new_version}"})

    # ---- generation control

    async def generate(self, request: web.Request) -> web.Response:
        arrived = time.monotonic()
        try:
            body = await parsing.request_json(request)
            items, batch = parsing.parse_generate_json(body, new_rid=self._new_rid)
            requests = [self._engine_request(item) for item in items]
            for engine_request in requests:
                parsing.check_context(engine_request, self.context_length)
        except ValueError as error:
            return _error(400, str(error))
        live = [r.request_id for r in requests if r.request_id in self._inflight]
        if live:
            return _error(400, f"/generate: rid {live[0]!r} is already in flight")
        if (refused := self.memory.refusal("/generate")) is not None:
            return refused
        if any(item.lora_path is not None for item in items) and self.lora.registry is None:
            return _error(400, "/generate: lora_path given, but LoRA is not enabled on this server (--enable-lora)")
        if any(item.score_only and item.lora_path is not None for item in items):
            return _error(400, "/generate: scoring (max_new_tokens 0) with a lora_path is not supported here")
        self._inflight.update(r.request_id for r in requests)
        try:
            results = await asyncio.gather(
                *(self._score(item, r) if item.score_only else self.lora.generate(item.lora_path, r)
                  for item, r in zip(items, requests, strict=True))
            )
        except ValueError as error:  # AdapterError included: a request for an adapter that is not loaded
            return _error(400, str(error))
        finally:
            self._inflight.difference_update(r.request_id for r in requests)
        tokenizer = self.engine.tokenizer
        body = []
        for item, engine_request, outputs in zip(items, requests, results, strict=True):
            if isinstance(outputs, dict):  # a scored prompt, already in SGLang's shape
                body.append(outputs)
                continue
            prompt_log_probs = await self._prompt_log_probs(item, engine_request)
            for output in outputs:
                text = tokenizer.decode(output.output_ids) if tokenizer is not None else ""
                names = [self._version_name(v) for v in output.versions]
                spans = parsing.version_spans(names) if self.sessions else None
                routes = None
                if item.return_routed_experts and self.args.enable_return_routed_experts:
                    routes = parsing.routed_experts_base64(output.routed_experts, item.routed_experts_start_len)
                body.append(
                    parsing.output_json(
                        output, rid=item.rid, weight_version=self.weight_version, text=text, weight_versions=spans,
                        routed_experts=routes, e2e_latency=time.monotonic() - arrived,
                    )
                )
                if prompt_log_probs is not None:
                    body[-1]["meta_info"]["input_token_logprobs"] = prompt_log_probs
        return web.json_response(body if batch or len(body) > 1 else body[0])

    async def chat_completions(self, request: web.Request) -> web.Response:
        if (refused := self.memory.refusal("/v1/chat/completions")) is not None:
            return refused
        return await openai_chat.chat_completions(self.engine, request, model=self.args.model_path,
                                                  context_length=self.context_length)

    async def abort_request(self, request: web.Request) -> web.Response:
        """As SGLang: `abort_all`, or every request whose rid STARTS WITH `rid`, if `rid` itself is in flight."""
        body = await parsing.request_json(request)
        rid = body.get("rid")
        if body.get("abort_all"):
            await self.engine.abort(None)
        elif isinstance(rid, str) and rid:
            if rid in self._inflight:
                for other in [other for other in self._inflight if other.startswith(rid)]:
                    await self.engine.abort(other)
        else:
            return _error(400, "/abort_request: give a non-empty 'rid' or 'abort_all': true")
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        """SGLang's modes: "abort" returns in-flight requests; "in_place" and "retract" keep them for later."""
        mode = (await parsing.request_json(request)).get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            return _error(400, f"/pause_generation: mode {mode!r} is not 'abort', 'retract' or 'in_place'")
        await self.engine.pause("abort" if mode == "abort" else "keep")
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self.engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        """The torch engine keeps no prefix cache across requests; like SGLang, refuse while requests run."""
        if not await self.idle():
            return web.Response(status=400, text="Cache not flushed because there are pending requests.\n")
        return web.Response(text="Cache flushed.\n")

    # ---- weights

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await parsing.request_json(request)
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
        name = str((await parsing.request_json(request)).get("group_name", "weight_update_group"))
        async with self.weights_lock:
            group = self.groups.pop(name, None)
            if group is None:
                return _failure(f"/destroy_weights_update_group: no group {name!r}")
            group.destroy()
        return web.json_response({"success": True, "message": f"destroyed group {name}"})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        selector = (await parsing.request_json(request)).get("selector", "all")
        if selector not in ("target", "draft", "all"):
            return _failure(f"invalid selector {selector!r}; expected 'target', 'draft', or 'all'")
        if self.session_open:
            return _failure("a weight-update session is already open; call end_weight_update() first")
        self.session_open = True
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        if not self.session_open:
            return _failure("no weight-update session is open; call begin_weight_update() first")
        self.session_open = False
        return web.json_response({"success": True, "message": "Success"})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await parsing.request_json(request)
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
        if self.sessions and not self.session_open:
            # SGLang 0.5.23 answers before receiving anything, so the sender's broadcast finds no receiver.
            return _failure(
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            )
        refused = self.memory.refusal("update_weights_from_distributed", needs=(protocol.MEMORY_WEIGHTS,))
        if refused is not None:
            return refused
        async with self.weights_lock:
            group = self.groups.get(name)
            if group is None:
                return _failure(f"Group {name} not in {sorted(self.groups)}. Call /init_weights_update_group first.")
            if body.get("abort_all_requests"):
                await self.engine.abort(None)
            try:
                tensors = await asyncio.to_thread(_receive, group, specs)
            except Exception as error:  # the group stays, as on SGLang; the client destroys it
                return _failure(f"Failed to receive weights: {error}")
            refused = await self.load(tensors, body.get("weight_version"))
            if refused is not None:
                return refused
        return await self.flush_after_update(body)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """Every `*.safetensors` of `model_path` loaded in place, as SGLang's default loader reads a folder (no
        session needed in any release); a folder without any is refused with SGLang's words."""
        body = await parsing.request_json(request)
        folder = body.get("model_path")
        if not isinstance(folder, str) or not folder:
            return _failure("/update_weights_from_disk: 'model_path' must be a non-empty string")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            return _failure(f"/update_weights_from_disk: load_format {body['load_format']!r} is not supported")
        refused = self.memory.refusal("update_weights_from_disk", needs=(protocol.MEMORY_WEIGHTS,))
        if refused is not None:
            return refused
        async with self.weights_lock:
            try:
                tensors = await asyncio.to_thread(_read_folder, folder)
            except (OSError, ValueError) as error:
                return _failure(f"Failed to get weights iterator: {error}.")
            if body.get("abort_all_requests"):
                await self.engine.abort(None)
            refused = await self.load(tensors, body.get("weight_version"))
            if refused is not None:
                return refused
        return await self.flush_after_update(body)

    async def load(self, tensors: list[tuple[str, Any]], version: Any) -> web.Response | None:
        """Load a received bucket between two decode steps; a `weight_version` given becomes the server's."""
        number = protocol.parse_weight_version(version)
        self.loads += 1
        if self.args.drop_weight_updates_after is not None and self.loads > self.args.drop_weight_updates_after:
            logger.warning("dropping weight update %d (--drop-weight-updates-after %d): acknowledged, not loaded",
                           self.loads, self.args.drop_weight_updates_after)
            tensors = []
        skipped = [name for name, _ in tensors if layouts.is_stacked_expert(name)]
        if skipped:
            # SGLang's MoE models match experts by checkpoint name only and pass over any other name without a
            # word (qwen3_moe.py load_weights: `if name not in params_dict: continue`); the load still succeeds.
            logger.warning("skipping %d stacked expert tensors (%s, ...), as SGLang does: it loads experts under "
                           "checkpoint names only (mlp.experts.<e>.gate_proj.weight)", len(skipped), skipped[0])
            tensors = [(name, tensor) for name, tensor in tensors if not layouts.is_stacked_expert(name)]
        try:
            await self.engine.update_weights(tensors, self.engine.version if number is None else number)
        except ValueError as error:
            return _failure(f"Failed to update parameter online: {error}.")
        if isinstance(version, str):
            self.weight_version = version
            if number is not None:
                self._version_names[number] = version
        return None

    async def flush_after_update(self, body: dict[str, Any]) -> web.Response:
        """The cache flush an update asks for (`flush_cache`, true by default), as each SGLang release does it."""
        if body.get("flush_cache", True) and not await self.idle():
            if not self.sessions:
                logger.critical(
                    "AssertionError: Cache flush failed after updating weights (SGLang 0.5.15 takes its server down "
                    "here: the requests paused with retract/in_place are still in the scheduler)"
                )
                os._exit(134)
            return _failure(
                "Weights were updated, but the cache was not flushed because requests are still running or queued. "
                "Retract or finish them, then call /flush_cache."
            )
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def weights_checker(self, request: web.Request) -> web.Response:
        """SGLang's `/weights_checker`: action "checksum" (its default) hashes what the server serves now
        (`checksum.py`); the snapshot and compare actions are not implemented here and are refused."""
        body = await parsing.request_json(request)
        action = body.get("action", protocol.CHECKSUM_ACTION)
        if action != protocol.CHECKSUM_ACTION:
            return _failure(f"Unsupported action={action!r} (this server computes {protocol.CHECKSUM_ACTION!r} only)")
        skip = body.get("skip_tensor_list") if self.sessions else None  # a field since 0.5.23
        if skip is not None and not (isinstance(skip, list) and all(isinstance(item, str) for item in skip)):
            return _failure(f"skip_tensor_list must be a list of strings, got {skip!r}")
        refused = self.memory.refusal("/weights_checker", needs=(protocol.MEMORY_WEIGHTS,))
        if refused is not None:
            return refused
        async with self.weights_lock:  # no update writes the weights while they are read
            answer = await asyncio.to_thread(checksum.checksum_answer, self.engine.model, self.args.sglang_api,
                                             skip or ())
        return web.json_response(answer)

    # ---- helpers

    def _new_rid(self) -> str:
        return f"compat-{next(self._rids)}"

    def _version_name(self, version: int) -> str:
        return self._version_names.get(version, str(version))

    async def idle(self) -> bool:
        """SGLang's flush condition: nothing running (requests held by an abort-mode pause never got in)."""
        status = await self.engine.health()
        return not status["running"] and (bool(status["paused"]) or not status["requests"])

    async def _score(self, item: parsing.GenerateItem, request: GenerateRequest) -> dict[str, Any]:
        """A `max_new_tokens: 0` item: the prompt's log-probs from `logprob_start_len` (SGLang's -1: none)."""
        ids = list(request.input_ids)
        start = len(ids) if item.logprob_start_len < 0 else min(item.logprob_start_len, len(ids))
        log_probs = []
        if item.return_logprob and start + 1 < len(ids):
            log_probs = await self.engine.score(ids, start=start + 1, temperature=item.params.temperature)
        if not item.return_logprob:
            start = len(ids)
        return parsing.scored_json(ids, log_probs, start=start, rid=item.rid, weight_version=self.weight_version)

    async def _prompt_log_probs(self, item: parsing.GenerateItem, request: GenerateRequest) -> list[Any] | None:
        """A generating item's `input_token_logprobs`, as SGLang returns them beside the output when asked with
        `logprob_start_len` >= 0: a multi-turn agent (strands-sglang) reads the log-probs of the tool results it
        appended from them. None where not asked (or with an adapter, which the scoring path does not take)."""
        if not item.return_logprob or item.logprob_start_len < 0 or item.lora_path is not None:
            return None
        return (await self._score(item, request))["meta_info"]["input_token_logprobs"]

    def _engine_request(self, item: parsing.GenerateItem) -> GenerateRequest:
        ids = item.input_ids
        if ids is None:
            tokenizer = self.engine.tokenizer
            if tokenizer is None:
                raise protocol.ProtocolError("/generate: 'text' needs a tokenizer; send input_ids")
            ids = list(tokenizer(item.text)["input_ids"])
        return GenerateRequest(item.rid, ids, item.params, images=item.images)

    async def _shutdown(self, app: web.Application) -> None:
        for group in self.groups.values():
            group.destroy()
        await self.engine.close()


def _receive(group: WeightGroup, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[tuple[str, Any]]:
    """One broadcast per tensor from rank 0, posted in `names` order, each in its own dtype (SGLang's layout)."""
    received, pending = [], []
    for name, dtype, shape in specs:
        tensor = torch.empty(shape, dtype=dtype)
        pending.append(dist.broadcast(broadcastable(tensor), src=0, group=group.group, async_op=True))
        received.append((name, tensor))
    for work in pending:
        work.wait()
    return received


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _failure(message: str) -> web.Response:
    """SGLang's shape for a failed control call: success false and the reason, with HTTP 400."""
    logger.warning(message)
    return web.json_response({"success": False, "message": message}, status=400)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.ignored:
        logger.warning("ignoring SGLang arguments this server does not implement: %s", " ".join(args.ignored))
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    context_length = args.context_length or model_context_length(AutoConfig.from_pretrained(args.model_path))
    if not context_length:
        raise SystemExit(f"{args.model_path}: config.json has no max_position_embeddings; pass --context-length")
    engine = TorchEngine.from_pretrained(
        args.model_path,
        dtype=DTYPES[args.dtype],
        max_batch_size=args.max_running_requests,
        max_model_len=context_length,
        seed=args.random_seed,
        version=protocol.parse_weight_version(args.weight_version) or 0,
        # each adapter's B arrives multiplied by its own alpha / r (adapters.py), so the engine's scale is 1
        lora_scaling=1.0 if args.enable_lora else None,
        max_adapters=args.max_loras_per_batch,
        deterministic=args.enable_deterministic_inference,
        record_routes=args.enable_return_routed_experts,
    )
    server = CompatServer(engine, args, context_length=context_length)
    logger.info("serving %s on http://%s:%d (SGLang %s API)", args.model_path, args.host, args.port, args.sglang_api)
    # handle_signals: SIGTERM and SIGINT shut the app down, which closes the engine and the groups.
    web.run_app(server.app(), host=args.host, port=args.port, print=None, handle_signals=True, shutdown_timeout=1.0)


if __name__ == "__main__":
    main()


def _read_folder(folder: str) -> list[tuple[str, torch.Tensor]]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"Cannot find any model weights with `{folder}`")
    return [item for path in files for item in load_file(str(path)).items()]
