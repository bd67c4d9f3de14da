"""Which sites (weight matrices, see `sites.py`) a registration's LoRA adapts.

Tinker names targets by flags (train_attn / train_mlp / train_unembed); PEFT users name
them by module ("q_proj", "all-linear", "experts", or a full dotted name). Both resolve here
to an ordered tuple of site names, checked against the model's inventory. Nothing is ever
silently dropped: a flag that matches no matrix of the model, a name that matches nothing,
and a request that includes matrices we cannot adapt (GPT-2's Conv1D, an unknown expert
layout) are each an InvalidArgument naming the field and listing the modules; the caller
may exclude them with `exclude_modules` and try again.
"""

from __future__ import annotations

from collections.abc import Sequence

from lorafleet import contract, peft_experts
from lorafleet.errors import InvalidArgument
from lorafleet_trainer.domain import LoraSpec
from lorafleet_trainer.sites import Site

FLAGS = (("train_attn", "attn"), ("train_mlp", "mlp"), ("train_unembed", "unembed"))
ALL_LINEAR = ("attn", "mlp")  # PEFT's "all-linear": every projection but the output layer


def _matches(site: Site, pattern: str) -> bool:
    return any(contract.module_matches(n, pattern) for n in (site.name, site.module))


def _names(sites: Sequence[Site]) -> list[str]:
    return sorted({n for s in sites for n in (s.name, s.module)})


def _asked(spec: LoraSpec, sites: Sequence[Site]) -> tuple[list[Site], str]:
    """The sites the spec asks for, before exclusions; the field to blame ("" = the flag)."""
    if spec.target_modules:
        # Explicit names mean exactly those modules: the train_* flags (Tinker's coarse
        # defaults, train_unembed on) are ignored, so q_proj,v_proj never adds lm_head.
        contract.check_target_names(
            spec.target_modules, _names(sites), "lora_config.target_modules"
        )
        chosen: list[Site] = []
        for pattern in spec.target_modules:
            if pattern == contract.ALL_LINEAR:
                chosen.extend(s for s in sites if s.category in ALL_LINEAR)
            else:
                chosen.extend(s for s in sites if _matches(s, pattern))
        return chosen, "lora_config.target_modules"
    chosen = []
    for flag, cat in FLAGS:
        if not getattr(spec, flag):
            continue
        found = [s for s in sites if s.category == cat]
        if not found:
            raise InvalidArgument(
                f"{flag} matches no module of this model", field=f"lora_config.{flag}"
            )
        chosen.extend(found)
    if not chosen:
        raise InvalidArgument(
            "no target modules: set target_modules or one of train_attn/train_mlp/train_unembed",
            field="lora_config.target_modules",
        )
    return chosen, ""


def resolve_targets(spec: LoraSpec, sites: Sequence[Site]) -> tuple[str, ...]:
    """Site names to adapt, in model order; raises InvalidArgument (validate only)."""
    chosen, field = _asked(spec, sites)
    contract.check_target_names(spec.exclude_modules, _names(sites), "lora_config.exclude_modules")
    wanted = {s.name for s in chosen if not any(_matches(s, e) for e in spec.exclude_modules)}
    picked = [s for s in sites if s.name in wanted]
    refused = [s for s in picked if not s.adaptable]
    if refused:
        flag = {cat: flag for flag, cat in FLAGS}.get(refused[0].category, "target_modules")
        field = field or f"lora_config.{flag}"
        kinds = sorted({s.why for s in refused})
        raise InvalidArgument(
            f"cannot adapt {len(refused)} of the {len(picked)} weight matrices asked for "
            f"({', '.join(kinds)}): {', '.join(s.name for s in refused)}; "
            "exclude them with exclude_modules to train the rest",
            field=field,
        )
    if not picked:
        raise InvalidArgument(
            "the target and exclude lists leave no module to adapt",
            field="lora_config.target_modules",
        )
    banks = [s for s in picked if s.kind == "experts"]
    if banks and spec.dropout > 0:
        raise InvalidArgument(
            f"LoRA on expert banks takes no dropout (PEFT's target_parameters has none); "
            f"{banks[0].name} is targeted",
            field="lora_config.dropout",
        )
    if spec.share_experts and not banks:
        raise InvalidArgument(
            "share_experts is set but no expert bank is targeted",
            field="lora_config.share_experts",
        )
    return tuple(s.name for s in picked)


def _shortest(targets: list[str], candidates: list[str], depth: int) -> list[str]:
    """The shortest suffix list (of `depth` name parts) that selects exactly `targets`."""
    shorts = sorted({".".join(t.split(".")[-depth:]) for t in targets})
    selected = [c for c in candidates if any(contract.module_matches(c, s) for s in shorts)]
    return shorts if selected == targets else list(targets)


def peft_targets(targets: Sequence[str], sites: Sequence[Site]) -> tuple[list[str], list[str]]:
    """PEFT's `target_modules` and `target_parameters` selecting exactly `targets`."""
    kind = {s.name: s.kind for s in sites}
    linears = [t for t in targets if kind[t] == "linear"]
    banks = [t for t in targets if kind[t] == "experts"]
    all_linears = [s.name for s in sites if s.kind == "linear"]
    all_banks = [s.name for s in sites if s.kind == "experts"]
    modules = _shortest(linears, all_linears, 1) if linears else []
    params = _shortest(banks, all_banks, 2) if banks else []
    return modules, params


def peft_prefixes(targets: Sequence[str], sites: Sequence[Site]) -> dict[str, str]:
    """Each target's PEFT key prefix (the key without `.lora_A.weight`).

    Expert banks of one module differ only in their `base_layer` hops
    (`lorafleet.peft_experts.bank_prefix`).
    """
    by_name = {s.name: s for s in sites}
    per_module: dict[str, list[str]] = {}
    for t in targets:
        if by_name[t].kind == "experts":
            per_module.setdefault(by_name[t].module, []).append(t)
    out = {}
    for t in targets:
        site = by_name[t]
        if site.kind != "experts":
            out[t] = f"base_model.model.{t}"
            continue
        siblings = per_module[site.module]
        out[t] = peft_experts.bank_prefix(
            f"base_model.model.{site.module}", siblings.index(t), len(siblings)
        )
    return out
