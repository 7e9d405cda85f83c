"""The shape of the house, checked: layers import one way, no module imports itself back, no module grows past
600 lines. Read from the source with `ast`, so a TYPE_CHECKING-only import counts too: it is still a cycle a
reader has to untangle."""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("actors", "bus", "engines", "policies", "examples", "tools")
MAX_LINES = 600
# Which of our packages each layer may import (itself always allowed). The launcher is product: it runs every
# job, so it must not depend on a tool (a benchmark or harness may change or go without a run noticing).
ALLOWED = {
    "launcher": {"actors", "bus", "engines", "policies"},
    "bus": set(),
    "policies": {"bus"},
    "engines": {"bus", "policies"},
    "actors": {"bus", "engines", "policies"},
    "examples": {"actors", "bus", "engines", "policies"},
    "tools": {"actors", "bus", "engines", "policies", "examples", "launcher"},
}

pytestmark = pytest.mark.unit


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    modules["launcher"] = ROOT / "launcher.py"
    return modules


def parse(path: Path) -> ast.Module:
    """`ast.parse`, once more on CPython 3.11's spurious "AST constructor recursion depth mismatch" SystemError:
    under pytest-xdist a worker's other threads trip its recursion bookkeeping now and then (fixed in 3.12)."""
    source = path.read_text(encoding="utf-8")
    try:
        return ast.parse(source)
    except SystemError:
        return ast.parse(source)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """Our modules that `path` imports: `from a.b import c` names a.b.c when that is a module, else a.b."""
    found = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            candidates = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in candidates:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


