"""How we read an sglang-router's worker list (`engines/sglang/router_workers.py`) against each supported release's
own documentation, on a CPU, without importing the router (its routes are Rust inside a shared library).

The wheels of `SUPPORTED_SGLANG_ROUTER` are fetched once into `.cache/sglang-router-wheels` and read as zip files:
their README (the wheel's METADATA) documents `GET /workers` in its API table and shows a sample answer, and the
shared library carries the route strings. Our reader must take the documented answer, and the stand-in router
(`tools/standins/sglang_router.py`) must answer in the same shape. Without a registry the tests skip and say so,
unless SLIPSTREAM_REQUIRE_SGLANG_CONTRACT=1.
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import pytest
import requests

from engines.sglang.router_workers import READ_FIELDS, SUPPORTED_SGLANG_ROUTER, WORKERS_PATH, parse_workers
from tests.engines.test_sglang_contract import REPO, fetch_wheel
from tools.standins.sglang_router import RouterStandIn

WHEEL_DIR = REPO / ".cache" / "sglang-router-wheels"


class RouterRelease:
    """One sglang-router wheel: its README and its compiled route strings."""

    def __init__(self, version: str, wheel: Path) -> None:
        self.version = version
        with zipfile.ZipFile(wheel) as archive:
            self.readme = archive.read(f"sglang_router-{version}.dist-info/METADATA").decode()
            library = next(name for name in archive.namelist() if name.endswith(".so"))
            self.library = archive.read(library)

    def sample_workers_answer(self) -> dict:
        """The README's sample answer to `GET /workers` (the JSON block after "Sample response")."""
        match = re.search(r"curl http://\S+/workers\s*```\s*Sample response[^\n]*\n```json\n(.*?)\n```", self.readme,
                          re.DOTALL)
        assert match, f"sglang-router {self.version}'s README shows no sample answer to GET {WORKERS_PATH}"
        return json.loads(match.group(1))


@pytest.fixture(scope="module", params=SUPPORTED_SGLANG_ROUTER)
def release(request: pytest.FixtureRequest) -> RouterRelease:
    wheel = fetch_wheel(request.param, "sglang-router", wheel_dir=WHEEL_DIR, platform="manylinux2014_x86_64")
    return RouterRelease(request.param, wheel)


@pytest.mark.unit
def test_the_worker_list_route_is_documented_and_compiled_in(release: RouterRelease) -> None:
    assert re.search(rf"\|\s*`GET`\s*\|\s*`{WORKERS_PATH}`\s*\|", release.readme), (
        f"sglang-router {release.version}'s API table has no GET {WORKERS_PATH}")
    assert f"{WORKERS_PATH}/{{worker_id}}".encode() in release.library, "the router's routes moved"


@pytest.mark.unit
def test_the_documented_answer_gives_the_servers_we_attach_to(release: RouterRelease) -> None:
    answer = release.sample_workers_answer()
    for worker in answer["workers"]:
        assert set(READ_FIELDS) <= set(worker), f"a documented worker lacks {set(READ_FIELDS) - set(worker)}"
    servers = parse_workers("http://router:30000", answer)
    assert servers.urls == sorted(worker["url"] for worker in answer["workers"])
    assert servers.unhealthy == []


@pytest.mark.integration
def test_the_stand_in_answers_as_the_release_documents(release: RouterRelease,
                                                       sglang_router: tuple[RouterStandIn, str]) -> None:
    documented = release.sample_workers_answer()
    stand_in, url = sglang_router
    stand_in.register("http://127.0.0.1:31378")
    answer = requests.get(url + WORKERS_PATH, timeout=10).json()
    assert set(answer) == set(documented)
    assert set(answer["stats"]) == set(documented["stats"])
    assert set(answer["workers"][0]) == set(documented["workers"][0])
