"""slime's ``load_function`` and ``SingletonMeta`` (``slime.utils.misc``), the two its example plugins use.

``load_function`` is our plugin loader, so a path a plugin loads for itself (slime's multi-agent example loads its
agent system so) accepts the spellings and gives the errors of every ``--*-path`` flag here. ``SingletonMeta`` makes
one instance per class and process; slime's plugins keep an HTTP service or a tokenizer in one.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

from policies.plugins import load_object

__all__ = ["SingletonMeta", "load_function"]


def load_function(path: str) -> Any:
    """The object ``path`` names: ``package.module.attr`` (slime's spelling) or ``package.module:attr``."""
    return load_object(path, what="load_function")


class SingletonMeta(type):
    """A class built with this metaclass is constructed once per process; later calls return that instance (their
    arguments are ignored, as slime's are). ``clear_instances()`` forgets them, for tests."""

    _instances: ClassVar[dict[type, Any]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        with SingletonMeta._lock:
            if cls not in SingletonMeta._instances:
                SingletonMeta._instances[cls] = super().__call__(*args, **kwargs)
            return SingletonMeta._instances[cls]

    def clear_instances(cls) -> None:
        SingletonMeta._instances.clear()
