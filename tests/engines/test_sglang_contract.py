"""Our SGLang client against the SOURCE of every SGLang release we support, on a CPU, without importing sglang.

The two pinned wheels (`protocol.SUPPORTED_SGLANG`) are fetched once into `.cache/sglang-wheels` with
`pip download --no-deps` and read as zip files; `ast` parses SGLang's route table (`entrypoints/http_server.py`),
its request structs (`managers/io_struct.py`), its `SamplingParams`, its server arguments and the code that
builds responses. Every row of `protocol.ENDPOINTS` must exist with its method and request class, every field we
send must be a field of that class, and every response field we read must be produced somewhere the source
shows. Without a registry the tests skip and say so, unless SLIPSTREAM_REQUIRE_SGLANG_CONTRACT=1 (CI), where a
missing wheel is a failure.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from functools import cached_property
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from actors.config import RunConfig
from actors.rollout.engine_factory import sglang_server_args
from engines.inference.base import GenerateOutput
from engines.pretrained import UNREACHABLE_MARKERS
from engines.sglang import protocol, tensor_payload
from engines.sglang.checksums import SERVER_OWN_TENSORS
from engines.sglang.launch import ServerSpec
from tools.standins.sglang_server import checksum, parsing
from tools.standins.sglang_server.server import CompatServer, parse_args

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
WHEEL_DIR = REPO / ".cache" / "sglang-wheels"
# Where SGLang builds the responses whose fields we read, when not in the route function itself.
PRODUCERS = {
    "/generate": ("sglang/srt/managers/tokenizer_manager.py", "sglang/srt/utils/weight_versions.py"),
    "/server_info": (
        "sglang/srt/server_args.py",
        "sglang/srt/arg_groups/fields/*.py",
        "sglang/srt/managers/scheduler.py",
    ),
}
SERVER_ARGS_FILES = ("sglang/srt/server_args.py", "sglang/srt/arg_groups/fields/*.py")
# The LoRA routes answer with `LoRAUpdateOutput`, a struct of io_struct.py (test_lora_routes_answer_... below).
for _lora_path in (protocol.LOAD_LORA_ADAPTER.path, protocol.UNLOAD_LORA_ADAPTER.path):
    PRODUCERS[_lora_path] = ("sglang/srt/managers/io_struct.py",)


def fetch_wheel(version: str, package: str = "sglang", *, wheel_dir: Path = WHEEL_DIR,
                platform: str = "manylinux_2_34_x86_64") -> Path:
    """The wheel of `package`==`version` in `wheel_dir`, downloaded by pip the first time (sglang-router's contract
    test reads its wheels through this too)."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    stem = package.replace("-", "_")
    found = sorted(wheel_dir.glob(f"{stem}-{version}-*.whl"))
    if found:
        return found[0]
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
        # The source is all we read; the interpreter running the tests need not be one SGLang supports.
        "--only-binary=:all:", "--python-version", "3.11", "--platform", platform,
        f"{package}=={version}", "-d", str(wheel_dir),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    found = sorted(wheel_dir.glob(f"{stem}-{version}-*.whl"))
    if done.returncode == 0 and found:
        return found[0]
    output = done.stdout + done.stderr
    unreachable = any(marker in output for marker in UNREACHABLE_MARKERS)
    if unreachable and os.environ.get("SLIPSTREAM_REQUIRE_SGLANG_CONTRACT") != "1":
        pytest.skip(f"pip cannot reach a package index to download {package}=={version}: {output.strip()[-300:]}")
    raise RuntimeError(f"`{' '.join(command)}` failed (exit {done.returncode}):\n{output[-2000:]}")


