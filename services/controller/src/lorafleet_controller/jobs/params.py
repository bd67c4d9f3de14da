"""A job's parameters: juno's flags as named values, with their rules, parsed once.

Parameters arrive as text (a query string, or JSON scalars the gateway turned into text) and
are parsed here, the one owner of their names, defaults and ranges, before anything is
written or trained: an unknown name, a value of the wrong type or out of range is an
`InvalidArgument` naming the parameter. Defaults are juno's (its `LoraCliOptions`, design
-lessons §11): learning rate 1e-4, rank 8 with alpha = rank, A-only weight decay 0.01, seed
42, loss targets 1.2 for Q&A and 1.8 for text, 50 passes, the 0.25 low-loss guard, 32-token
windows, clipping at 1.0, a constant schedule (juno's `cosine` is our `warmup_cosine`). Two
differ on purpose, listed in `JUNO_DEVIATIONS`.

Some parameters shape the adapter (rank, alpha, targets, dropout, LoRA+ ratio): they apply
when the job creates its run, and a job on an existing run may not ask for different ones
(`LORA_SHAPE`). The seed both initialises a new adapter and orders the job's data.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any, TypeVar

from lorafleet import contract, names
from lorafleet.errors import InvalidArgument


class JobKind(StrEnum):
    QA = "qa"  # Q&A facts: four chat-templated phrasings each, completion-only loss
    TEXT = "text"  # documents: truncated-BPTT windows, loss on every token
    SAVE = "save"  # save the adapter (a saved state, downloadable as a PEFT folder)


class Schedule(StrEnum):
    CONSTANT = "constant"
    WARMUP_COSINE = "warmup_cosine"


# Other names a schedule is accepted by: juno's `--lora-lr-schedule cosine` is warmup-cosine
# (with `warmup_steps` 0 by default, a plain half cosine).
SCHEDULE_ALIASES: Mapping[str, Schedule] = {"cosine": Schedule.WARMUP_COSINE}


ALL_TARGETS = "all"
DEFAULT_RANK = 8  # juno's


@dataclass(frozen=True)
class JobParams:
    """Every parameter of a job, defaults filled in (see `parse`)."""

    learning_rate: float = 1e-4
    rank: int = DEFAULT_RANK
    alpha: float = float(DEFAULT_RANK)  # `parse` makes an unset alpha the rank (juno: scale 1)
    targets: tuple[str, ...] = (ALL_TARGETS,)
    dropout: float = 0.0
    seed: int = 42
    lora_plus_ratio: float = 1.0
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    gradient_accumulation: int = 1
    schedule: Schedule = Schedule.CONSTANT
    warmup_steps: int = 0
    min_lr: float = 0.0
    validation_split: float = 0.0
    validation_patience: int = 3
    min_delta: float = 0.0
    early_stop: float = 0.25
    loss_target: float = 1.2
    max_iters: int = 50
    chunk_tokens: int = 32
    max_train_tokens: int = 0
    name: str = ""

    def to_text(self) -> dict[str, str]:
        """The parameters as text, the form `parse` reads (stored with the job)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = ",".join(value) if isinstance(value, tuple) else str(value)
        return out

    @property
    def lora_targets(self) -> list[str]:
        """The targets as a LoraConfig's target_modules ("all" → every linear layer)."""
        return [contract.ALL_LINEAR] if self.targets == (ALL_TARGETS,) else list(self.targets)


# Where a default is not juno's, and why (juno's value, ours).
JUNO_DEVIATIONS: Mapping[str, str] = {
    "targets": "juno: qv (its llama-family wq, wv); ours: every linear layer, the one default "
    "valid on every architecture a fleet serves (module names differ per model)",
    "validation_patience": "juno: 0; ours: 3 (at least 1): with a validation_split, stop "
    "after three passes without improvement",
}

# Parameters that shape the adapter: applied when the job creates its run.
LORA_SHAPE = ("rank", "alpha", "targets", "dropout", "lora_plus_ratio")
LOSS_TARGET_TEXT = 1.8
TRAINING = frozenset(f.name for f in fields(JobParams)) - {"chunk_tokens", "name"}
ACCEPTED: Mapping[JobKind, frozenset[str]] = {
    JobKind.QA: TRAINING,
    JobKind.TEXT: TRAINING | {"chunk_tokens"},
    JobKind.SAVE: frozenset({"name"}),
}


Number = TypeVar("Number", int, float)
Choice = TypeVar("Choice", bound=StrEnum)


