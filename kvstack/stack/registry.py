"""The registry of stage kinds: the only way the stack meets stages.

Stages register themselves with :func:`register_stage`; :func:`stage_specs` imports every module of
``kvstack.stages`` once (adding a stage is adding one file) and returns the registered spec classes. A stage defined
outside the package registers the same way, at any time: the spec's union of stage kinds is rebuilt, so YAML and
dicts with its ``kind`` load like the built-in ones.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, TypeVar

from .base import StageSpec

_STAGES: dict[str, type[StageSpec]] = {}
_loaded = False
#: called after a kind is added or removed once the built-in stages are loaded (the spec rebuilds its stage union)
_LISTENERS: list[Callable[[], None]] = []

S = TypeVar("S", bound=type[StageSpec])


def register_stage(cls: S) -> S:
    """Class decorator: register a ``StageSpec`` subclass under its ``kind`` literal."""
    kind_field = cls.model_fields.get("kind")
    kind = kind_field.default if kind_field is not None else None
    if not isinstance(kind, str):
        raise TypeError(f"{cls.__name__} must declare kind: Literal['name'] = 'name'")
    if kind in _STAGES and _STAGES[kind] is not cls:
        raise TypeError(f"stage kind {kind!r} registered twice ({_STAGES[kind].__name__}, {cls.__name__})")
    _STAGES[kind] = cls
    _changed()
    return cls


def unregister_stage(kind: str) -> None:
    """Remove a stage kind registered from outside the package (tests, plugins being unloaded)."""
    _STAGES.pop(kind, None)
    _changed()


def on_change(listener: Callable[[], None]) -> None:
    _LISTENERS.append(listener)


def _changed() -> None:
    if _loaded:
        for listener in _LISTENERS:
            listener()


def load_builtin_stages() -> None:
    global _loaded
    if _loaded:
        return
    import kvstack.stages as pkg

    for info in pkgutil.walk_packages(pkg.__path__, prefix="kvstack.stages."):
        importlib.import_module(info.name)
    _loaded = True


def stage_specs() -> dict[str, type[StageSpec]]:
    load_builtin_stages()
    return dict(sorted(_STAGES.items()))
