"""The distillation section (where on-policy distillation's teachers live), the run's teachers by name, and which
teacher each prompt has.

One rule read by both the reward worker (which asks the engine teachers to score) and the learner (which scores
with the teachers it holds), so the two never disagree about a sample's teacher.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator

from actors.config.sections import Section

DEFAULT_TEACHER = "teacher"  # the name of slime's single teacher (--opd-teacher-load, or the --rm-url server)


class DistillationConfig(Section):
    """Where on-policy distillation's teachers live (its math is the policy's --use-opd / --opd-kl-coef).

    A teacher is either held by the learner (a model folder, scored like the reference model, beside training) or
    an engine of its own (an SGLang server, or ours, scoring each sample's tokens through `/generate` when the
    reward worker scores it), so a teacher larger than the learner's memory can live on its own GPUs. Several
    teachers: each prompt's `--opd-teacher-key` field names its teacher."""

    opd_type: Literal["sglang", "megatron"] | None = Field(
        None, description="slime's teacher placement: 'megatron' = the learner holds --opd-teacher-load, 'sglang' = "
        "a teacher server scores during rollout (--rm-url with slime's OPD reward function, or --opd-teacher)")
    opd_teacher_load: str | None = Field(None, description="the learner's teacher, named 'teacher': a Hugging Face "
                                         "folder of the same tokenizer (tools/convert_checkpoint.py megatron-to-hf "
                                         "turns slime's Megatron checkpoint into one)")
    opd_teacher: list[str] = Field(default_factory=list, description="NAME=SOURCE ...: each SOURCE is a model "
                                   "folder (held by the learner) or the http(s) URL of an SGLang-compatible server "
                                   "(an engine of its own)")
    opd_teacher_key: str | None = Field(None, description="dataset field naming each prompt's teacher (default: "
                                        "every prompt has the one teacher)")
    opd_teacher_timeout: float = Field(60.0, gt=0, description="seconds a teacher server may take to score one "
                                       "sample before the sample fails")

    @field_validator("opd_teacher")
    @classmethod
    def _named_sources(cls, entries: list[str]) -> list[str]:
        names = [teacher_entry(entry)[0] for entry in entries]
        if len(set(names)) != len(names):
            raise ValueError(f"opd_teacher: a name is given twice in {entries}")
        return entries


def teacher_entry(entry: str) -> tuple[str, str]:
    """`NAME=SOURCE` -> (name, source); the error names the entry and the expected form."""
    name, equals, source = entry.partition("=")
    if not equals or not name.strip() or not source.strip() or "/" in name:
        raise ValueError(f"--opd-teacher {entry!r}: expected NAME=SOURCE (a model folder or an http(s) URL)")
    return name.strip(), source.strip()


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
