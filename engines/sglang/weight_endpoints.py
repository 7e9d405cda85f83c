"""SGLang's weight-update endpoints, beyond the `InferenceEngine` interface: what the weight loader drives.

A mixin of `SglangEngine`, apart because it is one job (join a group, open a session, receive buckets, flush
the cache, checksum what the server then serves) that the generation client does not need to read. It uses the
engine's `url`, `control_timeout`, `_call` and `_sessions` (None until the server showed whether it has
weight-update sessions).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from engines.sglang import protocol
from engines.sglang.errors import SglangError
from engines.sglang.protocol import Endpoint

logger = logging.getLogger("engines.sglang.client")


class WeightUpdateEndpoints:
    url: str
    control_timeout: float
    _sessions: bool | None

    async def _call(self, endpoint: Endpoint, *, timeout: float | None = None, **fields: Any) -> Any:
        raise NotImplementedError

    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str, timeout: float) -> None:
        await self._call(protocol.INIT_WEIGHTS_GROUP, timeout=timeout, master_address=master_address,
                         master_port=master_port, rank_offset=rank_offset, world_size=world_size,
                         group_name=group_name, backend=backend)

    async def destroy_weights_update_group(self, group_name: str, *, timeout: float | None = None) -> None:
        await self._call(protocol.DESTROY_WEIGHTS_GROUP, timeout=timeout, group_name=group_name)

    async def begin_weight_update(self) -> bool:
        """Open SGLang's weight-update session; False when the server has none (it predates them: HTTP 404).

        SGLang 0.5.23 refuses `/update_weights_from_distributed` outside a session. A session left open by an
        update that failed half-way (its end never arrived) makes begin fail; it is ended and begun once more.
        """
        if self._sessions is False:
            return False
        try:
            await self._call(protocol.BEGIN_WEIGHT_UPDATE, selector="all")
        except SglangError as error:
            if error.status == 404:
                self._sessions = False
                logger.info(
                    "%s has no %s (an SGLang release before weight-update sessions): updating weights without one",
                    self.url,
                    protocol.BEGIN_WEIGHT_UPDATE.path,
                )
                return False
            if error.status is None:
                raise
            logger.warning("%s: %s; ending the open session and beginning again", self.url, error)
            with contextlib.suppress(SglangError):
                await self._call(protocol.END_WEIGHT_UPDATE)
            await self._call(protocol.BEGIN_WEIGHT_UPDATE, selector="all")
        if self._sessions is None:
            logger.info("%s has weight-update sessions: each update runs between begin and end", self.url)
        self._sessions = True
        return True

    async def end_weight_update(self) -> None:
        await self._call(protocol.END_WEIGHT_UPDATE)

    async def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, weight_version: str | None, flush_cache: bool,
                                              timeout: float) -> None:
        """One bucket's broadcasts into the server. SGLang sets its weight version from `weight_version` only
        when one is given (and the call succeeded); None leaves the version as it is."""
        await self._call(protocol.UPDATE_WEIGHTS_FROM_DISTRIBUTED, timeout=timeout, names=names, dtypes=dtypes,
                         shapes=shapes, group_name=group_name, weight_version=weight_version, flush_cache=flush_cache)

    async def update_weights_from_tensor(self, *, payloads: list[str], weight_version: str | None,
                                         timeout: float) -> None:
        """One bucket by reference (`tensor_payload.py`: one payload per tensor-parallel rank); the cache is not
        flushed (it was before the update), and `weight_version` is set only when given, as above."""
        await self._call(protocol.UPDATE_WEIGHTS_FROM_TENSOR, timeout=timeout, serialized_named_tensors=payloads,
                         weight_version=weight_version, flush_cache=False)

    async def update_weights_from_disk(self, *, model_path: str, weight_version: str, timeout: float) -> None:
        """A whole push from a folder the server can read (`disk_weights.py`), loaded in place; the cache is not
        flushed (it was before the update), and the server takes `weight_version` once the load succeeded."""
        await self._call(protocol.UPDATE_WEIGHTS_FROM_DISK, timeout=timeout, model_path=model_path,
                         weight_version=weight_version, flush_cache=False)

    async def weight_checksum(self, *, timeout: float | None = None) -> protocol.WeightsChecksum | None:
        """SGLang's checksum of the weights the server serves now (`/weights_checker`, action "checksum"); None
        when the server has no such route (HTTP 404: it cannot be checked, which is no error). A refusal or an
        answer that does not add up is an SglangError naming the server."""
        try:
            body = await self._call(protocol.WEIGHTS_CHECKER, timeout=timeout, action=protocol.CHECKSUM_ACTION)
        except SglangError as error:
            if error.status == 404:
                return None
            raise
        try:
            return protocol.parse_weights_checksum(body, where=f"{self.url}{protocol.WEIGHTS_CHECKER.path}")
        except protocol.ProtocolError as error:
            raise SglangError(str(error), 200) from error

    async def flush_cache(self, deadline_s: float) -> None:
        """GET /flush_cache until it succeeds; SGLang refuses while any request runs or waits in its scheduler.

        After a pause in "abort" mode the aborted requests leave the scheduler within a few steps, so the flush
        succeeds soon; a server that stays busy for `deadline_s` is an SglangError naming the endpoint.
        """
        deadline = time.monotonic() + deadline_s
        delay, last = 0.02, ""
        while True:
            try:
                await self._call(protocol.FLUSH_CACHE, timeout=max(1.0, min(self.control_timeout, deadline_s)))
                return
            except SglangError as error:
                if error.status is None:
                    raise
                last = str(error)
            if time.monotonic() + delay > deadline:
                raise SglangError(
                    f"{self.url}{protocol.FLUSH_CACHE.path}: the server did not become idle within {deadline_s:g}s; "
                    f"last answer: {last}"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
