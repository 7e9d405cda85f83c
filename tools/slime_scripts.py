"""Does every run script of a slime checkout pass our launcher's configuration and preflight? One row per script.

    python -m tools.slime_scripts SLIME_CHECKOUT [--markdown slime-scripts.md] [--only NAME]

SLIME_CHECKOUT is slime's repository: a work tree, or a bare git clone (its HEAD is read). For every run script
(scripts/run-*.sh, scripts/low_precision/*.sh, examples/**.sh):
1. its `python3 train.py ...` command line is captured by running the script under bash with every command it
   would start recorded instead (`tools/slime_checkout/capture.py`: nothing starts, nothing is written outside a
   temporary folder);
2. a tiny model of its family, stand-in data files and one-device sizes are substituted
   (`tools/slime_checkout/standins.py` says what and why);
3. `launcher.prepare` runs on it as `python launcher.py --head --slime-entry ENTRY ...` would: the configuration
   (slime's flags read, translated, explained or refused), preflight (data, model folders, plugins) and placement,
   then the learner's model checks (`engines.megatron.model_flags`: the model flags against the checkpoint, and
   what the train backend refuses). No actor starts and nothing trains. Its plugins are imported with the
   checkout's `examples` and the script's folder on the path, as slime's scripts set PYTHONPATH, and without slime
   installed: their `slime.*` imports are answered by `actors.slime_compat.imports`.

A script's configuration-and-preflight result is `ok`, `refused: FLAG: reason; ...` (slime flags refused by
`actors/config/slime_table.py`), `plugin: ...` (a plugin of slime's checkout that does not import here, and why:
a package it needs that is not installed, a slime module not offered), or `error: ...`
(anything else: the first problem); the learner's column is `ok`, `refused: ...` or `-` (not reached). The table
is printed and, with --markdown, written as markdown (docs/slime.md holds the one from slime's own repository).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import pkgutil
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tools.slime_checkout.capture import Captured, capture, export_checkout, run_scripts
from tools.slime_checkout.standins import family_of, substitute

REFUSED = re.compile(r"slime flag\(s\) not supported: (.*)", re.DOTALL)


@dataclass
class Row:
    """A script's row: `launcher` is what configuration and preflight say, `learner` what the learner's model
    checks say (`-` where the launcher stopped it first)."""

    script: str
    family: str
    launcher: str
    learner: str
    notes: str

    @property
    def passed(self) -> bool:
        return self.launcher == "ok"

    def markdown(self) -> str:
        cells = (self.script, self.family, self.launcher, self.learner, self.notes)  # slime's paths: not ours
        return "| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="slime's repository (a work tree or a bare git clone)")
    parser.add_argument("--markdown", type=Path, help="also write the table here, as markdown")
    parser.add_argument("--only", help="only the scripts whose path contains this")
    parser.add_argument("--cache", type=Path, help="where the tiny models are built (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="slime-scripts-") as folder:
        rows = check_checkout(args.checkout, Path(folder), cache=args.cache, only=args.only)
    table = markdown_table(rows)
    print(table)
    if args.markdown is not None:
        args.markdown.write_text(table + "\n", encoding="utf-8")
    return 0 if all(row.passed for row in rows) else 1


def check_checkout(checkout: Path, work: Path, *, cache: Path | None = None, only: str | None = None) -> list[Row]:
    """A row per run script of `checkout` (exported under `work`, where each script also gets its sandbox)."""
    exported = export_checkout(checkout, work)
    rows = []
    for index, script in enumerate(run_scripts(exported)):
        if only is None or only in script.as_posix():
            rows.append(check_script(exported, script, work / f"script-{index}", cache=cache or work / "models"))
    return rows


def check_script(checkout: Path, script: Path, sandbox: Path, *, cache: Path) -> Row:
    captured = capture(checkout, script, sandbox / "bash")
    if captured.entry is None:
        why = captured.stderr.strip().splitlines()[-1:] or ["no output"]
        return Row(script.as_posix(), "-", f"error: no train.py command line was run ({why[0]})", "-",
                   "; ".join(captured.notes))
    family = family_of(captured.sourced, captured.argv)
    substituted = substitute(captured.argv, family, checkout=checkout, sandbox=sandbox, cache=cache,
                             arities=_arities())
    with slime_pythonpath(checkout, script, sandbox):
        launcher, learner = launch_check(captured, substituted.argv, substituted.model, sandbox / "run")
    if launcher.startswith("error: ") and (plugin := _slime_plugin(launcher, checkout, script)) is not None:
        launcher = f"plugin: {plugin}"
    # the table reads the same wherever it was made
    launcher, learner = (text.replace(str(cache), "TINY_MODELS").replace(str(sandbox), "SANDBOX")
                         for text in (launcher, learner))
    return Row(script.as_posix(), substituted.family, launcher, learner,
               "; ".join([*captured.notes, *substituted.notes]))


@contextlib.contextmanager
def slime_pythonpath(checkout: Path, script: Path, sandbox: Path) -> Iterator[None]:
    """What slime's run scripts put on PYTHONPATH for their plugins, for the duration of one script's check: the
    checkout root (for its `examples` package, which joins ours: `examples/__init__.py`) and the script's folder.
    Of the root only `examples` is put there, linked from `sandbox`: a slime user's Slipstream run has no slime
    installed, so the plugins' `slime.*` imports are answered by `actors.slime_compat.imports`, which would rightly
    step aside for the checkout's own `slime/`. What was imported from those folders is forgotten afterwards, so no
    script sees another's modules."""
    import examples

    root = sandbox / "pythonpath"
    root.mkdir(parents=True, exist_ok=True)
    (root / "examples").symlink_to(checkout / "examples", target_is_directory=True)
    folders = [str(root), str(checkout / script.parent)]
    saved_path, saved_examples = list(sys.path), list(examples.__path__)
    sys.path[1:1] = folders  # after the working directory, before the installed packages, as PYTHONPATH is
    examples.__path__ = pkgutil.extend_path(examples.__path__, examples.__name__)  # as at a start with them there
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path[:] = saved_path
        examples.__path__ = saved_examples
        for name, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", None) or "").startswith(tuple(folders)):
                del sys.modules[name]