@functools.cache  # parsing every module takes seconds; each rule reads the same graph and none changes it
def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    known = set(modules)
    return {name: imported_modules(path, known) - {name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path a -> b -> ... -> a, or None. Package `__init__` edges to their own children
    are skipped: re-exporting a submodule is not a cycle anyone has to reason about."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target.startswith(node + "."):
                continue
            if state.get(target) == 1:
                return [*stack[stack.index(target):], target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycle_among_project_modules() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_layers_import_only_downwards() -> None:
    wrong = []
    for module, targets in import_graph().items():
        layer = module.split(".")[0]
        for target in targets:
            target_layer = target.split(".")[0]
            if target_layer != layer and target_layer not in ALLOWED[layer]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "layering broken:\n" + "\n".join(sorted(wrong))


# The roles of actors/: each folder is one role's process. A role reaches another only over the bus, never by
# importing its folder; what several roles share lives in a shared folder, and a shared folder imports no role.
ROLE_FOLDERS = {"buffer", "controller", "evaluator", "learner", "reward", "rollout"}
SHARED_FOLDERS = {"config", "data", "extensions", "launch", "report", "runtime", "slime_compat"}
ROLE_IMPORTERS = {"actors.plugins"}  # the plugin surface re-exports the rollout API users write against


def test_roles_import_no_other_role_and_shared_folders_import_none() -> None:
    wrong = []
    for module, targets in import_graph().items():
        parts = module.split(".")
        if parts[0] != "actors" or len(parts) < 2 or module in ROLE_IMPORTERS:
            continue
        for target in targets:
            target_parts = target.split(".")
            if target_parts[0] != "actors" or len(target_parts) < 2 or target_parts[1] == parts[1]:
                continue
            if target_parts[1] in ROLE_FOLDERS and (parts[1] in ROLE_FOLDERS or parts[1] in SHARED_FOLDERS):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "a role's folder imported from outside it (move the shared part to a shared folder):\n" + (
        "\n".join(sorted(wrong)))


# actors/runtime/ is the floor every actor process stands on; starting a node's processes (actors/launch/) and the
# end-of-run report (actors/report/) are the launcher's rooms above it. User tools may read them (tools/plot_run.py
# draws a finished run's plots with the report's code); no actor process has a reason to load them.
LAUNCHER_ROOMS = ("actors.launch", "actors.report")
LAUNCHER_ROOM_IMPORTERS = ("launcher", "tools")


def in_room(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def launcher_room_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports of actors.launch or actors.report from anything but the launcher, a tool, or the room itself."""
    return sorted(f"{module} imports {target}" for module, targets in graph.items()
                  if not any(in_room(module, outside) for outside in LAUNCHER_ROOM_IMPORTERS)
                  for target in targets for room in LAUNCHER_ROOMS
                  if in_room(target, room) and not in_room(module, room))


def runtime_floor_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports from actors.runtime up into the launcher's rooms."""
    return sorted(f"{module} imports {target}" for module, targets in graph.items()
                  if in_room(module, "actors.runtime")
                  for target in targets if any(in_room(target, room) for room in LAUNCHER_ROOMS))


def test_only_the_launcher_and_tools_import_launch_and_report() -> None:
    wrong = launcher_room_violations(import_graph())
    assert not wrong, "actors.launch and actors.report are the launcher's (move what a role needs to actors.runtime " \
        "or a shared folder):\n" + "\n".join(wrong)


def test_runtime_imports_neither_launch_nor_report() -> None:
    wrong = runtime_floor_violations(import_graph())
    assert not wrong, "actors.runtime is the floor every actor process loads:\n" + "\n".join(wrong)


def test_room_checkers_find_planted_violations() -> None:
    """The checkers themselves: a role importing launch code, the runtime importing the report, and a runtime module
    importing launch code are reported; the launcher, a tool and a room importing itself are not."""
    planted = {
        "actors.rollout.actor": {"actors.launch.placement", "actors.runtime.base"},
        "actors.runtime.main": {"actors.report.progress", "actors.launch.zygote"},
        "actors.launch.supervisor": {"actors.launch.zygote_client", "actors.runtime.exits"},
        "launcher": {"actors.launch.supervisor", "actors.report.run_report"},
        "tools.plot_run": {"actors.report.run_report"},
    }
    assert launcher_room_violations(planted) == [
        "actors.rollout.actor imports actors.launch.placement", "actors.runtime.main imports actors.launch.zygote",
        "actors.runtime.main imports actors.report.progress"]
    assert runtime_floor_violations(planted) == [
        "actors.runtime.main imports actors.launch.zygote", "actors.runtime.main imports actors.report.progress"]


# Where slime's conventions may not reach: the roles run our plugin types only, and the floors below actors/ (the
# algorithms, the wire, the engines) know nothing of slime. slime's plugins and switches are converted at the edge
# (`actors.extensions.load`, `actors.config.slime_flags`, `actors.slime_compat`).
SLIME_FREE_PACKAGES = ("bus", "engines", "policies")


def slime_free(module: str) -> bool:
    parts = module.split(".")
    return parts[0] in SLIME_FREE_PACKAGES or (len(parts) > 1 and parts[0] == "actors" and parts[1] in ROLE_FOLDERS)


def slime_compat_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} imports {target}" for module, targets in graph.items() if slime_free(module)
                  for target in targets if target.startswith("actors.slime_compat"))


def test_no_role_imports_slime_compat() -> None:
    """slime's plugins are converted into our plugin types at load time (`actors.extensions.load`): a role runs
    our types only, whichever convention the user's plugin was written in; nor does anything below actors/."""
    wrong = slime_compat_imports(import_graph())
    assert not wrong, "imports slime_compat outside the edge:\n" + "\n".join(wrong)


def slime_names(tree: ast.Module) -> list[str]:
    """The names a module defines that speak of slime (functions, classes, variables and constants, arguments,
    import aliases, attributes set), and the strings that name the compat package (an import by string)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names = [node.id]
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names = [node.attr]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.alias):
            names = [node.asname or node.name]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "slime_compat" in node.value:
            names = [node.value]
        else:
            continue
        found += [f"line {node.lineno}: {name}" for name in names if "slime" in name.lower()]
    return found


def test_policies_bus_and_engines_name_nothing_after_slime() -> None:
    """A slime adapter in the algorithms' registry, or a table of slime's switches beside their config, is slime
    inside the house: it goes to the edge, converted into our types when a plugin loads."""
    wrong = [f"{name}: {where}" for name, path in project_modules().items()
             if name.split(".")[0] in SLIME_FREE_PACKAGES for where in slime_names(parse(path))]
    assert not wrong, "slime's conventions named below actors/ (move them to actors/slime_compat):\n" + (
        "\n".join(wrong))


def test_slime_checks_find_a_planted_violation() -> None:
    """The checkers themselves: a slime name or a compat import planted in policies/ or a role is reported; the
    same at the edge is not."""
    planted = ast.parse("from actors.slime_compat import x as y\n"
                        "SLIME_SWITCHES = {}\n"
                        "def _is_slime_loss(args): ...\n"
                        "class SlimeLoss: ...\n"
                        "def f(slime_args): importlib.import_module('actors.slime_compat.losses')\n")
    assert sorted(line.split(": ", 1)[1] for line in slime_names(planted)) == sorted([
        "actors.slime_compat", "SLIME_SWITCHES", "_is_slime_loss", "SlimeLoss", "slime_args",
        "actors.slime_compat.losses"])
    assert slime_names(ast.parse("def eps_clip(args): return 'slime does not clamp'\n")) == []
    graph = {"policies.registry": {"actors.slime_compat.losses"}, "actors.learner.step": {"actors.slime_compat"},
             "bus.schema": {"bus.schema_base"}, "actors.extensions.load": {"actors.slime_compat.losses"}}
    assert slime_compat_imports(graph) == ["actors.learner.step imports actors.slime_compat",
                                           "policies.registry imports actors.slime_compat.losses"]


# Evaluation is a role: no other module branches on it. These names carry eval control flow (rounds, their progress,
# an eval-only lease, the group id's "eval:" prefix); they may appear only in the evaluator's folder and the wire
# schema. `is_eval` is a group's property (its sampling and its reward key), read only where those are chosen.
EVAL_NAMES = {"eval_only", "eval_done_through", "EvalProgress", "EvalProgressQuery", "EvalRounds", "EvalRound",
              "EvalHold", "eval_due", "next_due", "round_due", "eval_group_id", "eval_round_of", "eval_version",
              "take_eval_groups", "held_for_eval", "poll_eval_progress", "is_eval"}
EVAL_HOMES = ("actors.evaluator", "bus.schema")
IS_EVAL_READERS = ("actors.rollout.generate", "actors.rollout.actor", "actors.reward.actor", "actors.slime_compat")
PRODUCT = ("actors", "bus", "engines", "policies", "launcher")


def eval_references(module: str, tree: ast.Module) -> list[str]:
    """Where `module` names evaluation outside its homes: an EVAL_NAMES identifier (a name, attribute, keyword,
    definition or imported name), an import of the evaluator's folder, or a string starting "eval:"."""
    if module.startswith(EVAL_HOMES):
        return []
    allowed = {"is_eval"} if module.startswith(IS_EVAL_READERS) else set()
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.keyword) and node.arg:
            names = [node.arg]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.arg)):
            names = [node.name if not isinstance(node, ast.arg) else node.arg]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [alias.asname or alias.name for alias in node.names]
            source = node.module if isinstance(node, ast.ImportFrom) else None
            imported = [source or "", *(alias.name for alias in node.names)]
            if any(name.startswith(EVAL_HOMES[0]) for name in imported):
                found.append(f"{module}:{node.lineno} imports {EVAL_HOMES[0]}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("eval:"):
            found.append(f"{module}:{node.lineno} {node.value!r}")
        found += [f"{module}:{getattr(node, 'lineno', '?')} {name}" for name in names
                  if name in EVAL_NAMES and name not in allowed]
    return found


def test_no_eval_branch_outside_the_evaluator_and_the_schema() -> None:
    wrong = [ref for name, path in project_modules().items() if name.startswith(PRODUCT)
             for ref in eval_references(name, parse(path))]
    assert not wrong, "evaluation named outside actors/evaluator/ and bus/schema.py:\n" + "\n".join(sorted(wrong))


@pytest.mark.parametrize("planted", [
    "if request.eval_only:\n    pass",
    "from actors.evaluator.rounds import next_due",
    "import actors.evaluator",
    "is_eval = group.group_id.startswith('eval:')",
    "def serve(self, query: EvalProgressQuery) -> None: ...",
    "Batch(batch_id=1, samples=[], staleness=[], eval_done_through=-1)",
    "training = [g for g in groups if not g.is_eval]",
])
def test_the_eval_rule_finds_a_planted_eval_branch(planted: str) -> None:
    assert eval_references("actors.buffer.core", ast.parse(planted))
    assert not eval_references("actors.evaluator.actor", ast.parse(planted))


def test_no_module_over_600_lines() -> None:
    long = {name: n for name, path in project_modules().items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


# The tools a user runs by name stay at the top of tools/; every harness lives in its family's folder.
USER_TOOLS = {"agent_demo", "audit_run", "convert_checkpoint", "demo", "evaluate", "keygen", "make_arithmetic_data",
              "plot_run", "repo_env", "run_watch", "demo_policies", "demo_vlm", "make_shape_data", "slime_scripts",
              "convert_fp8"}


def test_tools_are_grouped_by_family_and_user_tools_stay_at_the_top() -> None:
    flat = {path.stem for path in (ROOT / "tools").glob("*.py")} - {"__init__"}
    assert flat == USER_TOOLS, f"a new harness goes in its family's folder, a new user tool in USER_TOOLS: {flat}"
    for folder in (path for path in (ROOT / "tools").iterdir() if path.is_dir() and path.name != "__pycache__"):
        assert (folder / "__init__.py").exists(), f"{folder}: a family is a package: python -m tools.FAMILY.NAME"


def test_no_tool_shadows_a_package_when_run_by_its_path() -> None:
    """A tool run by its path (`python tools/evaluate.py`) has its folder first on sys.path, so a file there named like
    one of our packages or a standard-library module would be imported in its place."""
    taken = set(PACKAGES) | {"launcher"} | set(sys.stdlib_module_names)
    shadowing = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "tools").rglob("*.py")
                       if path.stem in taken)
    assert not shadowing, f"rename these: {shadowing}"


