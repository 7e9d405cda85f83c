"""The tiny-model cache under concurrent builders: test workers and tools share `.cache/models`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.integration
def test_two_processes_building_the_same_cached_model_both_get_it(tmp_path) -> None:
    """Test workers and tools share `.cache/models`: a second builder used to fail renaming onto the first's."""
    script = ("import sys; from tools.standins.tiny_model import cached_tiny_model, TinyModelSpec; "
              "print(cached_tiny_model(sys.argv[1], TinyModelSpec(hidden_size=32, intermediate_size=64)))")
    builders = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [builder.communicate(timeout=120) for builder in builders]
    assert all(builder.returncode == 0 for builder in builders), [err[-800:] for _, err in results]
    (built,) = {out.strip() for out, _ in results}
    assert (Path(built) / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == [Path(built).name], "a staging folder was left behind"