def launch_check(captured: Captured, argv: list[str], model: Path, run_dir: Path) -> tuple[str, str]:
    """What `launcher.py --head --slime-entry ENTRY ARGV` says before it would start any actor, and what the
    learner's model checks say: `ok`, or the problems in the words of the table's columns."""
    from actors.launch.node_roles import LaunchError
    from launcher import prepare

    environment = dict(os.environ)  # slime's --wandb-key and friends set the actors' environment here
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            contexts, _, _ = prepare(["--head", "--slime-entry", str(captured.entry), *argv, "--run-dir",
                                      str(run_dir)])
    except LaunchError as error:
        return _launch_result(str(error)), "-"
    except SystemExit:
        said = [line for line in stderr.getvalue().splitlines() if "error:" in line]
        return "error: " + (said[0].split("error:", 1)[1].strip() if said else "the launcher's parser exited"), "-"
    finally:
        os.environ.clear()
        os.environ.update(environment)
    learner = next(context for context in contexts if context.role == "learner")
    try:
        learner_check(learner.settings.run, model)
    except ValueError as error:
        return "ok", f"refused: {error}"
    return "ok", "ok"


def learner_check(config: object, model: Path) -> None:
    """The learner's start-up checks of the `megatron` section (`actors/learner/trainer_factory.py` and the
    Megatron bridge make them): what the train backend refuses, then the model flags against the checkpoint."""
    from transformers import AutoConfig

    from engines.megatron.model_flags import check_against_hf, refuse_unsupported

    flags = config.megatron.set_flags()  # type: ignore[attr-defined]
    refuse_unsupported(flags, megatron_core=config.trainer.train_backend == "megatron")  # type: ignore[attr-defined]
    check_against_hf(flags, AutoConfig.from_pretrained(model).get_text_config())


def _launch_result(message: str) -> str:
    refused = REFUSED.search(message)
    if refused is None:
        lines = [line.strip() for line in message.splitlines() if line.strip()]
        return "error: " + (lines[1] if len(lines) > 1 and "configuration problem" in lines[0] else lines[0])
    return "refused: " + refused.group(1).strip()


def _slime_plugin(result: str, checkout: Path, script: Path) -> str | None:
    """`FLAG MODULE (PATH in slime's checkout): WHY` when the plugin the launcher could not import is a module of
    slime's checkout (beside the script, or under its root, both on the path as slime's scripts put them): WHY is what
    stopped its import, a package it needs that is not installed or a slime module not offered here."""
    missing = re.search(r"(--[a-z-]+) .*?cannot import module '([\w.]+)': (.*)", result, re.DOTALL)
    if missing is None:
        return None
    flag, module, why = missing.groups()
    relative = module.replace(".", "/")
    for root in (checkout, checkout / script.parent):
        for candidate in (root / f"{relative}.py", root / relative / "__init__.py"):
            if candidate.is_file():
                return f"{flag} {module} ({candidate.relative_to(checkout)} in slime's checkout): {why}"
    return None


def _arities() -> dict[str, int | None]:
    """Each launcher flag's number of values (None: one or more), as slime's flags are read here."""
    from launcher import build_parser

    arities: dict[str, int | None] = {}
    for action in build_parser()._actions:
        nargs = action.nargs
        arity = 1 if nargs is None else nargs if isinstance(nargs, int) else None
        arities.update(dict.fromkeys(action.option_strings, arity))
    return arities


def markdown_table(rows: list[Row]) -> str:
    passed = sum(row.passed for row in rows)
    learned = sum(row.learner == "ok" for row in rows)
    head = ["| script | family | configuration and preflight | learner's model checks | substitutions and notes |",
            "| --- | --- | --- | --- | --- |"]
    return "\n".join([*head, *(row.markdown() for row in rows), "",
                      f"{passed} of {len(rows)} scripts pass configuration and preflight; {learned} pass the "
                      "learner's model checks too."])


if __name__ == "__main__":
    sys.exit(main())