class SglangSource:
    """One SGLang wheel's Python source, read without importing it."""

    def __init__(self, version: str, wheel: Path) -> None:
        self.version = version
        self.zip = zipfile.ZipFile(wheel)
        self.names = self.zip.namelist()

    def tree(self, path: str) -> ast.Module:
        return ast.parse(self.zip.read(path).decode(), filename=f"sglang-{self.version}/{path}")

    def matching(self, pattern: str) -> list[str]:
        return [name for name in self.names if fnmatch.fnmatch(name, pattern)]

    @cached_property
    def http_server(self) -> ast.Module:
        return self.tree("sglang/srt/entrypoints/http_server.py")

    @cached_property
    def routes(self) -> dict[str, tuple[set[str], ast.AsyncFunctionDef | ast.FunctionDef]]:
        """Every `@app.get/post/put/api_route("/path")` of http_server.py: path -> (methods, handler)."""
        routes: dict[str, tuple[set[str], ast.AsyncFunctionDef | ast.FunctionDef]] = {}
        for node in ast.walk(self.http_server):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for decorator in node.decorator_list:
                if not (
                    isinstance(decorator, ast.Call)
                    and isinstance(decorator.func, ast.Attribute)
                    and isinstance(decorator.func.value, ast.Name)
                    and decorator.func.value.id == "app"
                    and decorator.args
                    and isinstance(decorator.args[0], ast.Constant)
                ):
                    continue
                kind, path = decorator.func.attr, decorator.args[0].value
                if kind == "api_route":
                    methods = next(
                        ({item.value for item in keyword.value.elts} for keyword in decorator.keywords
                         if keyword.arg == "methods"),
                        {"GET"},
                    )  # fmt: skip
                else:
                    methods = {kind.upper()}
                known, _ = routes.get(path, (set(), node))
                routes[path] = (known | methods, node)
        return routes

    def class_fields(self, path: str, name: str) -> set[str]:
        """Annotated fields of class `name` in `path`, with those of its bases defined in the same file."""
        classes = {node.name: node for node in self.tree(path).body if isinstance(node, ast.ClassDef)}
        fields: set[str] = set()
        pending = [name]
        while pending:
            node = classes[pending.pop()]
            fields |= {
                s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
            pending += [base.id for base in node.bases if isinstance(base, ast.Name) and base.id in classes]
        return fields

    def produced_keys(self, nodes: list[ast.AST]) -> set[str]:
        """String keys the code builds: dict-literal keys, `x["key"] = ...` targets, annotated class fields."""
        keys: set[str] = set()
        for root in nodes:
            for node in ast.walk(root):
                if isinstance(node, ast.Dict):
                    keys |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
                elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
                    if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                        keys.add(node.slice.value)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    keys.add(node.target.id)
        return keys

    @cached_property
    def server_arg_fields(self) -> set[str]:
        files = [name for pattern in SERVER_ARGS_FILES for name in self.matching(pattern)]
        return self.produced_keys([self.tree(name) for name in files])

    @cached_property
    def deprecated_flags(self) -> set[str]:
        """Flags registered with one of SGLang's Deprecated* argparse actions."""
        flags: set[str] = set()
        for node in ast.walk(self.tree("sglang/srt/server_args.py")):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            action = next((k.value for k in node.keywords if k.arg == "action"), None)
            if node.func.attr == "add_argument" and action is not None and "Deprecated" in ast.unparse(action):
                flags |= {a.value for a in node.args if isinstance(a, ast.Constant)}
        return flags


@pytest.fixture(scope="module", params=protocol.SUPPORTED_SGLANG)
def sglang(request: pytest.FixtureRequest) -> Iterator[SglangSource]:
    source = SglangSource(request.param, fetch_wheel(request.param))
    yield source
    source.zip.close()


def test_every_endpoint_we_call_exists_with_its_method_and_request_class(sglang: SglangSource) -> None:
    for endpoint in protocol.ENDPOINTS:
        if endpoint.path not in sglang.routes:
            assert endpoint.optional, f"sglang {sglang.version} has no route {endpoint.path} (and we need it)"
            assert endpoint.since is not None and Version(sglang.version) < Version(endpoint.since)
            continue
        methods, handler = sglang.routes[endpoint.path]
        assert endpoint.method in methods, f"sglang {sglang.version} {endpoint.path} takes {methods}"
        if endpoint.request_class is not None:
            annotations = " ".join(ast.unparse(arg.annotation) for arg in handler.args.args if arg.annotation)
            # `obj: Annotated[Optional[CheckWeightsReqInput], Body()]` names its class among brackets
            words = annotations.replace("[", " ").replace("]", " ").replace(",", " ").split()
            assert endpoint.request_class in words, (
                f"sglang {sglang.version} {endpoint.path} parses its body as {annotations}, "
                f"not {endpoint.request_class}"
            )


def test_every_field_we_send_is_a_field_of_sglangs_request_class(sglang: SglangSource) -> None:
    for endpoint in protocol.ENDPOINTS:
        if endpoint.request_class is None or endpoint.path not in sglang.routes:
            continue
        fields = sglang.class_fields("sglang/srt/managers/io_struct.py", endpoint.request_class)
        missing = set(endpoint.sends) - fields
        assert not missing, f"sglang {sglang.version} {endpoint.request_class} has no {sorted(missing)}"
    sampling = sglang.class_fields("sglang/srt/sampling/sampling_params.py", "SamplingParams")
    assert set(protocol.SAMPLING_FIELDS) <= sampling, sorted(set(protocol.SAMPLING_FIELDS) - sampling)


def test_every_response_field_we_read_is_produced(sglang: SglangSource) -> None:
    for endpoint in protocol.ENDPOINTS:
        if endpoint.path not in sglang.routes:
            continue
        _, handler = sglang.routes[endpoint.path]
        files = [name for pattern in PRODUCERS.get(endpoint.path, ()) for name in sglang.matching(pattern)]
        produced = sglang.produced_keys([handler, *(sglang.tree(name) for name in files)])
        missing = set(endpoint.reads) - produced
        assert not missing, f"sglang {sglang.version} {endpoint.path} never produces {sorted(missing)}"
    generate = sglang.produced_keys([sglang.tree(name) for name in sglang.matching(PRODUCERS["/generate"][0])])
    missing = {*protocol.META_FIELDS, protocol.ROUTED_EXPERTS_META} - generate
    assert not missing, f"sglang {sglang.version} /generate meta_info never holds {sorted(missing)}"


def test_the_stand_in_servers_generate_meta_info_holds_only_sglangs_keys(sglang: SglangSource) -> None:
    """Agent frameworks written for SGLang read its meta_info (strands-sglang: cached_tokens, e2e_latency,
    input_token_logprobs): the stand-in serves those under SGLang's names and invents none."""
    output = GenerateOutput("r", [5], [-0.5], [0], "stop", prompt_len=3, matched_stop=5)
    served = set(parsing.output_json(output, rid="r", weight_version="default", text="x")["meta_info"])
    scored = parsing.scored_json([1, 2, 3], [-0.1, -0.2], start=0, rid="r", weight_version="default")
    served |= set(scored["meta_info"])
    assert {"cached_tokens", "e2e_latency", "completion_tokens", "input_token_logprobs"} <= served
    generate = sglang.produced_keys([sglang.tree(name) for name in sglang.matching(PRODUCERS["/generate"][0])])
    assert served <= generate, f"sglang {sglang.version} /generate meta_info never holds {sorted(served - generate)}"


def test_the_generate_schema_of_newer_releases_knows_our_fields(sglang: SglangSource) -> None:
    """0.5.23 gates /generate bodies through a generated schema (`api/v1/api_types.py`) before serving them."""
    schema = "sglang/api/v1/api_types.py"
    if schema not in sglang.names:
        pytest.skip(f"sglang {sglang.version} has no /generate schema gate")
    ungated = set(protocol.UNGATED_GENERATE_FIELDS)
    assert set(protocol.GENERATE.sends) - ungated <= sglang.class_fields(schema, "GenerateRequest")
    if ungated - sglang.class_fields(schema, "GenerateRequest"):  # sent past the gate: it must ignore, not refuse
        assert "unknown keys ignored" in sglang.zip.read(schema).decode().split("class GenerateRequest", 1)[1][:300]
    assert set(protocol.SAMPLING_FIELDS) <= sglang.class_fields(schema, "SamplingParams")
    meta = sglang.class_fields(schema, "GenerateMetaInfo")
    assert set(protocol.META_FIELDS) | set(protocol.OPTIONAL_META_FIELDS) <= meta
    assert sglang.class_fields(schema, "WeightVersionSpan") == {"version", "start", "end"}


def test_weight_updates_need_a_session_exactly_where_sessions_exist(sglang: SglangSource) -> None:
    """Where /begin_weight_update exists, the scheduler refuses updates outside a session: we must call it."""
    updater = "sglang/srt/managers/scheduler_components/weight_updater.py"
    text = sglang.zip.read(updater).decode() if updater in sglang.names else ""
    has_sessions = protocol.BEGIN_WEIGHT_UPDATE.path in sglang.routes
    assert has_sessions == ("must run between" in text)
    assert has_sessions == (protocol.END_WEIGHT_UPDATE.path in sglang.routes)


def test_the_weight_checksum_is_built_as_the_compatible_server_builds_it(sglang: SglangSource) -> None:
    """What `protocol.parse_weights_checksum` reads and checks, and what the stand-in's `/weights_checker` computes
    (`tools/standins/sglang_server/checksum.py`): per tensor the first 8 bytes of a sha256, big-endian, as 16 hex
    digits; per rank a sha256 over the sorted names and their checksums; per engine a sha256 over the ranks'
    per_gpu_checksum; the same non-persistent buffers skipped."""
    checker = sglang.tree("sglang/srt/utils/weight_checker.py")
    assert "per_gpu_checksum" in sglang.class_fields("sglang/srt/utils/weight_checker.py", "ChecksumInfo")
    patterns = next(ast.literal_eval(node.value) for node in checker.body if isinstance(node, ast.Assign)
                    and ast.unparse(node.targets[0]) == "_NON_PERSISTENT_BUFFER_PATTERNS")
    assert set(patterns) == set(checksum.NON_PERSISTENT[sglang.version])
    # per rank, per tensor too: what `ServedHistory` compares between loads, less SGLang's own tensors
    assert "checksums" in sglang.class_fields("sglang/srt/utils/weight_checker.py", "ChecksumInfo")
    assert set(patterns) <= set(SERVER_OWN_TENSORS)
    functions = {node.name: ast.unparse(node) for node in ast.walk(checker) if isinstance(node, ast.FunctionDef)}
    assert "tensor_hash(t):016x" in functions["_hash_tensor"]
    overall = functions.get("overall_checksum") or functions["_compute_checksum"]
    assert re.search(r"for name in sorted\(checksums\):\s+h\.update\(name\.encode\(\)\)\s+"
                     r"h\.update\(checksums\[name\]\.encode\(\)\)", overall)
    assert "yield from model.named_parameters()" in functions["_model_state"].replace("self._model_runner.", "")
    assert "named_buffers()" in functions["_model_state"]
    mm_utils = sglang.tree("sglang/srt/managers/mm_utils.py")
    (tensor_hash,) = [ast.unparse(node) for node in mm_utils.body
                      if isinstance(node, ast.FunctionDef) and node.name == "tensor_hash"]
    assert "hashlib.sha256()" in tensor_hash and "hasher.digest()[:8]" in tensor_hash
    assert "byteorder='big', signed=False" in tensor_hash
    mixin = ast.unparse(sglang.tree("sglang/srt/managers/tokenizer_control_mixin.py"))
    assert re.search(r"h = hashlib\.sha256\(\)\s+for \w+ in \w+:\s+h\.update\(\w+(\['per_gpu_checksum'\]|"
                     r"\.per_gpu_checksum)\.encode\(\)\)\s+per_engine_checksum = h\.hexdigest\(\)", mixin)


def safe_unpickler_allows(sglang: SglangSource) -> Callable[[str, str], bool]:
    """Whether SGLang's restricted unpickler (`SafeUnpickler`, what `/update_weights_from_tensor` deserializes
    with) lets a global through: an exact list in 0.5.23, module prefixes less a deny list in 0.5.15."""
    tree = sglang.tree("sglang/srt/utils/common.py")
    (unpickler,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "SafeUnpickler"]
    values = {ast.unparse(node.targets[0]): ast.literal_eval(node.value)
              for node in unpickler.body if isinstance(node, ast.Assign)}
    if "ALLOWED_GLOBALS" in values:
        return lambda module, name: (module, name) in values["ALLOWED_GLOBALS"]
    prefixes, denied = values["ALLOWED_MODULE_PREFIXES"], values["DENY_CLASSES"]
    return lambda module, name: (module, name) not in denied and any(
        (module + ".").startswith(prefix) for prefix in prefixes)


def test_sglangs_restricted_unpickler_opens_every_global_of_our_tensor_payload(sglang: SglangSource) -> None:
    allows = safe_unpickler_allows(sglang)
    refused = sorted(f"{module}.{name}" for module, name in tensor_payload.ALLOWED_GLOBALS if not allows(module, name))
    assert not refused, f"sglang {sglang.version} refuses {refused} in serialized_named_tensors"
    assert not allows("builtins", "eval")  # the reading of its allow list is not vacuous


def test_each_tensor_parallel_rank_opens_its_own_payload(sglang: SglangSource) -> None:
    """So a server of N ranks gets N payloads, each pickled on its own (`tensor_weights.py`)."""
    source = sglang.zip.read("sglang/srt/managers/tp_worker.py").decode()
    assert re.search(r"serialized_named_tensors\[\s*(self\.tp_rank|get_parallel\(\)\.tp_rank)\s*\]", source)


def test_memory_tags_are_sglangs(sglang: SglangSource) -> None:
    tree = sglang.tree("sglang/srt/constants.py")
    constants = {ast.unparse(node.targets[0]): node.value.value for node in tree.body
                 if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)}
    assert {constants["GPU_MEMORY_TYPE_WEIGHTS"], constants["GPU_MEMORY_TYPE_KV_CACHE"],
            constants["GPU_MEMORY_TYPE_CUDA_GRAPH"]} == set(protocol.MEMORY_TAGS)


