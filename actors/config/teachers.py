"""The run's distillation teachers, by name, and which teacher each prompt has.

One rule read by both the reward worker (which asks the engine teachers to score) and the learner (which scores
with the teachers it holds), so the two never disagree about a sample's teacher.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from actors.config.sections import DistillationConfig, teacher_entry

DEFAULT_TEACHER = "teacher"  # the name of slime's single teacher (--opd-teacher-load, or the --rm-url server)


@dataclass(frozen=True)
class Teacher:
    """One teacher: `url` set for an engine of its own (an SGLang-compatible server), else `path`, a model folder
    the learner loads."""

    name: str
    url: str | None = None
    path: str | None = None

    @property
    def in_learner(self) -> bool:
        return self.url is None


def run_teachers(settings: DistillationConfig) -> dict[str, Teacher]:
    """Every teacher of the run by name (`RunConfig.distillation`); empty without distillation settings."""
    teachers: dict[str, Teacher] = {}
    if settings.opd_teacher_load is not None:
        teachers[DEFAULT_TEACHER] = Teacher(DEFAULT_TEACHER, path=settings.opd_teacher_load)
    for entry in settings.opd_teacher:
        name, source = teacher_entry(entry)
        if name in teachers:
            raise ValueError(f"--opd-teacher {entry!r}: {name!r} is also --opd-teacher-load's name")
        is_url = source.startswith(("http://", "https://"))
        teachers[name] = Teacher(name, url=source.rstrip("/") if is_url else None, path=None if is_url else source)
    return teachers


def teacher_of(metadata: Mapping[str, Any], teachers: Mapping[str, Teacher], key: str | None) -> Teacher:
    """The teacher of a sample whose dataset extras are `metadata`; a ValueError names the field and the value."""
    if key is None:
        if len(teachers) != 1:
            raise ValueError(f"{len(teachers)} teachers ({', '.join(teachers)}) need --opd-teacher-key to pick one")
        return next(iter(teachers.values()))
    name = metadata.get(key)
    if name not in teachers:
        shown = "missing" if name is None else repr(name)
        raise ValueError(f"the prompt's teacher field {key!r} is {shown}; teachers: {', '.join(teachers)}")
    return teachers[name]
