"""Which base Linear modules a registration's LoRA adapts.

Tinker names targets by flags (train_attn / train_mlp / train_unembed); PEFT users name
them by module ("q_proj", "all-linear", or a full dotted name). Both resolve here to an
ordered tuple of full module names, checked against the model, so a typo is an
InvalidArgument at bind time instead of a silently untrained adapter.
"""

from __future__ import annotations

from collections.abc import Sequence

from lorafleet.errors import InvalidArgument
from lorafleet_trainer.domain import LoraSpec

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)


def _matches(module: str, pattern: str) -> bool:
    return module == pattern or module.endswith("." + pattern)


def wanted_patterns(spec: LoraSpec) -> list[str]:
    if spec.target_modules:
        wanted: list[str] = []
        for name in spec.target_modules:
            wanted.extend(ATTN + MLP if name == "all-linear" else (name,))
        if spec.train_unembed:
            wanted.extend(UNEMBED)
        return wanted
    wanted = []
    if spec.train_attn:
        wanted.extend(ATTN)
    if spec.train_mlp:
        wanted.extend(MLP)
    if spec.train_unembed:
        wanted.extend(UNEMBED)
    return wanted


def resolve_targets(spec: LoraSpec, linear_modules: Sequence[str]) -> tuple[str, ...]:
    """Full names of the adapted modules, in model order; raises InvalidArgument."""
    wanted = wanted_patterns(spec)
    if not wanted:
        raise InvalidArgument(
            "no target modules: set target_modules or one of train_attn/train_mlp/train_unembed",
            field="lora_config.target_modules",
        )
    for i, name in enumerate(spec.target_modules):
        if name != "all-linear" and not any(_matches(m, name) for m in linear_modules):
            raise InvalidArgument(
                f"no Linear module of the base model is named {name!r}",
                field=f"lora_config.target_modules[{i}]",
            )
    for i, name in enumerate(spec.exclude_modules):
        if not any(_matches(m, name) for m in linear_modules):
            raise InvalidArgument(
                f"no Linear module of the base model is named {name!r}",
                field=f"lora_config.exclude_modules[{i}]",
            )
    targets = tuple(
        m
        for m in linear_modules
        if any(_matches(m, w) for w in wanted)
        and not any(_matches(m, e) for e in spec.exclude_modules)
    )
    if not targets:
        raise InvalidArgument(
            "the target and exclude lists leave no module to adapt",
            field="lora_config.target_modules",
        )
    return targets


def peft_target_modules(targets: Sequence[str], linear_modules: Sequence[str]) -> list[str]:
    """The shortest PEFT `target_modules` list that selects exactly `targets`."""
    shorts = sorted({t.rsplit(".", 1)[-1] for t in targets})
    selected = [m for m in linear_modules if any(_matches(m, s) for s in shorts)]
    if list(selected) == list(targets):
        return shorts
    return list(targets)