def gpu_test_server_args() -> dict[str, str]:
    """`GPU_SERVER_ARGS` of test_sglang_gpu.py, read from its source (that module needs a GPU to run)."""
    tree = ast.parse((Path(__file__).parent / "test_sglang_gpu.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "GPU_SERVER_ARGS":
            assert node.value is not None
            return ast.literal_eval(node.value)
    raise AssertionError("test_sglang_gpu.py defines no GPU_SERVER_ARGS")


def test_lora_routes_answer_a_lora_update_output_with_the_fields_we_read(sglang: SglangSource) -> None:
    fields = sglang.class_fields("sglang/srt/managers/io_struct.py", "LoRAUpdateOutput")
    for endpoint in (protocol.LOAD_LORA_ADAPTER, protocol.UNLOAD_LORA_ADAPTER):
        assert set(endpoint.reads) <= fields, (endpoint.path, fields)
        _, handler = sglang.routes[endpoint.path]
        assert "tokenizer_manager" in ast.unparse(handler) and "result.success" in ast.unparse(handler)


def test_an_unload_refuses_the_adapter_at_once_then_waits_for_its_requests(sglang: SglangSource) -> None:
    """What `stop_serving` mirrors (engines/sglang/adapter_endpoints.py): SGLang's unload unregisters the name, so a
    new request naming it fails, then waits for the requests holding the adapter, and only then unloads it from the
    scheduler; `/v1/models` lists the registry's adapters (an unloaded one no more); `/server_info` reports the
    arguments that bound the adapters (`policy_room`)."""
    mixin = sglang.tree("sglang/srt/managers/tokenizer_control_mixin.py")
    unload = next(node for node in ast.walk(mixin)
                  if isinstance(node, ast.AsyncFunctionDef) and node.name == "_unload_lora_adapter_locked")
    calls = sorted((node.lineno, node.col_offset, node.func.attr) for node in ast.walk(unload)
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute))
    order = [name for _, _, name in calls
             if name in ("unregister", "wait_for_unload", "update_lora_adapter_communicator")]
    assert order == ["unregister", "wait_for_unload", "update_lora_adapter_communicator"], order
    _, models = sglang.routes["/v1/models"]
    assert "lora_registry.get_all_adapters()" in ast.unparse(models)
    assert {"max_loras_per_batch", "max_loaded_loras"} <= sglang.server_arg_fields


def test_the_modules_sglang_can_adapt_are_the_ones_we_allow(sglang: SglangSource) -> None:
    tree = sglang.tree("sglang/srt/utils/common.py")
    lists = {
        ast.unparse(node.targets[0]): ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and len(node.targets) == 1
        and ast.unparse(node.targets[0]) in ("SUPPORTED_LORA_TARGET_MODULES", "LORA_TARGET_ALL_MODULES")
    }
    assert set(protocol.LORA_TARGET_MODULES) <= set(lists["SUPPORTED_LORA_TARGET_MODULES"])
    assert lists["LORA_TARGET_ALL_MODULES"] == protocol.LORA_ALL_MODULES


def test_launch_flags_exist_and_are_not_deprecated(sglang: SglangSource) -> None:
    """Our launch command (a LoRA run's, a deterministic one's, a bf16 one's, a colocated one's, a routing replay
    one's) and the GPU test's
    (`--disable-cuda-graph` is deprecated in both)."""
    config = RunConfig(rollout_engine="sglang", lora_rank=8, target_modules=["q_proj", "v_proj"],
                       deterministic_inference=True, bf16=True, colocate=True, use_rollout_routing_replay=True,
                       sglang_args={"enable-weights-cpu-backup": "true"})  # what a colocated run may release
    extra = {**gpu_test_server_args(), **sglang_server_args(config)}
    command = ServerSpec(model_path="/m", random_seed=1, base_gpu_id=0, extra=extra).command(port=1)
    flags = [part for part in command if part.startswith("--")]
    unknown = [flag for flag in flags if flag[2:].replace("-", "_") not in sglang.server_arg_fields]
    assert not unknown, f"sglang {sglang.version} has no server arguments {unknown}"
    deprecated = sorted(set(flags) & sglang.deprecated_flags)
    assert not deprecated, f"sglang {sglang.version} deprecates {deprecated}"


def test_a_run_of_several_policies_makes_room_in_a_batch_with_a_flag_sglang_has(sglang: SglangSource) -> None:
    """Every policy's adapter, the one each replaces while its requests finish, and the base model in one batch:
    `--max-loras-per-batch`, at least SGLang's own default."""
    policies = {name: {} for name in ("a", "b", "c", "d", "e")}
    extra = sglang_server_args(RunConfig(rollout_engine="sglang", lora_rank=8, policies=policies))
    assert extra["max-loras-per-batch"] == "11"
    command = ServerSpec(model_path="/m", extra=extra).command(port=1)
    unknown = [flag for flag in command if flag.startswith("--") and flag[2:].replace("-", "_")
               not in sglang.server_arg_fields]
    assert not unknown, f"sglang {sglang.version} has no server arguments {unknown}"
    files = [name for pattern in SERVER_ARGS_FILES for name in sglang.matching(pattern)]
    defaults = [ast.literal_eval(node.value) for name in files for node in ast.walk(sglang.tree(name))
                if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "max_loras_per_batch"
                and node.value is not None]
    assert defaults == [protocol.LORAS_PER_BATCH], defaults


def test_pyproject_allows_exactly_the_tested_sglang_range() -> None:
    # tomllib is 3.11+ and we allow 3.10: the extra is one line of [project.optional-dependencies].
    match = re.search(r"^sglang = (\[.*\])$", (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert match is not None, "pyproject.toml has no `sglang = [...]` optional dependency"
    (line,) = ast.literal_eval(match.group(1))
    requirement = Requirement(line)
    lowest, highest = protocol.SUPPORTED_SGLANG[0], protocol.SUPPORTED_SGLANG[-1]
    assert requirement.name == "sglang"
    assert all(requirement.specifier.contains(version) for version in protocol.SUPPORTED_SGLANG)
    assert not requirement.specifier.contains("0.5.14") and not requirement.specifier.contains("0.5.24")
    assert f">={lowest}" in line and f"<={highest}" in line
    assert requirement.marker is not None
    assert not requirement.marker.evaluate({"python_version": "3.10"})
    assert requirement.marker.evaluate({"python_version": "3.11"})


def test_the_compatible_server_registers_every_endpoint_of_the_table() -> None:
    for api in protocol.SUPPORTED_SGLANG:
        args = parse_args(["--model-path", "/m", "--sglang-api", api])
        app = CompatServer(engine=None, args=args, context_length=512).app()  # type: ignore[arg-type]  # routes only
        served = {(route.method, route.resource.canonical) for route in app.router.routes()}
        for endpoint in protocol.ENDPOINTS:
            expected = not endpoint.optional or Version(api) >= Version(endpoint.since or "0")
            assert ((endpoint.method, endpoint.path) in served) == expected, (api, endpoint.path)


# Each MoE family: SGLang's model file, and the tiny model whose checkpoint names our learner sends it.
MOE_MODEL_FILES = {"qwen3_moe": "sglang/srt/models/qwen3_moe.py", "mixtral": "sglang/srt/models/mixtral.py"}


@pytest.mark.parametrize("family", sorted(MOE_MODEL_FILES))
def test_moe_models_load_experts_under_the_checkpoint_names_the_learner_sends(sglang: SglangSource,
                                                                              family: str) -> None:
    """What `engines.weights.layouts.CheckpointLayout` and the stand-in server rely on: SGLang's MoE model maps
    `experts.<e>.<ckpt name>.` onto its fused `experts.w13_`/`experts.w2_` parameters (under the same module, which
    the weight check's feeders assume) and passes over a name it does not know while the update succeeds
    (transformers' stacked `experts.gate_up_proj` was one)."""
    from transformers import AutoConfig

    from engines.weights.layouts import CheckpointLayout, meta_skeleton

    layer = ast.unparse(sglang.tree("sglang/srt/layers/moe/fused_moe_triton/layer.py"))
    assert "'experts.w13_' if weight_name in [ckpt_gate_proj_name, ckpt_up_proj_name] else 'experts.w2_'" in layer
    assert "f'experts.{expert_id}.{weight_name}.'" in layer
    model = sglang.tree(MOE_MODEL_FILES[family])
    (mapping,) = [node for node in ast.walk(model) if isinstance(node, ast.Call)
                  and ast.unparse(node.func).endswith("make_expert_params_mapping")]
    names = {keyword.arg: ast.literal_eval(keyword.value) for keyword in mapping.keywords
             if keyword.arg and keyword.arg.startswith("ckpt_")}
    load = ast.unparse(next(node for node in ast.walk(model)
                            if isinstance(node, ast.FunctionDef) and node.name == "load_weights"))
    # qwen3_moe skips it silently, Mixtral with a line in the server's log; neither fails the update
    assert re.search(r"if name not in params_dict:\s+continue", load) or "not found in params_dict" in load

    experts = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts"}[family]
    hf_config = AutoConfig.for_model(family, vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts_per_tok=2,
                                     **{experts: 4})
    skeleton = meta_skeleton(hf_config)
    sent = [name for name, _ in CheckpointLayout(hf_config)(skeleton.named_parameters()) if ".experts." in name]
    assert sent and all(any(f"experts.{name.split('.experts.')[1].split('.')[0]}.{weight}." in name
                            for weight in names.values()) for name in sent), (names, sent[:6])


# ----------------------------------------------------------------------------------- FP8 checkpoints (--rollout-fp8)
FP8_METHOD = "sglang/srt/layers/quantization/fp8.py"


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == name)


def test_sglang_reads_the_quantization_config_our_fp8_checkpoints_write(sglang: SglangSource) -> None:
    """`Fp8Config.from_config` takes "fp8" in quant_method as a serialised FP8 checkpoint and reads the activation
    scheme and tile size; `fmt` (transformers') it does not read, so it cannot disagree."""
    from engines.weights import fp8

    read = _function(sglang.tree(FP8_METHOD), "from_config")
    keys = {ast.literal_eval(call.args[1])[0] for call in ast.walk(read) if isinstance(call, ast.Call)
            and ast.unparse(call.func).endswith(("get_from_keys", "get_from_keys_or"))}
    assert {"quant_method", "activation_scheme", "weight_block_size"} <= keys
    assert set(fp8.quantization_config()) - keys == {"fmt"}
    assert "is_checkpoint_fp8_serialized = 'fp8' in quant_method" in ast.unparse(read)


def test_sglang_s_block_fp8_layers_take_weight_and_weight_scale_inv_in_float32(sglang: SglangSource) -> None:
    """The names an FP8 push and checkpoint carry are the parameters SGLang's Fp8LinearMethod registers for block
    quantisation: the FP8 `weight` and, per tile, a float32 `weight_scale_inv`."""
    source = ast.unparse(sglang.tree(FP8_METHOD))
    assert "torch.float8_e4m3fn if is_checkpoint_fp8_serialized" in source.replace("self.", "")
    assert "layer.register_parameter('weight', weight)" in source
    assert "layer.register_parameter('weight_scale_inv', scale)" in source
    assert "scale_dtype = torch.uint8 if use_mxfp8 else torch.float32" in source.replace("self.", "")  # not MXFP8
    assert ("scale_init((output_size_per_partition + block_n - 1) // block_n, (input_size_per_partition + block_k - 1)"
            " // block_k, dtype=scale_dtype)") in source


def _sglang_tile_check(sglang: SglangSource) -> Callable[..., None]:
    """SGLang's `Fp8LinearMethod.validate_block_quant_shapes`, compiled from its wheel, callable with a layer's
    sizes and the tensor-parallel size."""
    from types import SimpleNamespace

    function = _function(sglang.tree(FP8_METHOD), "validate_block_quant_shapes")
    function.decorator_list = []
    namespace: dict[str, object] = {"List": list, "print_warning_once": print}
    exec(compile(ast.Module(body=[function], type_ignores=[]), FP8_METHOD, "exec"), namespace)
    validate = namespace["validate_block_quant_shapes"]

    def check(tp_size: int, **sizes: object) -> None:
        quant = SimpleNamespace(weight_block_size=[128, 128])
        namespace["get_parallel"] = lambda: SimpleNamespace(tp_size=tp_size)  # 0.5.15's source of the tp size
        stubs = {"self": SimpleNamespace(quant_config=quant), "quant_config": quant,
                 "layer": SimpleNamespace(tp_group=SimpleNamespace(world_size=tp_size))}
        names = [argument.arg for argument in function.args.args]
        validate(*(stubs[name] if name in stubs else sizes[name] for name in names if name in stubs or name in sizes))

    return check


@pytest.mark.parametrize(("shape", "tp_size"), [
    ({"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3}, 1),
    ({"hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2}, 1),
    ({"hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2}, 2),
    ({"hidden_size": 1024, "intermediate_size": 640, "num_attention_heads": 8, "num_key_value_heads": 2}, 2),
    ({"hidden_size": 1024, "intermediate_size": 640, "num_attention_heads": 8, "num_key_value_heads": 2}, 4),
    ({"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 4}, 8),
])
def test_our_fp8_tile_rule_refuses_exactly_the_layers_sglang_refuses(sglang: SglangSource, shape: dict[str, int],
                                                                     tp_size: int) -> None:
    """Each of a decoder layer's four linear layers, built as SGLang builds them (q/k/v and gate/up merged, o and
    down row-parallel), through SGLang's own check; our refusal names the same layers (SmolLM2 and the 0.5B shape
    among them)."""
    from engines.sglang.fp8_serving import block_shape_problems

    check = _sglang_tile_check(sglang)
    hidden, width = shape["hidden_size"], shape["intermediate_size"]
    heads, head_dim = shape["num_attention_heads"], hidden // shape["num_attention_heads"]
    kv = 1 if tp_size >= shape["num_key_value_heads"] else shape["num_key_value_heads"] // tp_size
    layers = {  # name: (input, input per shard, output, output parts per shard), as sglang/srt/layers/linear.py
        ("q_proj", "k_proj", "v_proj"): (hidden, hidden, (heads // tp_size + 2 * kv) * head_dim * tp_size,
                                         [heads // tp_size * head_dim, kv * head_dim, kv * head_dim]),
        ("gate_proj", "up_proj"): (hidden, hidden, 2 * width, [width // tp_size] * 2),
        ("o_proj",): (heads * head_dim, heads * head_dim // tp_size, hidden, [hidden]),
        ("down_proj",): (width, width // tp_size, hidden, [hidden]),
    }
    refused_by_sglang = set()
    for names, (inputs, input_shard, outputs, parts) in layers.items():
        try:
            check(tp_size, input_size=inputs, input_size_per_partition=input_shard, output_size=outputs,
                  output_size_per_partition=sum(parts), output_partition_sizes=parts)
        except ValueError as error:
            assert "is not divisible by weight quantization block" in str(error)
            refused_by_sglang.add(names)
    ours = " ".join(block_shape_problems(shape, tp_size, "MODEL"))
    refused_by_us = {names for names in layers if any(f".{name}.weight" in ours for name in names)}
    assert refused_by_us == refused_by_sglang


def test_sglang_checksums_a_block_fp8_weight_dequantised_to_bfloat16_with_its_scale(sglang: SglangSource) -> None:
    """What the stand-in's checksum does for its FP8 layers (tools/standins/sglang_server/checksum.py)."""
    checker = ast.unparse(sglang.tree("sglang/srt/utils/weight_checker.py"))
    assert "checksums[name] = _hash_tensor(comparable.dequantize().data)" in checker
    assert "scale = name.replace('weight', 'weight_scale_inv')" in checker
    assert re.search(r"if name in scale_names:\s+continue", checker), "the scale is hashed with its weight only"
    comparator = _function(sglang.tree("sglang/srt/utils/weight_checker_comparator.py"), "select_comparable_weight")
    assert "quant_method.block_quant" in ast.unparse(comparator)
    dequantize = next(node for node in ast.walk(sglang.tree("sglang/srt/utils/weight_checker_comparator.py"))
                      if isinstance(node, ast.ClassDef) and node.name == "Fp8BlockComparable")
    source = ast.unparse(dequantize)
    assert "def dequantize(self, dtype: torch.dtype=torch.bfloat16)" in source
    assert re.search(r"return block_quant_dequant\((self\.)?w_q, s, block_size, dtype=dtype\)", source)