# Tools run as modules from the repository (`python -m tools.FAMILY.NAME`), so none puts the repository on sys.path.
# The edits left are not the repository: the GPU check installs a folder of carried wheels and must import them, and
# the slime-scripts check puts a slime checkout's plugin folders there while it checks a script, as its PYTHONPATH.
SYS_PATH_EDITS_ALLOWED = {("tools/gpu/check.py", "install_wheels"), ("tools/slime_scripts.py", "slime_pythonpath")}


def sys_path_edits(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, enclosing function or "<module>") of each change to `sys.path` (a mutating call, an assignment to it or
    to a slice of it) and each `site.addsitedir` call."""
    def is_sys_path(node: ast.AST | None) -> bool:
        return node is not None and (ast.unparse(node) == "sys.path" or ast.unparse(node).startswith("sys.path["))

    def is_edit(node: ast.AST) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            return ast.unparse(node.func) == "site.addsitedir" or (
                is_sys_path(node.func.value) and node.func.attr in {"insert", "append", "extend", "remove", "pop",
                                                                     "clear"})
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        return isinstance(node, (ast.Assign, ast.AugAssign)) and any(is_sys_path(target) for target in targets)

    def edits(node: ast.AST, where: str) -> list[tuple[int, str]]:
        found = []
        for child in ast.iter_child_nodes(node):
            scope = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            if is_edit(child):
                found.append((child.lineno, scope))
            found += edits(child, scope)
        return found

    return edits(tree, "<module>")


def test_no_tool_edits_sys_path() -> None:
    found = sorted(f"{path.relative_to(ROOT).as_posix()}:{line} ({where})"
                   for path in (ROOT / "tools").rglob("*.py") for line, where in sys_path_edits(parse(path))
                   if (path.relative_to(ROOT).as_posix(), where) not in SYS_PATH_EDITS_ALLOWED)
    assert not found, "run the tool as `python -m tools.FAMILY.NAME` instead of editing sys.path:\n" + "\n".join(found)


def test_sys_path_edit_finder_finds_planted_edits() -> None:
    planted = ast.parse("import site, sys\nsys.path.insert(0, 'x')\n\ndef f():\n    sys.path.append('y')\n"
                        "    site.addsitedir('z')\nsys.path = ['w']\nsys.path[:] = []\nsys.path += ['v']\n"
                        "print(sys.path[0], 'x' in sys.path, sys.path.index('x'))\n")
    assert sys_path_edits(planted) == [(2, "<module>"), (5, "f"), (6, "f"), (7, "<module>"), (8, "<module>"),
                                       (9, "<module>")]


def test_gpu_tests_live_in_gpu_test_files() -> None:
    """`tools/gpu/check.py` runs `pytest -m gpu` over the `test_*_gpu.py` files only: a `gpu` test elsewhere would
    never run on a GPU machine."""
    marked = {path.relative_to(ROOT).as_posix() for path in (ROOT / "tests").rglob("test_*.py")
              if path != Path(__file__) and "mark.gpu" in path.read_text(encoding="utf-8")}
    assert marked, "no gpu-marked test found: the check reads the wrong files"
    assert sorted(path for path in marked if not path.endswith("_gpu.py")) == []


def test_cycle_finder_finds_a_cycle() -> None:
    """The checker itself: a planted two-module cycle is reported, a package re-exporting its child is not."""
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"pkg": {"pkg.child"}, "pkg.child": {"pkg"}}) is None


# Traits read, not name tables: what a built-in engine or training backend is lives in its spec
# (actors/config/engines.py); anywhere else in product, a `rollout_engine == "sglang"`, a `train_backend != "torch"`
# or a spelled ("torch", "sglang") is a second source of truth that the next built-in would have to find and edit.
ENGINE_SPEC_MODULE = "actors.config.engines"
PRODUCT = ("actors", "bus", "engines", "policies", "launcher")


def engine_name_tables(tree: ast.AST, *kinds: set[str]) -> list[int]:
    """Lines that compare a rollout engine or training backend setting with a string literal (or literals), or
    spell two or more built-in names of one kind (`kinds`: the rollout engines', the training backends') in one
    literal collection."""
    def literals(node: ast.expr) -> list[str] | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            values = [element.value for element in node.elts
                      if isinstance(element, ast.Constant) and isinstance(element.value, str)]
            return values if len(values) == len(node.elts) else None
        return None

    def names_engine(node: ast.expr) -> bool:
        settings = ("rollout_engine", "train_backend")
        return (isinstance(node, ast.Attribute) and node.attr in settings) or (
            isinstance(node, ast.Name) and node.id in settings)

    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(names_engine(operand) for operand in operands) and any(
                    literals(operand) is not None for operand in operands):
                lines.add(node.lineno)
        elif isinstance(node, ast.Tuple | ast.List | ast.Set) and any(
                len(set(literals(node) or ()) & names) >= 2 for names in kinds):
            lines.add(node.lineno)
    return sorted(lines)


def test_engine_traits_are_read_not_spelled_as_name_tables() -> None:
    from actors.config.engines import BUILTIN_ENGINES, BUILTIN_TRAIN_BACKENDS

    found = [f"{module}:{line}" for module, path in project_modules().items()
             if module.split(".")[0] in PRODUCT and module != ENGINE_SPEC_MODULE
             for line in engine_name_tables(parse(path), set(BUILTIN_ENGINES), set(BUILTIN_TRAIN_BACKENDS))]
    assert not found, f"engine names spelled outside {ENGINE_SPEC_MODULE} (read the engine's spec instead): {found}"


@pytest.mark.parametrize("planted", [
    'if config.engine.rollout_engine == "sglang": pass',
    'if rollout_engine not in ("torch", "sglang"): pass',
    'if "torch" != self.config.engine.rollout_engine: pass',
    'BUILTIN = ["sglang", "torch"]',
    'if config.trainer.train_backend == "torch": pass',
    'BACKENDS = ("torch", "megatron")',
])
def test_engine_name_table_finder_finds_a_planted_table(planted: str) -> None:
    assert engine_name_tables(ast.parse(planted), {"torch", "sglang"}, {"torch", "megatron"}) == [1]


def test_engine_name_table_finder_passes_trait_reads() -> None:
    clean = ('spec = engine_spec(config.engine.rollout_engine)\nif spec is not None and spec.colocatable: pass\n'
             'backend = train_backend_spec(config.trainer.train_backend)\nif backend and backend.critic: pass\n'
             'opd_type: Literal["sglang", "megatron"]')  # one engine's and one backend's name: another setting's words
    assert engine_name_tables(ast.parse(clean), {"torch", "sglang"}, {"torch", "megatron"}) == []