def _number(
    cast: Callable[[str], Number], ok: Callable[[Number], bool], rule: str
) -> Callable[[str, str], Number]:
    def parse(name: str, raw: str) -> Number:
        try:
            value = cast(raw.strip())
        except ValueError:
            kind = "an integer" if cast is int else "a number"
            raise InvalidArgument(f"must be {kind}, got {raw!r}", field=name) from None
        if (isinstance(value, float) and not math.isfinite(value)) or not ok(value):
            raise InvalidArgument(f"must be {rule}, got {raw!r}", field=name)
        return value

    return parse


def _choice(enum: type[Choice]) -> Callable[[str, str], Choice]:
    def parse(name: str, raw: str) -> Choice:
        value = raw.strip().lower()
        try:
            return enum(value)
        except ValueError:
            if name == "schedule" and value in SCHEDULE_ALIASES:
                return SCHEDULE_ALIASES[value]  # type: ignore[return-value]
            known = ", ".join(e.value for e in enum)
            raise InvalidArgument(f"must be one of {known}, got {raw!r}", field=name) from None

    return parse


def _targets(name: str, raw: str) -> tuple[str, ...]:
    if raw.strip().lower() == ALL_TARGETS:
        return (ALL_TARGETS,)
    try:
        return contract.split_lora_options({"lorafleet.target_modules": raw})[0].target_modules
    except InvalidArgument:
        raise InvalidArgument(
            f"must be 'all' or a comma-separated list of module names, got {raw!r}", field=name
        ) from None


def _name(name: str, raw: str) -> str:
    return names.check_name(raw, field=name)


PARSERS: Mapping[str, Callable[[str, str], Any]] = {
    "learning_rate": _number(float, lambda v: v > 0, "> 0"),
    # the upper bound is the trainers' max rank (capabilities), checked at job creation
    "rank": _number(int, lambda v: v >= 1, ">= 1"),
    "alpha": _number(float, *contract.OPTION_RULES["alpha"]),
    "targets": _targets,
    "dropout": _number(float, *contract.OPTION_RULES["dropout"]),
    "seed": _number(int, lambda v: 0 <= v < contract.ENGINE_SEED_LIMIT, "in [0, 2^63)"),
    "lora_plus_ratio": _number(float, *contract.OPTION_RULES["lora_plus_ratio"]),
    "weight_decay": _number(float, *contract.ADAM_RULES["weight_decay"]),
    "max_grad_norm": _number(float, *contract.ADAM_RULES["grad_clip_norm"]),
    "gradient_accumulation": _number(int, lambda v: 1 <= v <= 4096, "in [1, 4096]"),
    "schedule": _choice(Schedule),
    "warmup_steps": _number(int, lambda v: v >= 0, ">= 0"),
    "min_lr": _number(float, lambda v: v >= 0, ">= 0"),
    "validation_split": _number(float, lambda v: 0 <= v < 1, "in [0, 1)"),
    "validation_patience": _number(int, lambda v: v >= 1, ">= 1"),
    "min_delta": _number(float, lambda v: v >= 0, ">= 0"),
    "early_stop": _number(float, lambda v: v >= 0, ">= 0 (0 = off)"),
    "loss_target": _number(float, lambda v: v >= 0, ">= 0 (0 = off)"),
    "max_iters": _number(int, lambda v: 1 <= v <= 100_000, "in [1, 100000]"),
    "chunk_tokens": _number(int, lambda v: 2 <= v <= 65536, "in [2, 65536]"),
    "max_train_tokens": _number(int, lambda v: v >= 0, ">= 0 (0 = unlimited)"),
    "name": _name,
}


def parse(kind: JobKind, raw: Mapping[str, str]) -> JobParams:
    """Text parameters → JobParams, every rule checked; unknown names are refused."""
    accepted = ACCEPTED[kind]
    values: dict[str, Any] = {}
    for name, text in raw.items():
        if name not in accepted:
            known = ", ".join(sorted(accepted)) or "none"
            raise InvalidArgument(
                f"unknown parameter for a {kind.value} job (known: {known})", field=name
            )
        values[name] = PARSERS[name](name, str(text))
    if kind == JobKind.TEXT and "loss_target" not in values:
        values["loss_target"] = LOSS_TARGET_TEXT
    if kind != JobKind.SAVE and "alpha" not in values:
        values["alpha"] = float(values.get("rank", JobParams.rank))
    params = JobParams(**values)
    if params.min_lr > params.learning_rate:
        raise InvalidArgument(
            f"must be <= learning_rate ({params.learning_rate:g}), got {params.min_lr:g}",
            field="min_lr",
        )
    return params
